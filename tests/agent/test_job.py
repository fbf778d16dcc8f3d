"""One job through a real agent process and the stand-in trainer, over NATS."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import re
import tarfile

import msgspec
import nats
import psutil
import pytest
from nats.js.kv import KeyValue

from lorafleet.names import Header
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet_schemas.messages import (
    ArtifactChunkHeader,
    ArtifactKind,
    Heartbeat,
    JobState,
    NodeCancelReply,
    NodeCancelRequest,
    StartRequest,
    StatusReport,
)
from lorafleet_services.agent.node.cards import read_cards
from lorafleet_trainer.standin import adapter_files, gguf_bytes
from tests.agent.conftest import Bus, Reports, finished, start_request
from tests.eventually import eventually

_PIDS_RE = re.compile(r"pid=(\d+) child_pid=(\d+)")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def beat_job(kv: KeyValue) -> str | None:
    """The job of node-1's heartbeat now ("<no beat>" while the key holds a
    marker, not a beat: the killed agent's beat expired before the new one)."""
    entry = await kv.get("node-1")
    if entry.value is None:
        return "<no beat>"
    return msgspec.json.decode(entry.value, type=Heartbeat).job


async def trainer_pids(reports: Reports) -> tuple[int, int]:
    r = await reports.until(lambda r: bool(_PIDS_RE.search(r.message)), what="the pids line")
    m = _PIDS_RE.search(r.message)
    assert m is not None
    return int(m.group(1)), int(m.group(2))


async def delivered(fleet: Bus, node: str, job_id: str, kind: ArtifactKind) -> bytes:
    """The artifact's bytes, reassembled from its chunks on the artifacts stream."""
    subject = fleet.settings.names.artifact_chunks(node, job_id, kind.value)
    sub = await fleet.js.subscribe(subject, ordered_consumer=True)
    parts: dict[int, bytes] = {}
    while True:
        msg = await sub.next_msg(timeout=10)
        assert msg.headers is not None
        h = msgspec.json.decode(msg.headers[Header.CHUNK], type=ArtifactChunkHeader)
        parts[h.seq] = msg.data
        if h.last:
            break
    await sub.unsubscribe()
    data = b"".join(parts[i] for i in sorted(parts))
    assert h.count == len(parts) and h.size == len(data)
    assert h.sha256 == hashlib.sha256(data).hexdigest()
    return data


async def test_a_job_runs_to_delivery_with_ordered_reports(fleet: Bus) -> None:
    agent = await fleet.agent(env={"LORAFLEET_STANDIN_STEPS": "6"})
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", "job-ok")
    req = start_request("job-ok", name, sha, artifacts=[ArtifactKind.PEFT, ArtifactKind.GGUF])
    assert (await fleet.start(req)).accepted
    last = await reports.until(lambda r: r.message.startswith("delivered"), what="delivered")

    assert [r.seq for r in reports.items] == list(range(1, last.seq + 1))
    assert all(r.attempt == 1 and r.node == "node-1" for r in reports.items)
    assert reports.states() == [
        JobState.PREPARING,
        JobState.RUNNING,
        JobState.CONVERTING,
        JobState.UPLOADING,
    ]
    steps = [r for r in reports.items if r.loss is not None]
    assert [r.step for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(r.steps == 6 for r in steps)
    losses = [r.loss for r in steps]
    assert losses == sorted(losses, reverse=True) and losses[0] != losses[-1]
    assert [r.peak_mib for r in steps] == [101, 102, 103, 104, 105, 106]
    assert all(r.learning_rate and r.tokens_per_s and r.eta_s is not None for r in steps)
    assert any(r.eval_loss is not None for r in reports.items)
    said = " ".join(r.message for r in reports.items)
    cards = read_cards()
    if cards:  # the card with the most free memory
        best = max(cards, key=lambda c: c.free_mib)
        assert f"training on GPU {best.index} ({best.name}) of node-1" in said
        assert "steps on cuda" in said
    else:
        assert "training on the CPU of node-1" in said
        assert "steps on cpu" in said

    # What was delivered is what the trainer wrote.
    tgz = await delivered(fleet, "node-1", "job-ok", ArtifactKind.PEFT)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(tgz))) as tar:
        files = {
            m.name.rsplit("/", 1)[-1]: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        }
    assert files == adapter_files("job-ok")
    assert await delivered(fleet, "node-1", "job-ok", ArtifactKind.GGUF) == gguf_bytes("job-ok")

    # The job directory is gone after success; the agent is idle again.
    await finished(agent, "job-ok")
    # A late retry of the same start does not run the job twice.
    again = await fleet.start(req)
    assert not again.accepted and "already ran attempt 1 of job job-ok" in again.reason
    assert not (fleet.tmp_path / "agent-node-1" / "jobs" / "job-ok").exists()
    assert len(agent.events("trainer.started")) == 1
    # The stand-in's line that is not the protocol was logged and skipped.
    assert len(agent.events("trainer.line_bad")) == 1
    assert not any("not the protocol" in r.message for r in reports.items)


