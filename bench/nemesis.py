"""Faults at random, invariants checked: a seeded nemesis over the whole fleet.

    .venv/bin/python bench/nemesis.py --minutes 5 --seed 1 [--history PATH]

Starts the fleet (bench/nemesis_stack.py: three NATS servers at R3, two
recorders, two schedulers, the artifact-store, three agents with stand-in
trainers and an engine each, two gateways, a PostgreSQL of its own), runs a
stream of jobs (placed and unplaced, some with max_attempts 3, some
cancelled, some with a dataset of over 1 MiB put in the datasets bucket
first, some served on two or all engines) and the gateway's traffic
(bench/nemesis_gateway.py: uploads, jobs, chats, tenancy probes, serving
changes; the engines sampled each second) while the nemesis
(bench/nemesis_faults.py) does faults for `--minutes`, then heals the
fleet, lets every job end, reads the final state and the whole status
stream into the history, and checks it (bench/nemesis_check.py). Exit 0:
no violation; 1: the seed and each violation's window are printed. Every
process, namespace and database it made is gone when it returns.
docs/nemesis.md says what each rule means and what was found.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench.*, tests.*
from bench.nemesis_check import check, client_outcomes, read_history, report
from bench.nemesis_faults import History, Nemesis
from bench.nemesis_gateway import GatewayTraffic
from bench.nemesis_stack import NODES, STEP_S, Fleet, fleet
from tests.system.conftest import DATA, pid_alive

from lorafleet import Client
from lorafleet.names import object_chunk_subjects, object_meta_subjects, object_stream
from lorafleet.nats._natspy import subject_counts
from lorafleet.states import FINAL
from lorafleet_schemas.messages import (
    JobListRequest,
    JobRecord,
    JobSpec,
    StatusReport,
    TrainerParams,
)
from lorafleet_services.artifact_store.sweeper import committed_chunks, decode_info

#: Jobs on their way at once (three nodes: some wait, none waits long).
MAX_ACTIVE = 4
#: Seconds between submissions (a uniform pick).
SUBMIT_GAP_S = (0.5, 2.5)
#: Steps of a job (a uniform pick; STEP_S each).
STEPS = (15, 50)
#: Seconds between polls of the jobs, the logs and the trainers.
POLL_S = 0.5
#: Seconds late a poll of the run's own may wake before it is written as a host stall.
HOST_STALL_S = 1.0
#: Seconds a request waits for its reply before it is tried again.
REQUEST_TIMEOUT_S = 5.0
#: Seconds after the faults every job has to end.
SETTLE_TIMEOUT_S = 180.0
#: Bytes of the datasets that go through the bucket (over NATS's 1 MiB payload).
BIG_DATA_BYTES = 1_200_000
#: Seconds one artifact's download may take at the end (they are 64 KiB).
DOWNLOAD_TIMEOUT_S = 30.0
#: Jobs read per request at the end, and pages at most (a 30-minute run makes ~600).
FINAL_PAGE = 200
FINAL_PAGES = 100
#: Seconds the artifact-store's sweeper waits before an orphan is purged.
ORPHAN_AGE_S = 0.0


class Run:
    """The stream of jobs and what is seen of them, written to the history."""

    def __init__(self, fleet: Fleet, history: History, seed: int) -> None:
        self.fleet = fleet
        self.history = history
        self.rng = random.Random(f"{seed}/jobs")
        self.client = Client(fleet.stack.nc, fleet.stack.settings)
        self.seen: dict[str, tuple[str, str | None, int]] = {}  # job -> state, node, attempt
        self.trainers: dict[int, tuple[str, str, float]] = {}  # pid -> job, node, created
        self.cursors: dict[int, int] = {}
        self.submit_errors = 0
        #: Set while no job seen is active.
        self.all_ended = asyncio.Event()

    def active(self) -> list[str]:
        return [j for j, (state, _, _) in self.seen.items() if state not in _FINAL]

    async def submit_until(self, until: float) -> None:
        while time.monotonic() < until:
            await asyncio.sleep(self.rng.uniform(*SUBMIT_GAP_S))
            if len(self.active()) < MAX_ACTIVE:
                await self._submit_one()

    async def _submit_one(self) -> None:
        rng = self.rng
        node = rng.choice([None, None, *NODES])
        attempts = rng.choice([1, 1, 3])
        steps = rng.randint(*STEPS)
        cancel_after_s = rng.uniform(0.5, steps * STEP_S) if rng.random() < 0.15 else None
        big = rng.random() < 0.15
        # Most are served nowhere (each load is the agent's fetch and probe on
        # these 2 cores); some are placed on two engines or on all.
        serving = rng.choice([None] * 6 + [{"replicas": 2}, "all"])
        try:
            data: dict[str, Any] = {"data": DATA}
            if big:
                data = {"dataset": await self.client.upload_dataset(_big_data(rng))}
            fields = {"model": "tiny", "gpu_memory_mib": 1000, "node": node,
                      "max_attempts": attempts, "params": {"max_steps": steps},
                      "serve": False if serving is None else None, "serving": serving}  # fmt: skip
            spec = msgspec.convert({**fields, **data}, JobSpec)
            job = await asyncio.wait_for(self.client.submit(spec), REQUEST_TIMEOUT_S)
        except Exception as e:  # a fault of the moment: the stream goes on
            self.submit_errors += 1
            self.history.write("job.submit_failed", error=repr(e))
            return
        self.history.write("job.submitted", job=job.id, node=node, max_attempts=attempts,
                           steps=steps, cancel=cancel_after_s is not None, dataset=big,
                           serving=serving)  # fmt: skip
        self._saw(job.id, job.state.value, job.node, job.attempt)
        if cancel_after_s is not None:
            asyncio.get_running_loop().call_later(
                cancel_after_s, lambda: asyncio.ensure_future(self._cancel(job.id))
            )

    async def _cancel(self, job_id: str) -> None:
        self.history.write("job.cancel", job=job_id)
        try:
            await asyncio.wait_for(self.client.cancel(job_id, "nemesis"), REQUEST_TIMEOUT_S)
        except Exception as e:
            self.history.write("job.cancel_failed", job=job_id, error=repr(e))

    def _saw(self, job: str, state: str, node: str | None, attempt: int) -> None:
        if self.seen.get(job) != (state, node, attempt):
            self.seen[job] = (state, node, attempt)
            self.history.write("job.state", job=job, state=state, node=node, attempt=attempt)
        if self.active():
            self.all_ended.clear()
        else:
            self.all_ended.set()

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: the jobs' states, node losses, trainers still alive,
        and this process's own stalls (`host.stall`: its poll woke over
        HOST_STALL_S late; on a loaded machine every process stalls alike, and
        an agent silent for the node timeout is lost though nothing touched it)."""
        woke = time.monotonic()
        while not stop.is_set():
            late_s = time.monotonic() - woke
            if late_s > HOST_STALL_S:
                self.history.write("host.stall", late_s=round(late_s, 2))
            for job in self.active():
                try:
                    rec = await asyncio.wait_for(self.client.get(job), REQUEST_TIMEOUT_S)
                except Exception:
                    continue  # the recorder is down or slow: next round
                self._saw(job, rec.state.value, rec.node, rec.attempt)
            self._read_logs()
            self._sample_trainers()
            woke = time.monotonic() + POLL_S
            await asyncio.sleep(POLL_S)

    def _read_logs(self) -> None:
        for target, proc in self.fleet.services().items():
            start = self.cursors.get(id(proc), 0)
            lines = proc.lines[start:]
            self.cursors[id(proc)] = start + len(lines)
            for line in lines:
                event = line.get("event")
                if event == "node.lost" and target.startswith("scheduler"):
                    self.history.write("node.lost", node=line.get("node"), scheduler=target)
                elif event == "agent.fenced" and target.startswith("agent"):
                    self.history.write("agent.fenced", node=line.get("node"),
                                       message=line.get("message"))  # fmt: skip
                elif event == "trainer.started" and isinstance(line.get("pid"), int):
                    self._trainer(line["pid"], str(line.get("job_id")), target.split(" ")[1])

    def _trainer(self, pid: int, job: str, node: str) -> None:
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return  # gone already
        self.trainers[pid] = (job, node, created)
        self.history.write("trainer.started", job=job, node=node, pid=pid)

    def alive_trainers(self) -> list[tuple[int, str, str]]:
        """(pid, job, node) of the trainers still running (the same process: its
        start time is the one seen first)."""
        out = []
        for pid, (job, node, created) in self.trainers.items():
            try:
                same = psutil.Process(pid).create_time() == created
            except psutil.Error:
                continue
            if same and pid_alive(pid):
                out.append((pid, job, node))
        return out

    def _sample_trainers(self) -> None:
        alive = self.alive_trainers()
        if alive:
            self.history.write("trainers.alive", trainers=[
                {"pid": pid, "job": job, "node": node} for pid, job, node in alive])  # fmt: skip
        for pid, job, node in alive:
            if self.seen.get(job, ("",))[0] in _FINAL:
                self.history.write("trainer.alive", job=job, node=node, pid=pid)


