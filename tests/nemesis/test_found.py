"""What the nemesis found, each pinned by a test of its own (beside its seed
in test_nemesis_run.py): the fault alone, the smallest stack that shows it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest
from nats.aio.client import Client

from lorafleet import Client as FleetClient
from lorafleet.artifacts import (
    ArtifactChunkMissingError,
    ArtifactNotFoundError,
    AsyncPublisher,
    download_artifact,
)
from lorafleet.exits import Exit
from lorafleet.names import Names, object_chunk_subject
from lorafleet.nats import _bus as bus
from lorafleet.nats.cluster import NatsCluster
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_schemas.messages import ArtifactKind, JobState
from lorafleet_services.artifact_store.assembly import Key
from lorafleet_services.artifact_store.delivery import RETRY_DELAY_S, Deliveries
from lorafleet_services.artifact_store.streams import Streams
from lorafleet_services.stack import ServiceStartError
from tests import disks
from tests.artifacts.conftest import chunks_of, download, object_chunks, publish
from tests.artifacts.fakes import FakeClock, FakeRecorder, job
from tests.eventually import eventually
from tests.pg import PrivatePostgres
from tests.procs import ServiceProcess
from tests.system.conftest import Stack, system_settings

#: Seconds the scheduler stays paused: past the node timeout (3 s).
PAUSED_S = 4.0
#: Seconds after it resumes in which a false loss would show.
AFTER_S = 3.0
#: Tries of the database the recorder makes while it is down, before it is started.
DOWN_TRIES = 3
#: Seconds a recorder given up on the database has to exit.
EXIT_S = 10.0
#: MiB of the object store's own filesystem (tmpfs) in the disk-full test.
OBJECTS_DISK_MIB = 4
#: Seconds the test's store goes on failing before it gives the job up.
STORE_PATIENCE_S = 10.0
#: Seconds the test's store waits for a write's ack (30 in the service).
WRITE_ACK_TIMEOUT_S = 2.0
#: Seconds the member stays cut off: longer than a JetStream request's
#: timeout, so a start that does not try again has failed by then.
CUT_OFF_S = 8.0


async def test_a_service_started_on_a_cut_off_member_starts_once_it_is_back(
    tmp_path: Path, pg_url: str
) -> None:
    """Seed 3: a scheduler restarted while the member it connected to was cut
    from the other two (a minority partition) exited at start: its layout
    request timed out. It now tries again, and starts once the member is back."""
    cluster = NatsCluster(tmp_path / "cluster")
    await cluster.start()
    proc: ServiceProcess | None = None
    try:
        settings = system_settings(cluster.url, pg_url, tmp_path).with_(replicas=3)
        nc = await bus.connect(settings, "test")
        await bus.ensure_layout(nc.jetstream(), bus.layout_for(settings))
        await bus.drain_quietly(nc)
        await cluster.isolate("nats-3")
        only_there = settings.with_(nats_url=cluster.servers["nats-3"].url)
        proc = ServiceProcess("lorafleet_services.scheduler", only_there)
        starting = asyncio.create_task(proc.start())
        await asyncio.sleep(CUT_OFF_S)
        assert not starting.done(), "the scheduler gave up while the member was cut off"
        await cluster.rejoin("nats-3")
        await starting
        assert proc.running
    finally:
        if proc is not None:
            with contextlib.suppress(Exception):
                await proc.stop()
        await cluster.stop()


async def test_a_scheduler_paused_past_the_node_timeout_loses_no_node(stack: Stack) -> None:
    """Seed 3: a scheduler SIGSTOPped for 3.2 s judged two live nodes lost the
    moment it resumed: its sweep ran before its watch handed it the beats
    that had come meanwhile. The silence was its own, and is forgiven."""
    await stack.add_model()
    await stack.agent("node-1", {"LORAFLEET_STANDIN_STEP_S": "0.1"})
    job = await stack.submit("node-1", params={"max_steps": 120})
    await stack.wait_state(job.id, JobState.RUNNING)
    [scheduler] = stack.schedulers
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(PAUSED_S)
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    await asyncio.sleep(AFTER_S)
    assert scheduler.events("node.lost") == [], scheduler.events("node.lost")
    assert (await stack.get(job.id)).state is JobState.RUNNING


class CommitAckLost(Streams):
    """The object store's stream, where the info's publish is stored but its
    ack never comes (a member killed or cut off between the two), once."""

    def __init__(self, nc: Client) -> None:
        super().__init__(nc.jetstream(), Names())
        self.lose_next = True

    async def commit(self, key: Key, info: dict[str, object]) -> None:
        await super().commit(key, info)
        if self.lose_next:
            self.lose_next = False
            raise nats.errors.TimeoutError


async def test_a_commit_whose_ack_was_lost_keeps_the_objects_chunks(
    nc: Client, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    """Seed 4: a done job's artifact was listed, its info stored, and its chunk
    subject empty. The commit's info was stored but its ack lost; the drop
    that followed purged the chunks as uncommitted, and the retry found the
    object stored and finished the job. The chunks are kept now."""
    recorder = FakeRecorder(job())
    data = b"adapter" * 5000
    msgs = chunks_of(job(), ArtifactKind.PEFT, data, 5000)
    await publish(nc, job(), ArtifactKind.PEFT, msgs)
    deliveries = Deliveries(CommitAckLost(nc), publisher, recorder, FakeClock())
    await deliveries.recover_all()  # the error logged, the delivery dropped
    assert not deliveries.open and recorder.reports == []
    assert await object_chunks(nc) == len(msgs) + 1, "the stored object's chunks were purged"
    await deliveries.recover_all()  # the retry: found stored
    assert [r.kind for r in recorder.reports] == [ArtifactKind.PEFT]
    assert await download(nc, "job1", ArtifactKind.PEFT, tmp_path) == data


async def test_a_listed_artifact_without_its_chunks_fails_its_download_saying_so(
    nc: Client, publisher: AsyncPublisher, tmp_path: Path
) -> None:
    """Seed 4: the download of such an artifact waited for ever. It ends with
    an error naming the job, the artifact and the chunks, and writes nothing."""
    await publish(
        nc, job(), ArtifactKind.PEFT, chunks_of(job(), ArtifactKind.PEFT, b"x" * 9000, 3000)
    )
    await Deliveries(Streams(nc.jetstream(), Names()), publisher, FakeRecorder(job()),
                     FakeClock()).recover_all()  # fmt: skip
    js = nc.jetstream()
    info = await js.object_store(Names().artifacts_bucket)
    nuid = (await info.get_info("job1/peft")).nuid or ""
    await js.purge_stream(f"OBJ_{Names().artifacts_bucket}",
                          subject=object_chunk_subject(Names().artifacts_bucket, nuid))  # fmt: skip
    out = tmp_path / "out" / "job1-peft.tar.gz"
    with pytest.raises(ArtifactChunkMissingError) as e:
        await asyncio.wait_for(download_artifact(js, Names(), "job1", "peft", out), 30)
    said = str(e.value)
    assert "job job1: its peft artifact (job1/peft" in said, said
    assert f"3 of its 3 chunks missing from $O.{Names().artifacts_bucket}.C.{nuid}" in said, said
    assert "lorafleet submit" in said, said
    assert list(out.parent.iterdir()) == [], "something partial is visible"


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL of the test's own, with a database `lorafleet`, stopped."""
    why = PrivatePostgres.unavailable()
    if why is not None:
        pytest.skip(f"no PostgreSQL of the test's own: {why}")
    pg = PrivatePostgres()
    try:
        pg.start()
        pg.stop_now()
        yield pg
    finally:
        pg.remove()