async def test_busy_retry_cancel_whole_group_then_next_job_and_agent_stop(fleet: Bus) -> None:
    agent = await fleet.agent(
        env={
            "LORAFLEET_STANDIN_STEPS": "400",
            "LORAFLEET_STANDIN_STEP_S": "0.05",
            "LORAFLEET_STANDIN_CHILD": "1",
        }
    )
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", "job-a")
    assert (await fleet.start(start_request("job-a", name, sha))).accepted
    pid, child = await trainer_pids(reports)
    await reports.until(lambda r: (r.step or 0) >= 2, what="step 2")
    assert alive(pid) and alive(child)

    # Busy: another job is refused, naming the running one.
    busy = await fleet.start(start_request("job-b", name, sha))
    assert not busy.accepted and busy.running_job == "job-a" and "busy" in busy.reason
    # A retried start of the running job is accepted and starts nothing.
    assert (await fleet.start(start_request("job-a", name, sha))).accepted
    assert len(agent.events("trainer.started")) == 1
    # The heartbeat names the job it runs.
    kv = await fleet.js.key_value(fleet.settings.names.nodes_bucket)
    hb = msgspec.json.decode((await kv.get("node-1")).value, type=Heartbeat)
    assert hb.job == "job-a"

    reply = await bus.request(
        fleet.nc,
        fleet.settings.names.node_cancel("node-1"),
        NodeCancelRequest(job_id="job-a", reason="asked by a test"),
        NodeCancelReply,
        timeout_s=15,
    )
    assert reply.stopped
    assert not alive(pid) and not alive(child), "a process of the cancelled job survived"
    r = await reports.until_state(JobState.CANCELLED)
    assert "asked by a test" in r.message
    assert reports.states()[-1] == JobState.CANCELLED
    await finished(agent, "job-a")
    # A cancel for a job it does not run stops nothing.
    other = await bus.request(
        fleet.nc,
        fleet.settings.names.node_cancel("node-1"),
        NodeCancelRequest(job_id="job-zzz"),
        NodeCancelReply,
    )
    assert not other.stopped

    # Idle again: the next job is taken.
    reports_b = await fleet.reports("node-1", "job-b")
    assert (await fleet.start(start_request("job-b", name, sha))).accepted
    pid_b, child_b = await trainer_pids(reports_b)
    await reports_b.until_state(JobState.RUNNING)
    # The agent stopped (SIGTERM) mid-job: the job fails, saying so; nothing survives.
    await agent.stop()
    r = await reports_b.until_state(JobState.FAILED)
    assert "stopped" in r.message and "node-1" in r.message
    assert not alive(pid_b) and not alive(child_b)