_FINAL = frozenset(s.value for s in FINAL)


def _big_data(rng: random.Random) -> bytes:
    """NDJSON pairs of over BIG_DATA_BYTES (a long answer each), new each time."""
    salt = rng.randrange(1 << 30)
    lines, size, i = [], 0, 0
    while size < BIG_DATA_BYTES:
        line = json.dumps({"q": f"what is {salt}+{i}?", "a": f"{salt + i} " + "x" * 4000}) + "\n"
        lines.append(line)
        size += len(line)
        i += 1
    return "".join(lines).encode()


async def settle(run: Run) -> None:
    """Until every job has ended (SETTLE_TIMEOUT_S at most), then the trainers'
    grace: a trainer alive after it is one that outlived its job."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(run.all_ended.wait(), SETTLE_TIMEOUT_S)
    settings = run.fleet.stack.settings
    await asyncio.sleep(settings.node_timeout_s + 2.0)


async def record_final(run: Run, tmp: Path) -> None:
    """The final state into the history: every job (its curve and artifacts,
    downloaded and hashed), orphaned chunks, live trainers, the status stream."""
    history, client = run.history, run.client
    jobs: list[JobRecord] = []
    for _ in range(FINAL_PAGES):  # pages: a thousand jobs pass a NATS message's size
        page = await client.jobs(
            JobListRequest(limit=FINAL_PAGE, after=jobs[-1].id if jobs else None)
        )
        jobs += page
        if len(page) < FINAL_PAGE:
            break
    for rec in jobs:
        curve = await client.curve(rec.id)
        artifacts = []
        for art in await client.artifacts(rec.id):
            out = tmp / "downloads" / f"{rec.id}-{art.kind.value}"
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                await asyncio.wait_for(client.download(rec.id, art.kind, out), DOWNLOAD_TIMEOUT_S)
                digest = hashlib.sha256(out.read_bytes()).hexdigest()
                ok, why = digest == art.sha256, f"its sha256 is {digest}, not {art.sha256}"
            except TimeoutError:
                # Seen (seed 4): the object's info is there, its chunk is not,
                # and the download waits for it for ever.
                ok, why = False, f"does not download within {DOWNLOAD_TIMEOUT_S:.0f} s"
            except Exception as e:
                ok, why = False, f"does not download: {e!r}"
            artifacts.append({"kind": art.kind.value, "ok": ok, "why": "" if ok else why})
        steps = _steps_of(rec.params)
        history.write("final.job", job=rec.id, state=rec.state.value, steps=steps,
                      curve_steps=[p.step for p in curve.points], artifacts=artifacts,
                      serving=msgspec.to_builtins(rec.serving))  # fmt: skip
    await _record_orphans(run)
    history.write("final.trainers", alive=[pid for pid, _, _ in run.alive_trainers()])
    await _record_status_stream(run)


def _steps_of(params: TrainerParams) -> int:
    return params.max_steps or 5


async def _record_orphans(run: Run) -> None:
    js, names = run.fleet.stack.js, run.fleet.stack.settings.names
    bucket = names.artifacts_bucket
    stream = object_stream(bucket)
    chunks = await subject_counts(js, stream, object_chunk_subjects(bucket))
    metas = await subject_counts(js, stream, object_meta_subjects(bucket))
    infos = [decode_info((await js.get_last_msg(stream, s)).data or b"") for s in metas]
    committed = committed_chunks(names, infos)
    for subject in chunks:
        if subject not in committed:
            raw = await js.get_last_msg(stream, subject)
            newest = raw.time.timestamp() if raw.time is not None else 0.0
            run.history.write("final.orphan", subject=subject, newest_wall=newest)


async def _record_status_stream(run: Run) -> None:
    """Every report in the status stream, from its first message to its last."""
    js, names = run.fleet.stack.js, run.fleet.stack.settings.names
    last = (await js.stream_info(names.status_stream)).state.last_seq
    sub = await js.subscribe(names.status_subjects, ordered_consumer=True)
    try:
        seq = 0
        while seq < last:
            msg = await sub.next_msg(timeout=10.0)
            seq = msg.metadata.sequence.stream
            if msg.subject.endswith(".serving"):  # a ServingReport (an engine's load), not a job's
                continue
            r = msgspec.json.decode(msg.data, type=StatusReport)
            run.history.write("status", job=r.job_id, node=r.node, attempt=r.attempt, seq=r.seq,
                              time=r.time.timestamp(), state=r.state.value if r.state else None,
                              step=r.step, stored=msg.metadata.timestamp.timestamp())  # fmt: skip
    finally:
        await sub.unsubscribe()


async def run_nemesis(minutes: float, seed: int, history_path: Path) -> int:
    history = History(history_path)
    with tempfile.TemporaryDirectory(prefix="lorafleet-nemesis-") as tmp:
        root = Path(tmp)
        async with fleet(root, ORPHAN_AGE_S, minutes) as made:
            s = made.stack.settings
            history.write("run.start", seed=seed, minutes=minutes, node_timeout_s=s.node_timeout_s,
                          step_s=STEP_S, cancel_grace_s=1.0, orphan_age_s=ORPHAN_AGE_S,
                          kinds=made.kinds(), skipped=made.skipped,
                          base=str(made.engines[NODES[0]].base) if made.engines else None,
                          load=os.getloadavg())  # fmt: skip
            history.write("store.started")
            try:
                await _run_in(made, history, minutes, seed, root)
            finally:  # a run that hangs and is stopped keeps them too
                _keep_logs(made, history_path)
    history.close()
    return _verdict(history_path)


async def _run_in(made: Fleet, history: History, minutes: float, seed: int, root: Path) -> None:
    """The jobs and the faults for `minutes`, the settling, the final state."""
    run, nemesis = Run(made, history, seed), Nemesis(made, history, seed)
    traffic = GatewayTraffic(made, history, seed, run)
    stop = asyncio.Event()
    watcher = asyncio.create_task(run.watch(stop))
    sampler = asyncio.create_task(traffic.sample_engines(stop))
    loads = asyncio.create_task(_sample_load(history, stop))
    until = time.monotonic() + minutes * 60
    try:
        await asyncio.gather(run.submit_until(until), nemesis.run(until), traffic.run_until(until))
        await nemesis.heal()
        history.write("faults.over")
        await settle(run)
        # An engine fault late in the run has its bound to show in what the engines hold.
        await asyncio.sleep(max(0.0, nemesis.engines_settle_until - time.monotonic()))
        stop.set()
        await asyncio.gather(watcher, sampler, loads)
        run._read_logs()
        await record_final(run, root)
        await traffic.record_final()
    finally:
        await traffic.close()
    history.write("run.end", faults=nemesis.done, jobs=len(run.seen),
                  submit_errors=run.submit_errors, **traffic.counts)  # fmt: skip


async def _sample_load(history: History, stop: asyncio.Event) -> None:
    """The machine's load average every 30 s (the machine is shared)."""
    while not stop.is_set():
        history.write("host.load", load=os.getloadavg())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 30.0)