async def test_a_recorder_started_before_its_database_waits_for_it(
    private_postgres: PrivatePostgres, settings: Settings
) -> None:
    """Seed 4: a recorder restarted while PostgreSQL was starting exited at
    once ("the database system is starting up"). It tries again now, logging
    each try, and starts once the database answers."""
    s = settings.with_(database_url=private_postgres.url, database_wait_s=60.0)
    recorder = ServiceProcess("lorafleet_services.recorder", s)
    starting = asyncio.create_task(recorder.start())
    try:
        await eventually(
            lambda: starting.done() or len(recorder.events("database.waiting")) >= DOWN_TRIES,
            "the recorder to try the database again", timeout_s=30.0,
        )  # fmt: skip
        assert not starting.done(), recorder.tail()
        assert recorder.events("database.waiting")[-1]["error"], "a try says why it failed"
        await asyncio.to_thread(private_postgres.start_again)
        await starting
        nc = await bus.connect(s, "test")
        try:
            assert await FleetClient(nc, s).jobs() == []  # it answers
        finally:
            await bus.drain_quietly(nc)
    finally:
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await recorder.stop()


async def test_a_recorder_whose_database_never_answers_exits_saying_so(
    private_postgres: PrivatePostgres, settings: Settings
) -> None:
    s = settings.with_(database_url=private_postgres.url, database_wait_s=2.0)
    recorder = ServiceProcess("lorafleet_services.recorder", s)
    with pytest.raises(ServiceStartError):
        await recorder.start(timeout_s=EXIT_S)
    assert recorder.proc is not None and recorder.proc.returncode == Exit.UNREACHABLE, (
        recorder.tail()
    )
    said = recorder.tail()
    assert "did not answer within LORAFLEET_DATABASE_WAIT_S=2 s" in said, said
    assert "raise LORAFLEET_DATABASE_WAIT_S" in said and "Traceback" not in said, said
    assert recorder.events("database.waiting"), said


