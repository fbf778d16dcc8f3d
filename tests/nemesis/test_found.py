"""What the nemesis found, each pinned by a test of its own (beside its seed
in test_nemesis_run.py): the fault alone, the smallest stack that shows it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client

from lorafleet import Client as FleetClient
from lorafleet import _runtime as runtime
from lorafleet.artifacts import (
    ArtifactChunkMissingError,
    ArtifactNotFoundError,
    AsyncPublisher,
    download_artifact,
)
from lorafleet.errors import UnavailableError
from lorafleet.exits import Exit
from lorafleet.names import Names, object_chunk_subject
from lorafleet.nats import _bus as bus
from lorafleet.nats.cluster import NatsCluster
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from lorafleet_schemas.messages import ArtifactKind, Engine, JobState, ModelSpec, StartReply
from lorafleet_services.artifact_store import service as artifact_store
from lorafleet_services.artifact_store.assembly import Key
from lorafleet_services.artifact_store.delivery import RETRY_DELAY_S, Deliveries
from lorafleet_services.artifact_store.streams import Streams
from lorafleet_services.gateway import service as gateway
from lorafleet_services.gateway.config import GatewayConfig
from lorafleet_services.recorder import service as recorder
from lorafleet_services.stack import ServiceStartError
from tests import disks
from tests.agent.conftest import start_request
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
#: MiB of the database's own filesystem in its disk-full test (initdb takes ~40).
DATABASE_DISK_MIB = 128
#: Writes tried on the full disk before one must fail (each row needs room at last).
DISK_FULL_WRITES = 2000
#: MiB of the object store's own filesystem (tmpfs) in the disk-full test.
OBJECTS_DISK_MIB = 4
#: Seconds the test's store goes on failing before it gives the job up.
STORE_PATIENCE_S = 10.0
#: Seconds the test's store waits for a write's ack (30 in the service).
WRITE_ACK_TIMEOUT_S = 2.0
#: Seconds the starts run on a member without a quorum: past a JetStream
#: request's timeout (5 s), so a step that does not wait has failed by then.
NO_QUORUM_S = 7.0
#: The services whose start has JetStream steps of its own (after the layout),
#: as `runtime.serve` makes them.
STARTS_WAITED: dict[str, runtime.MakeService] = {
    "artifact-store": artifact_store.PROGRAM.make,
    "recorder": recorder.PROGRAM.make,
    "gateway": gateway.program(GatewayConfig(addr="127.0.0.1:0")).make,
}
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

        async def meta_leader_seen() -> object:
            return ((await cluster.monitor("nats-3", "/jsz")).get("meta_cluster") or {}).get(
                "leader"
            )

        # Until it sees no leader: a member that led the meta group (or a
        # stream) answers as leader until it notices it lost its quorum (seconds
        # on a loaded host), and a start through it then succeeds (CI, stop 39).
        await eventually(meta_leader_seen, "nats-3 to see it is cut off", until=lambda v: not v,
                         timeout_s=30.0)  # fmt: skip
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


async def test_starts_that_meet_a_cluster_without_leaders_wait_for_it(
    tmp_path: Path, pg_url: str
) -> None:
    """Issue 33: the artifact-store, SIGTERMed while a member was killed, did
    not come back: its start's recovery (`stream_info`) timed out during the
    election and the process exited. Every JetStream step of a start now waits
    for the cluster (`bus.when_cluster_answers`). Here the starts of the
    services that have such steps run after their layout, on the one member
    left of three: no stream has a leader until the other two are back."""
    cluster = NatsCluster(tmp_path / "cluster")
    await cluster.start()
    settings = system_settings(cluster.url, pg_url, tmp_path).with_(replicas=3)
    settings = settings.with_(nats_url=cluster.servers["nats-1"].url)
    nc = await bus.connect(settings, "test")
    services: dict[str, runtime.Service] = {}
    try:
        await bus.ensure_layout(nc.jetstream(), bus.layout_for(settings))
        for name, make in STARTS_WAITED.items():
            services[name] = await make(nc, settings)
        for member in ("nats-2", "nats-3"):
            await cluster.kill(member)
        starting = {n: asyncio.create_task(s.start()) for n, s in services.items()}
        await asyncio.sleep(NO_QUORUM_S)
        # Waiting, or started where a step happened to be answered (a stream
        # this member led); never given up.
        gave_up = {
            n: repr(t.exception()) for n, t in starting.items() if t.done() and t.exception()
        }
        assert not gave_up, f"gave up without a quorum: {gave_up}"
        for member in ("nats-2", "nats-3"):
            await cluster.servers[member].start()
        await asyncio.wait_for(asyncio.gather(*starting.values()), bus.CLUSTER_WAIT_S)
    finally:
        for service in services.values():
            with contextlib.suppress(Exception):
                await service.stop()
        await bus.drain_quietly(nc)
        await cluster.stop()


async def test_a_cluster_that_never_answers_ends_the_wait_saying_so() -> None:
    """The wait is bounded: then one error that names the step and what to check."""
    tries: list[int] = []

    async def timing_out() -> None:
        tries.append(1)
        raise nats.errors.TimeoutError

    with pytest.raises(bus.ClusterUnavailableError, match="the test step: the NATS cluster"):
        await bus.when_cluster_answers("the test step", timing_out, wait_s=0.3, pause_s=0.1)
    assert len(tries) >= 2, "tried once only"

    async def refused() -> None:
        raise nats.errors.NoServersError

    with pytest.raises(nats.errors.NoServersError):  # not the cluster's election: not waited for
        await bus.when_cluster_answers("the test step", refused, wait_s=5.0)


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


async def test_an_agent_frozen_past_its_fence_takes_no_start_it_finds_on_waking(
    stack: Stack,
) -> None:
    """Seed 16: a start sent to an agent that was frozen (SIGSTOP) past the
    node timeout waited in its socket; the scheduler judged the node lost and
    sent the job elsewhere; the agent, woken, took the start before its fence
    check ran: one job on two nodes. A silent agent now answers unavailable
    ("presumed lost"), and takes a start again once a beat of its is stored."""
    agent = await stack.agent("node-1")
    request = start_request("frozen1", "nothing", "0" * 64)
    subject = stack.settings.names.node_start("node-1")
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(stack.settings.node_timeout_s + 0.5)  # past the fence's bound
        sent = asyncio.create_task(
            bus.request(stack.nc, subject, request, StartReply, timeout_s=10.0)
        )
        await asyncio.sleep(0.3)  # the request waits in the frozen agent's socket
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    with pytest.raises(UnavailableError) as refused:
        await sent
    assert "node-1 is presumed lost" in str(refused.value), refused.value
    # Beating again, it takes starts (this one fails later: no such dataset).
    await eventually(lambda: not agent.events("agent.fenced") or agent.events("agent.unfenced"),
                     "the agent to unfence", timeout_s=15.0)  # fmt: skip
    await asyncio.sleep(1.0)
    again = start_request("frozen2", "nothing", "0" * 64)
    reply = await bus.request(stack.nc, subject, again, StartReply, timeout_s=10.0)
    assert reply.accepted, reply


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


async def test_a_request_while_the_database_restarts_is_unavailable_not_internal(
    private_postgres: PrivatePostgres, settings: Settings
) -> None:
    """Seed 12: while PostgreSQL restarted, the recorder answered every request
    `internal` ("the service failed on this request ... it is logged") and the
    gateway gave its clients 500s, which they do not retry. It is
    `unavailable` now, saying to retry, and answers again once the database does."""
    await asyncio.to_thread(private_postgres.start_again)
    async with recorder_on(private_postgres, settings) as client:
        assert await client.jobs() == []
        await asyncio.to_thread(private_postgres.stop_now)
        with pytest.raises(UnavailableError) as refused:
            await client.jobs()
        said = str(refused.value)
        assert "database does not answer" in said and "retry in a few seconds" in said, said
        await asyncio.to_thread(private_postgres.start_again)
        again = await eventually(client.jobs, "the recorder to answer again", until=lambda _: True,
                                 retry_on=(UnavailableError,), timeout_s=30.0)  # fmt: skip
        assert again == []


@contextlib.asynccontextmanager
async def recorder_on(pg: PrivatePostgres, settings: Settings) -> AsyncIterator[FleetClient]:
    """A recorder process on `pg`'s database, and a client of it."""
    s = settings.with_(database_url=pg.url)
    recorder = ServiceProcess("lorafleet_services.recorder", s)
    await recorder.start()
    nc = await bus.connect(s, "test")
    try:
        yield FleetClient(nc, s)
    finally:
        await bus.drain_quietly(nc)
        await recorder.stop()