def _keep_logs(made: Fleet, history_path: Path) -> None:
    """Each service's log lines beside the history (`<history>.logs/<name>.log`):
    what explains a violation is often in them."""
    logs = history_path.with_name(history_path.name + ".logs")
    logs.mkdir(exist_ok=True)
    for target, proc in made.services().items():
        (logs / f"{target.replace(' ', '-')}.log").write_text("".join(proc.raw))


def _verdict(history_path: Path) -> int:
    entries = read_history(history_path)
    end = entries[-1]
    print(f"faults: {json.dumps(end.get('faults'), sort_keys=True)}")
    print(f"jobs: {end.get('jobs')} ({end.get('submit_errors')} submissions failed)")
    traffic = {k: end.get(k) for k in ("uploads", "uploads_ok", "chats", "chats_ok",
                                       "gateway_jobs", "serving_changes")}  # fmt: skip
    print(f"gateway: {json.dumps(traffic)}")
    loads = [e["load"][0] for e in entries if e["kind"] == "host.load"]
    if loads:
        print(f"load average (1 min): {min(loads):.1f}-{max(loads):.1f}")
    skipped = entries[0].get("skipped") or {}
    for kind, why in sorted(skipped.items()):
        print(f"skipped {kind}: {why}")
    for kind, seen in sorted(client_outcomes(entries).items()):
        print(f"clients during {kind}: {json.dumps(seen, sort_keys=True)}")
    violations = check(entries)
    if violations:
        print(report(entries, violations))
        return 1
    print(f"seed {entries[0]['seed']}: no violation (history: {history_path})")
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="of faults (default 5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--history", type=Path, default=Path("nemesis-history.jsonl"))
    args = ap.parse_args()
    sys.exit(asyncio.run(run_nemesis(args.minutes, args.seed, args.history)))


if __name__ == "__main__":
    main()