async def test_a_trainer_ignoring_sigterm_is_killed_after_the_grace(fleet: Bus) -> None:
    agent = await fleet.agent(
        env={"LORAFLEET_STANDIN_HANG": "1", "LORAFLEET_STANDIN_CHILD": "1"},
        cancel_grace_s=1.0,
    )
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", "job-hang")
    assert (await fleet.start(start_request("job-hang", name, sha))).accepted
    pid, child = await trainer_pids(reports)
    await reports.until_state(JobState.RUNNING)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    reply = await bus.request(
        fleet.nc,
        fleet.settings.names.node_cancel("node-1"),
        NodeCancelRequest(job_id="job-hang"),
        NodeCancelReply,
        timeout_s=15,
    )
    assert reply.stopped
    assert loop.time() - t0 >= 1.0, "SIGKILL came before the grace"
    assert not alive(pid) and not alive(child)
    await reports.until_state(JobState.CANCELLED)
    killed = await agent.wait_for_event("trainer.killed")
    assert killed["pid"] == pid


async def test_failures_say_why(fleet: Bus) -> None:
    agent = await fleet.agent(env={"LORAFLEET_STANDIN_FAIL_AT": "3"})
    name, sha = await fleet.upload()

    # The trainer fails: its error line is the job's message.
    reports = await fleet.reports("node-1", "job-fail")
    assert (await fleet.start(start_request("job-fail", name, sha))).accepted
    r = await reports.until_state(JobState.FAILED)
    assert "failed at step 3" in r.message
    assert [x.step for x in reports.items if x.loss is not None] == [1, 2]
    # Kept for reading, without the data.
    kept = fleet.tmp_path / "agent-node-1" / "jobs" / "job-fail"
    await finished(agent, "job-fail")
    assert (kept / "job.json").exists() and not (kept / "data.jsonl").exists()
    assert "failing at step 3" in (kept / "trainer-stderr.txt").read_text()

    # A dataset whose bytes do not match the job's sha256 is refused before training.
    bad = await fleet.reports("node-1", "job-badsha")
    other_sha = hashlib.sha256(b"something else").hexdigest()
    assert (await fleet.start(start_request("job-badsha", name, other_sha))).accepted
    r = await bad.until_state(JobState.FAILED)
    assert "sha256" in r.message and other_sha in r.message
    assert not any(x.state == JobState.RUNNING for x in bad.items)
    assert not any("pid=" in x.message for x in bad.items), "the trainer ran"
    await finished(agent, "job-badsha")

    # A dataset that is not there.
    missing = await fleet.reports("node-1", "job-nodata")
    assert (await fleet.start(start_request("job-nodata", "sha256/none", sha))).accepted
    r = await missing.until_state(JobState.FAILED)
    assert "sha256/none" in r.message and "not in the object store" in r.message
    await finished(agent, "job-nodata")

    # A job id that cannot be a subject token is refused outright, busy or not.
    reply = await fleet.start(start_request("bad.id", name, sha))
    assert not reply.accepted and "bad.id" in reply.reason

    # A request that is not a StartRequest is answered as every service answers
    # one: the micro error headers and lorafleet's JSON error body, naming the field.
    subject = fleet.settings.names.node_start("node-1")
    bad = await fleet.nc.request(subject, b'{"job_id": 5}', timeout=5)
    assert bad.headers is not None and bad.headers["Nats-Service-Error-Code"] == "400"
    error = msgspec.json.decode(bad.data)["error"]
    assert error["code"] == "bad_request" and error["field"] == "$.job_id"
    assert error["message"] == bad.headers["Nats-Service-Error"]


#: An evaluation set of three records (the stand-in's eval loss tells it by its size).
HELD = b'{"q": "a?", "a": "b"}\n{"q": "c?", "a": "d"}\n{"q": "e?", "a": "f"}\n'