async def test_a_recorder_waiting_for_its_database_stops_when_told(
    private_postgres: PrivatePostgres, settings: Settings
) -> None:
    s = settings.with_(database_url=private_postgres.url, database_wait_s=60.0)
    recorder = ServiceProcess("lorafleet_services.recorder", s)
    starting = asyncio.create_task(recorder.start())
    try:
        await eventually(lambda: starting.done() or recorder.events("database.waiting"),
                         "the recorder to wait for the database")  # fmt: skip
        assert await recorder.stop(timeout_s=EXIT_S) == 0, recorder.tail()
        assert recorder.events("service.stopped"), recorder.tail()
    finally:
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await recorder.stop()


@pytest.mark.skipif(disks.unavailable() is not None, reason=str(disks.unavailable()))
async def test_an_artifact_a_full_disk_cannot_take_fails_its_job_saying_why(
    tmp_path: Path,
) -> None:
    """The disk-full fault: the object store's stream on a filesystem of its
    own, full. Its writes time out (nats-server halts the stream on the
    write error, and keeps it halted once the space is back, until it is
    restarted); retried for ever, the job stayed uploading with nothing
    said. After the store's patience the job fails naming the cause,
    nothing of the artifact is listed, and once the space is back and the
    server restarted the store stores again."""
    names = Names()
    store = tmp_path / "nats"
    objects = disks.objects_dir(store, names)
    data = b"adapter" * 5000
    with disks.small_filesystem(objects, OBJECTS_DISK_MIB):
        async with NatsServer(store) as server:
            settings = Settings(nats_url=server.url)
            nc = await bus.connect(settings, "test-disk-full")
            try:
                await bus.ensure_layout(nc.jetstream(), bus.layout_for(settings))
                disks.fill(objects)
                recorder, clock = FakeRecorder(job()), FakeClock()
                await publish(
                    nc, job(), ArtifactKind.PEFT, chunks_of(job(), ArtifactKind.PEFT, data, 5000)
                )
                async with AsyncPublisher(nc) as publisher:
                    deliveries = Deliveries(Streams(nc.jetstream(), names), publisher, recorder,
                                            clock, store_patience_s=STORE_PATIENCE_S,
                                            write_ack_timeout_s=WRITE_ACK_TIMEOUT_S)  # fmt: skip
                    await deliveries.recover_all()  # a try: the write times out
                    assert recorder.jobs["job1"].state is JobState.UPLOADING
                    clock.now_s += STORE_PATIENCE_S + RETRY_DELAY_S
                    await deliveries.recover_all()  # past the patience: given up
                failed = recorder.jobs["job1"]
                assert failed.state is JobState.FAILED and "disk is full" in failed.message
                assert recorder.reports == [] and not deliveries.open
            finally:
                await bus.drain_quietly(nc)
            assert disks.unfill(objects)  # the space back; the stream stays halted until:
            await server.restart()
            nc = await bus.connect(settings, "test-disk-full")
            try:
                with pytest.raises(ArtifactNotFoundError):  # nothing of it is listed
                    await download(nc, "job1", ArtifactKind.PEFT, tmp_path)
                assert not list(tmp_path.glob("dl-job1-*")), "a partial file was written"
                again = job(id="job2")
                recorder = FakeRecorder(again)
                await publish(
                    nc, again, ArtifactKind.PEFT, chunks_of(again, ArtifactKind.PEFT, data, 5000)
                )
                async with AsyncPublisher(nc) as publisher:
                    deliveries = Deliveries(Streams(nc.jetstream(), names), publisher, recorder,
                                            FakeClock())  # fmt: skip
                    await deliveries.recover_all()
                assert [r.kind for r in recorder.reports] == [ArtifactKind.PEFT]
                assert await download(nc, "job2", ArtifactKind.PEFT, tmp_path) == data
            finally:
                await bus.drain_quietly(nc)