async def _first_refusal(client: FleetClient, spec: ModelSpec) -> UnavailableError:
    """Catalog writes until one is refused `unavailable` (each row needs room
    at last); a write refused any other way, or none refused, fails the test."""
    for i in range(DISK_FULL_WRITES):
        try:
            await client.add_model(
                msgspec.structs.replace(spec, name=f"m{i}"), read_architecture=False
            )
        except UnavailableError as e:
            return e
    raise AssertionError(f"{DISK_FULL_WRITES} writes on a full disk, none refused")


@pytest.mark.skipif(disks.unavailable() is not None, reason=str(disks.unavailable()))
async def test_a_write_while_the_databases_disk_is_full_is_unavailable_and_not_half_kept(
    settings: Settings, tmp_path: Path
) -> None:
    """The database's disk full (a fault nobody had named, now the nemesis's
    `postgres.disk_full`): a write is `unavailable` (a 503 to retry, never a
    500), nothing of it is kept, and once the space is back the same write
    takes. The server may stop on a WAL segment it cannot make: it is
    started again then, as an operator would."""
    if (why := PrivatePostgres.unavailable()) is not None:
        pytest.skip(f"no PostgreSQL of the test's own: {why}")
    pg = PrivatePostgres(disk_mib=DATABASE_DISK_MIB)
    try:
        await asyncio.to_thread(pg.start)
        async with recorder_on(pg, settings) as client:
            spec = ModelSpec(name="tiny", engine=Engine.VLLM, local_dir=str(tmp_path))
            await asyncio.to_thread(pg.fill_disk)
            refused = await _first_refusal(client, spec)
            assert "out of disk space" in str(refused) and "retry" in str(refused), refused
            kept = {m.name for m in await client.models()} if pg.running() else None
            await asyncio.to_thread(pg.disk_back)
            after = await eventually(client.models, "the recorder to answer again",
                                     until=lambda _: True, retry_on=(UnavailableError,),
                                     timeout_s=30.0)  # fmt: skip
            names = {m.name for m in after}
            assert kept is None or names == kept, (kept, names)
            await client.add_model(spec, read_architecture=False)
            assert "tiny" in {m.name for m in await client.models()}
    finally:
        await asyncio.to_thread(pg.remove)


async def test_a_recorder_whose_database_never_answers_exits_saying_so(
    private_postgres: PrivatePostgres, settings: Settings
) -> None:
    # 5 s: room for a second try after the first, however slowly the first
    # one starts (at 2 s a loaded machine made only one, so nothing waited).
    s = settings.with_(database_url=private_postgres.url, database_wait_s=5.0)
    recorder = ServiceProcess("lorafleet_services.recorder", s)
    with pytest.raises(ServiceStartError):
        await recorder.start(timeout_s=EXIT_S + 5.0)
    assert recorder.proc is not None and recorder.proc.returncode == Exit.UNREACHABLE, (
        recorder.tail()
    )
    said = recorder.tail()
    assert "did not answer within LORAFLEET_DATABASE_WAIT_S=5 s" in said, said
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