async def test_an_evaluation_set_is_fetched_checked_and_given_to_the_trainer(
    fleet: Bus,
) -> None:
    agent = await fleet.agent(env={"LORAFLEET_STANDIN_STEPS": "4"})
    name, sha = await fleet.upload()
    held, held_sha = await fleet.upload(HELD)

    def with_eval(job_id: str, eval_sha: str, eval_name: str = held) -> StartRequest:
        req = start_request(job_id, name, sha)
        return msgspec.structs.replace(req, eval_dataset=eval_name, eval_dataset_sha256=eval_sha)

    reports = await fleet.reports("node-1", "job-eval")
    assert (await fleet.start(with_eval("job-eval", held_sha))).accepted
    await reports.until(lambda r: r.message.startswith("delivered"), what="delivered")
    assert any(r.message == "20 records; 3 in the evaluation set" for r in reports.items)
    # The stand-in's eval loss is its loss plus a thousandth per evaluation record.
    losses = {r.step: r.loss for r in reports.items if r.loss is not None}
    evals = [(r.step, r.eval_loss) for r in reports.items if r.eval_loss is not None]
    assert evals and all(e == pytest.approx(losses[s] + 0.003) for s, e in evals), evals
    await finished(agent, "job-eval")

    # An evaluation set whose bytes are not the job's sha256: refused before training.
    bad = await fleet.reports("node-1", "job-evalsha")
    other = hashlib.sha256(b"another set").hexdigest()
    assert (await fleet.start(with_eval("job-evalsha", other))).accepted
    r = await bad.until_state(JobState.FAILED)
    assert not r.retryable
    assert f"the evaluation set {held!r}" in r.message and other in r.message, r.message
    assert not any("pid=" in x.message for x in bad.items), "the trainer ran"
    await finished(agent, "job-evalsha")

    # One that is not there.
    gone = await fleet.reports("node-1", "job-evalgone")
    assert (await fleet.start(with_eval("job-evalgone", held_sha, "sha256/gone"))).accepted
    r = await gone.until_state(JobState.FAILED)
    assert "the evaluation set 'sha256/gone' is not in the object store" in r.message, r.message
    await finished(agent, "job-evalgone")


async def test_no_card_and_no_cpu_fails_naming_the_node(fleet: Bus) -> None:
    await fleet.agent(allow_cpu=False)
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", "job-nocard")
    req = start_request("job-nocard", name, sha, gpu_memory_mib=10_000_000)
    assert (await fleet.start(req)).accepted
    r = await reports.until_state(JobState.FAILED)
    assert "node-1" in r.message
    assert "10000000 MiB" in r.message or "no GPU" in r.message
    assert not any(x.state == JobState.RUNNING for x in reports.items)


async def test_fenced_agent_stops_its_trainer_and_comes_back_idle(
    fleet: Bus, nats_server: NatsServer
) -> None:
    fleet.settings = fleet.settings.with_(heartbeat_s=0.5, node_timeout_s=2)
    agent = await fleet.agent(
        env={
            "LORAFLEET_STANDIN_STEPS": "1000",
            "LORAFLEET_STANDIN_STEP_S": "0.05",
            "LORAFLEET_STANDIN_CHILD": "1",
        }
    )
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", "job-fence")
    assert (await fleet.start(start_request("job-fence", name, sha))).accepted
    pid, child = await trainer_pids(reports)
    await reports.until_state(JobState.RUNNING)

    await nats_server.stop()
    fenced = await agent.wait_for_event("agent.fenced", timeout_s=15)
    assert fenced["job_id"] == "job-fence"
    await eventually(
        lambda: not alive(pid) and not alive(child),
        "the fenced agent's trainer and its child to end (the trainer survived)",
        timeout_s=5,
        interval_s=0.1,
    )

    await nats_server.start()
    await agent.wait_for_event("agent.unfenced", timeout_s=20)
    kv = await fleet.js.key_value(fleet.settings.names.nodes_bucket)
    await eventually(
        lambda: beat_job(kv),
        "a heartbeat with no job once unfenced",
        until=lambda job: job is None,
        timeout_s=10,
        interval_s=0.2,
        retry_on=(nats.errors.Error, nats.js.errors.Error),
    )
    # Once NATS takes reports again, the job is reported failed, saying the
    # agent fenced itself (a scheduler usually failed it first; the recorder
    # keeps the first failure): one final report, no other.
    # Once NATS takes reports again, the job is reported failed, saying the
    # agent fenced itself (a scheduler usually failed it first; the recorder
    # keeps the first failure). Read from the stream itself: the ordered
    # consumer behind `reports` died with the server.
    status = fleet.settings.names
    last = await eventually(
        lambda: fleet.js.get_last_msg(status.status_stream, status.status("node-1", "job-fence")),
        "the fenced job's last report",
        until=lambda m: b'"failed"' in m.data,
        timeout_s=10,
        retry_on=(nats.errors.Error, nats.js.errors.Error),
    )
    final = msgspec.json.decode(last.data, type=StatusReport)
    assert "the agent on node-1 fenced itself" in final.message, final.message
    assert "NATS unreachable" in final.message, final.message
    # The node's trouble, not the job's: with attempts left it runs again.
    assert final.retryable
    assert final.seq > max(x.seq for x in reports.items if isinstance(x, StatusReport))


async def test_an_agent_killed_outright_leaves_no_trainer_after_its_restart(fleet: Bus) -> None:
    # HANG: the trainer prints nothing more (a real one between two long
    # steps), so no broken pipe would end it; only the parent-death signal can.
    env = {"LORAFLEET_STANDIN_HANG": "1", "LORAFLEET_STANDIN_CHILD": "1"}
    agent = await fleet.agent(env=env)
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", "job-orphan")
    assert (await fleet.start(start_request("job-orphan", name, sha))).accepted
    pid, child = await trainer_pids(reports)
    await reports.until_state(JobState.RUNNING)

    agent.kill()  # SIGKILL: no chance to stop anything
    # The trainer has a parent-death signal: it goes with the agent.
    await eventually(
        lambda: not alive(pid), "the trainer to end with its agent", timeout_s=5, interval_s=0.1
    )

    # What it had started is found by its environment when the agent restarts.
    again = await fleet.agent(env=env)
    assert not alive(child), "a process of the earlier agent's job survived the restart"
    killed = again.events("trainer.killed")
    assert killed and child in killed[0]["pids"]
    assert not (fleet.tmp_path / "agent-node-1" / "jobs" / "job-orphan").exists()
    kv = await fleet.js.key_value(fleet.settings.names.nodes_bucket)
    await eventually(
        lambda: beat_job(kv),
        "a heartbeat with no job after the restart",
        until=lambda job: job is None,
        timeout_s=3,
        interval_s=0.1,
    )


async def test_nats_restart_mid_job_loses_and_doubles_no_report(
    fleet: Bus, nats_server: NatsServer
) -> None:
    # A 6 s node timeout for this agent: the server is down 1.5 s, but its
    # stop, its start and the reconnect come on top, and under a loaded
    # suite the silence reached the default 3 s (the agent fenced, rightly).
    agent = await fleet.agent(
        env={
            "LORAFLEET_STANDIN_STEPS": "60",
            "LORAFLEET_STANDIN_STEP_S": "0.05",
            "LORAFLEET_NODE_TIMEOUT_S": "6",
        }
    )
    name, sha = await fleet.upload()
    reports = await fleet.reports("node-1", "job-restart")
    assert (await fleet.start(start_request("job-restart", name, sha))).accepted
    await reports.until(lambda r: (r.step or 0) >= 5, what="step 5")
    # Down for a quarter of the node timeout: publishes time out and are
    # retried, and the agent does not fence.
    await nats_server.stop()
    await asyncio.sleep(1.5)
    await nats_server.start()
    await finished(agent, "job-restart", timeout_s=30)
    # What the stream holds, read afresh (the old consumer is slow to notice
    # the restart): every report once, in order, though some were published
    # while the server was down.
    reports = await fleet.reports("node-1", "job-restart")
    last = await reports.until(
        lambda r: r.message.startswith("delivered") or r.state == JobState.FAILED,
        what="the end",
    )
    assert last.state != JobState.FAILED, f"{last.message} — {reports.summary()}"
    assert [r.seq for r in reports.items] == list(range(1, last.seq + 1))
    assert [r.step for r in reports.items if r.loss is not None] == list(range(1, 61))
    assert not agent.events("agent.fenced")
