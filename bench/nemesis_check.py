"""The nemesis's checker: plain functions over a history (docs/nemesis.md).

A history is a list of dicts, one per line of the run's JSON-lines file,
each with `kind`, `mono` (time.monotonic() of the run) and `wall` (epoch
seconds); an entry's index in the list is its line number from 0. The
runner (bench/nemesis.py) writes these kinds:

- `run.start`: seed, node_timeout_s, step_s, cancel_grace_s, orphan_age_s.
- `fault.start` / `fault.end`: id, fault, target, and `node` when the
  fault touches an agent or its link (a fault without an end lasts to the
  run's end).
- `job.submitted`: job, node (or null), max_attempts, steps, cancel.
- `job.state`: job, state, node, attempt (a change seen by polling).
- `status`: job, node, attempt, seq, time (the report's own, epoch
  seconds, on its node's clock), state, step, stored (when the stream stored
  it, on the host's clock) (every report in the status stream, read from it).
- `clock.offset`: node, offset_s (a node's wall clock set that far from the
  host's, at this entry's `wall`; 0: back in time).
- `node.lost`: node, scheduler (a scheduler's `node.lost` log line).
- `host.stall`: late_s (the runner's own poll woke that late: the machine stalled it).
- `agent.fenced`: node, message (an agent's `agent.fenced` log line: it stopped
  its trainer, its beats unacknowledged; evidence, not an excuse).
- `trainer.alive`: job, pid (a trainer process seen alive after its job ended, sampled).
- `trainers.alive`: trainers [{pid, job, node}] (every trainer process alive
  at one sample, each poll).
- `final.job`: job, state, steps, curve_steps, artifacts [{kind, ok, why}],
  serving (its placement policy, as the recorder holds it).
- `final.orphan`: subject, newest_wall (an object chunk no object refers to).
- `final.trainers`: alive [pids] (trainer processes left at the end).
- `store.started`: the artifact-store (re)started (it sweeps at start).
- `fault.error`: fault, target, error (a fault's do or undo failed: a
  restarted service did not start, the cluster did not become ready).
- `heal`: target (a service found not running once the faults were over).
- `engines`, `final.engines`: adapters {node: [served names] or null} (each
  engine's `/v1/models`, sampled each second; null: it did not answer).
- `fault.start` of an engine fault (`engine.*`) carries `engine`: its node.
- `serving.change`: job, action (`unserve`, `serve`), node.
- `chat`: project, gateway, model, job (null for the base), stream, status,
  text (what came, a broken stream's part), whole, error.
- `upload`: project, filename, sha256, bytes, status, file (its id when
  answered 200); `final.files`: project, files [{id, filename, bytes,
  sha256 (of the content downloaded, null if it did not), why}].
- `tenancy.list`, `final.tenancy`: project, files [{id, filename}], jobs
  [{id, project (the job's metadata)}] (what a key of the project lists);
  `tenancy.get`: project, owner, what (file, job), id, status (a key asking
  for another project's file or job by id).
- `job.submitted` may carry `serving` (a placement policy) and `via`.

`check(history)` returns every violation of the rules below, each with the
indices of the entries that show it; `window()` the smallest stretch of the
history around them, for a person to read.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Entry = dict[str, Any]

#: The job states that end a job (lorafleet.states.FINAL, as the wire spells them).
FINAL_STATES = frozenset({"done", "failed", "cancelled"})
#: Seconds an attempt may take beyond its training and the node timeout: a
#: start request the agent did not answer is sent again by the scheduler's
#: reconcile some 30 s later (seen in runs: a link cut as it was sent), then
#: the start on a loaded 2-core machine, the delivery, a retry's requeue.
ATTEMPT_SLACK_S = 40.0
#: Seconds after its node was last touched that a lost node is still explained.
LOSS_SLACK_S = 3.0
#: Seconds a trainer may outlive its job (beyond node timeout and cancel grace):
#: the agent's fence and the process group's kill.
TRAINER_SLACK_S = 5.0
#: Seconds before its first evidence whose faults a window quotes too.
WINDOW_LOOKBACK_S = 10.0
#: Entries quoted at most in a window.
WINDOW_MAX_ENTRIES = 40
#: Seconds after its engine is back (killed or restarted: it comes back
#: empty) that an adapter it held is on as many engines as before, plus the
#: time faults were under way meanwhile: the agent's engine read (0.5 s),
#: a placement round (1 s) or the desired set's reload, the fetch from the
#: store and the probe, on a loaded 2-core machine.
SERVED_BOUND_S = 30.0
#: Seconds a node's process may read its old clock offset after a step
#: (tests/clock_step.py READ_EVERY_S), and a report's stamp may pass the
#: time the stream stored it (one host's clock, read apart).
CLOCK_READ_S = 1.0
STORED_SLACK_S = 0.5
#: Engines an adapter of each placement policy is on at the end (3 nodes).
PLACED_ENGINES = {"all": 3, "replicas": 2}


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    message: str
    #: Indices of the history entries that show it.
    evidence: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FaultSpan:
    fault: str
    target: str
    node: str | None
    start: float
    end: float
    index: int


def read_history(path: Path) -> list[Entry]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _run_start(history: list[Entry]) -> Entry:
    for entry in history:
        if entry["kind"] == "run.start":
            return entry
    raise ValueError("the history has no run.start entry")


def _of(history: list[Entry], kind: str) -> Iterator[tuple[int, Entry]]:
    return ((i, e) for i, e in enumerate(history) if e["kind"] == kind)


def fault_spans(history: list[Entry]) -> list[FaultSpan]:
    """Each fault from its start to its end (the run's last time if it never ended)."""
    last = history[-1]["mono"] if history else 0.0
    ends = {e["id"]: e["mono"] for _, e in _of(history, "fault.end")}
    return [
        FaultSpan(e["fault"], e["target"], e.get("node"), e["mono"], ends.get(e["id"], last), i)
        for i, e in _of(history, "fault.start")
    ]


def _outage_s(spans: Iterable[FaultSpan], start: float, end: float) -> float:
    """Seconds of [start, end] some fault was under way (overlaps counted once)."""
    cuts = sorted((max(s.start, start), min(s.end, end)) for s in spans)
    total, reach = 0.0, start
    for lo, hi in cuts:
        if hi <= reach:
            continue
        total += hi - max(lo, reach)
        reach = hi
    return total


def check(history: list[Entry]) -> list[Violation]:
    """Every violation of the run's rules, in rule order."""
    return [
        *final_within_bound(history),
        *one_node_at_a_time(history),
        *one_trainer_at_a_time(history),
        *done_jobs_whole(history),
        *no_false_node_loss(history),
        *no_trainer_outlives_its_job(history),
        *no_orphans_after_sweep(history),
        *everything_comes_back(history),
        *served_after_engine_back(history),
        *placed_served_at_end(history),
        *right_adapter(history),
        *uploads_whole(history),
        *projects_apart(history),
        *faults_are_retries(history),
    ]


def _first_final(history: list[Entry]) -> dict[str, tuple[int, Entry]]:
    found: dict[str, tuple[int, Entry]] = {}
    for i, e in _of(history, "job.state"):
        if e["state"] in FINAL_STATES and e["job"] not in found:
            found[e["job"]] = (i, e)
    return found


def _first_dispatch(history: list[Entry]) -> dict[str, tuple[int, Entry]]:
    found: dict[str, tuple[int, Entry]] = {}
    for i, e in _of(history, "job.state"):
        if e["state"] != "queued" and e["job"] not in found:
            found[e["job"]] = (i, e)
    return found


def final_within_bound(history: list[Entry]) -> Iterator[Violation]:
    """Every job ends within max_attempts x (training + node timeout + slack)
    of its first dispatch (before it, it waits its turn: a placed job behind
    the others on its node), plus the time faults were under way meanwhile;
    none is left active, whether it was dispatched or not."""
    run = _run_start(history)
    spans = fault_spans(history)
    finals = _first_final(history)
    dispatched = _first_dispatch(history)
    last = {e["job"]: (i, e) for i, e in _of(history, "final.job")}
    # Any job at the end, the ones whose submission went unanswered included.
    for j, end in last.values():
        if end["state"] not in FINAL_STATES:
            yield Violation("final-state", f"job {end['job']} is still {end['state']}", (j,))
    for i, sub in _of(history, "job.submitted"):
        job = sub["job"]
        if job in last and last[job][1]["state"] not in FINAL_STATES:
            continue
        if job not in finals:
            yield Violation("final-state", f"job {job} was never seen in a final state", (i,))
            continue
        j, end = finals[job]
        k, begun = dispatched.get(job, (i, sub))
        attempt_s = sub["steps"] * run["step_s"] + run["node_timeout_s"] + ATTEMPT_SLACK_S
        outage_s = _outage_s(spans, begun["mono"], end["mono"])
        bound_s = sub["max_attempts"] * attempt_s + outage_s
        took_s = end["mono"] - begun["mono"]
        if took_s > bound_s:
            yield Violation(
                "final-state",
                f"job {job} took {took_s:.1f} s from its dispatch to its end ({end['state']}); "
                f"its bound is {bound_s:.1f} s ({sub['max_attempts']} attempts, faults included)",
                (i, k, j),
            )


def clock_offsets(history: list[Entry]) -> dict[str, list[tuple[float, float]]]:
    """Node -> its clock's offsets from the host's, each from the wall time it
    was set: [(-inf, 0.0), (since, offset_s), ...]."""
    offsets: dict[str, list[tuple[float, float]]] = defaultdict(lambda: [(-math.inf, 0.0)])
    for _, e in _of(history, "clock.offset"):
        offsets[e["node"]].append((e["wall"], e["offset_s"]))
    return offsets


def host_time(stamp: float, stored: float | None, offsets: list[tuple[float, float]]) -> float:
    """A report's time on the host's clock. Its node stamped it with the host's
    time plus the offset then in force; each offset gives one reading where
    it falls in its own stretch. A node stepped back stamps times it already
    stamped before the step, so of the readings the one kept is the latest
    not after the stream stored the report (stamped before it is stored)."""
    readings = []
    for k, (since, offset_s) in enumerate(offsets):
        until = offsets[k + 1][0] if k + 1 < len(offsets) else math.inf
        reading = stamp - offset_s
        if since - CLOCK_READ_S <= reading <= until + CLOCK_READ_S:
            readings.append(reading)
    if not readings:
        return stamp
    before = [t for t in readings if stored is None or t <= stored + STORED_SLACK_S]
    return max(before) if before else min(readings)


def one_node_at_a_time(history: list[Entry]) -> Iterator[Violation]:
    """No two attempts of a job report at overlapping times (the status stream's
    own reports, by their times on the host's clock): a job never runs in
    two places at once."""
    spans: dict[str, dict[tuple[str, int], list[int]]] = defaultdict(lambda: defaultdict(list))
    offsets = clock_offsets(history)
    at: dict[int, float] = {}
    for i, e in _of(history, "status"):
        spans[e["job"]][(e["node"], e["attempt"])].append(i)
        at[i] = host_time(e["time"], e.get("stored"), offsets[e["node"]])
    for job, by_attempt in spans.items():
        ranges = sorted(
            (min(at[i] for i in idx), max(at[i] for i in idx), key, idx)
            for key, idx in by_attempt.items()
        )
        # Each range against the one reaching furthest before it (a long
        # attempt may overlap one that is not its neighbour).
        _, hi_a, key_a, idx_a = ranges[0]
        for lo_b, hi_b, key_b, idx_b in ranges[1:]:
            if lo_b < hi_a:
                last_a = max(idx_a, key=lambda i: at[i])
                first_b = min(idx_b, key=lambda i: at[i])
                yield Violation(
                    "one-node",
                    f"job {job}: attempt {key_a[1]} on {key_a[0]} reported until "
                    f"{hi_a:.3f} while attempt {key_b[1]} on {key_b[0]} had reported "
                    f"since {lo_b:.3f}",
                    (min(first_b, last_a), max(first_b, last_a)),
                )
            if hi_b > hi_a:
                hi_a, key_a, idx_a = hi_b, key_b, idx_b


def one_trainer_at_a_time(history: list[Entry]) -> Iterator[Violation]:
    """No two trainer processes of one job alive at one sample: a job whose
    trainer goes on after its reports stopped (an agent fenced, its reports
    dropped) runs in two places as surely as one that still reports."""
    for i, e in _of(history, "trainers.alive"):
        by_job: dict[str, list[Entry]] = defaultdict(list)
        for t in e["trainers"]:
            by_job[t["job"]].append(t)
        for job, trainers in by_job.items():
            if len(trainers) > 1:
                where = ", ".join(f"{t['pid']} on {t['node']}" for t in trainers)
                yield Violation("one-node", f"job {job} has trainers alive at once: {where}", (i,))


def done_jobs_whole(history: list[Entry]) -> Iterator[Violation]:
    """A done job's effective curve has every step once; every artifact listed
    for any job downloads whole and matches its sha256."""
    for i, e in _of(history, "final.job"):
        job = e["job"]
        if e["state"] == "done":
            steps = e["curve_steps"]
            want = list(range(1, e["steps"] + 1))
            if sorted(steps) != want:
                missing = sorted(set(want) - set(steps))
                twice = sorted({s for s in steps if steps.count(s) > 1})
                yield Violation(
                    "whole-curve",
                    f"job {job} is done but its curve misses steps {missing} and has "
                    f"{twice} more than once",
                    (i,),
                )
            if not e["artifacts"]:
                yield Violation("artifacts", f"job {job} is done with no artifact", (i,))
        for art in e["artifacts"]:
            if not art["ok"]:
                yield Violation(
                    "artifacts", f"job {job}'s {art['kind']} is listed but {art['why']}", (i,)
                )


def no_false_node_loss(history: list[Entry]) -> Iterator[Violation]:
    """A node judged lost was touched (its agent killed, stopped or paused, or
    its link cut or degraded) shortly before or during the loss."""
    run = _run_start(history)
    spans = [s for s in fault_spans(history) if s.node is not None]
    allow_s = run["node_timeout_s"] + LOSS_SLACK_S
    for i, e in _of(history, "node.lost"):
        at = e["mono"]
        if not any(s.node == e["node"] and s.start <= at <= s.end + allow_s for s in spans):
            yield Violation(
                "false-loss",
                f"{e['scheduler']} judged node {e['node']} lost though neither it nor its "
                f"link had been touched in the {allow_s:.0f} s before",
                (i,),
            )


def no_trainer_outlives_its_job(history: list[Entry]) -> Iterator[Violation]:
    """A trainer seen alive after its job ended (and its node was last touched)
    by more than node timeout + cancel grace + slack; none left at the end."""
    run = _run_start(history)
    finals = _first_final(history)
    spans = [s for s in fault_spans(history) if s.node is not None]
    grace_s = run["node_timeout_s"] + run["cancel_grace_s"] + TRAINER_SLACK_S
    nodes = {e["job"]: e["node"] for _, e in _of(history, "job.state")}
    for i, e in _of(history, "trainer.alive"):
        if e["job"] not in finals:
            continue
        j, end = finals[e["job"]]
        node = e.get("node") or nodes.get(e["job"])
        since = max([end["mono"], *(s.end for s in spans if s.node == node)])
        if e["mono"] - since > grace_s:
            yield Violation(
                "trainer-outlives",
                f"trainer {e['pid']} of job {e['job']} alive {e['mono'] - end['mono']:.1f} s "
                f"after the job ended {end['state']}",
                (j, i),
            )
    for i, e in _of(history, "final.trainers"):
        if e["alive"]:
            yield Violation("trainer-outlives", f"trainers left at the end: {e['alive']}", (i,))


def no_orphans_after_sweep(history: list[Entry]) -> Iterator[Violation]:
    """No object chunk that no object refers to, older than the orphan age, has
    survived the artifact-store's last sweep (one at each start)."""
    run = _run_start(history)
    starts = [e["wall"] for _, e in _of(history, "store.started")]
    last_sweep = max(starts, default=None)
    for i, e in _of(history, "final.orphan"):
        if last_sweep is None:
            continue
        if e["newest_wall"] + run["orphan_age_s"] < last_sweep:
            yield Violation(
                "orphan",
                f"{e['subject']} is referred to by no object and was written before the "
                "artifact-store's last sweep",
                (i,),
            )


def everything_comes_back(history: list[Entry]) -> Iterator[Violation]:
    """Every fault is undone (a killed service starts again, a member rejoins)
    and no service is found down once the faults are over (it died by itself,
    or its restart failed)."""
    for i, e in _of(history, "fault.error"):
        yield Violation(
            "comes-back", f"{e['fault']} of {e['target']} was not undone: {e['error'][-300:]}", (i,)
        )
    for i, e in _of(history, "heal"):
        yield Violation("comes-back", f"{e['target']} was down after the faults", (i,))


def _engine_samples(history: list[Entry]) -> list[tuple[int, Entry]]:
    return [(i, e) for i, e in enumerate(history) if e["kind"] in ("engines", "final.engines")]


def _holders(sample: Entry, adapter: str) -> set[str]:
    """The nodes whose engine lists `adapter` in `sample`."""
    return {node for node, names in sample["adapters"].items() if names and adapter in names}


def served_after_engine_back(history: list[Entry]) -> Iterator[Violation]:
    """An engine killed or restarted comes back empty; within SERVED_BOUND_S of
    its return (plus the faults meanwhile) each adapter it held is on as many
    engines as it was before the fault (its node's agent loads its desired
    set again, or the placement put it elsewhere), no more than its replica
    policy's N, unless the run unserved it (after, or within SERVED_BOUND_S
    before, the sample that listed it)."""
    samples = _engine_samples(history)
    spans = fault_spans(history)
    # A replica policy's surplus (one placed before another is unloaded) is not
    # owed. The final read knows it too for a job whose submission the run
    # took for failed (its reply lost) though it was made: seed 47.
    replicas = {
        e["job"]: int(e["serving"]["replicas"])
        for _, e in _of_any(history, ("final.job", "job.submitted"))
        if isinstance(e.get("serving"), dict)
    }
    unserved = defaultdict(list)
    for _, e in _of(history, "serving.change"):
        if e["action"] == "unserve":
            unserved[e["job"]].append(e["mono"])
    for span in spans:
        if span.fault not in ("engine.kill", "engine.restart"):
            continue
        node = span.target.split(" ", 1)[1]
        before = [(i, s) for i, s in samples
                  if s["mono"] < span.start and s["adapters"].get(node) is not None]  # fmt: skip
        if not before:
            continue
        b, sample = before[-1]
        others = [s for s in spans if s is not span]
        limit = span.end + SERVED_BOUND_S
        limit += _outage_s(others, span.end, limit)
        after = [(i, s) for i, s in samples if span.end <= s["mono"] <= limit]
        # Another engine killed or restarted meanwhile owes its adapters from
        # its own return, under its own span (seed 47's second hour: node-2's,
        # killed 36 s after node-1's return, had it back 12 s after its own).
        again = {
            s.target.split(" ", 1)[1]
            for s in others
            if s.fault in ("engine.kill", "engine.restart") and span.start <= s.start <= limit
        } - {node}
        for adapter in sample["adapters"][node]:
            job = adapter.rsplit("-", 1)[0]
            # Unserved since the sample, or just before it with the unload
            # still under way when sampled (seed 44's hour: asked 0.3 s before
            # the sample that listed it, 0.6 s before the engine was killed).
            if any(at >= sample["mono"] - SERVED_BOUND_S for at in unserved[job]):
                continue
            held = _holders(sample, adapter)
            theirs = held & again
            want = min(len(held), replicas.get(job, PLACED_ENGINES["all"])) - len(theirs)
            if want <= 0:
                continue
            if not after or all(len(_holders(s, adapter) - theirs) < want for _, s in after):
                best = max((len(_holders(s, adapter) - theirs) for _, s in after), default=0)
                last = after[-1][0] if after else b
                yield Violation(
                    "served-again",
                    f"{adapter} was on {want} engine(s), {node}'s among them, before its "
                    f"{span.fault}; within {limit - span.end:.0f} s of the engine's return "
                    f"it was on {best} at most",
                    (b, span.index, last),
                )


def placed_served_at_end(history: list[Entry]) -> Iterator[Violation]:
    """A done job with a placement policy is on its engines at the end: all
    three for "all", two for {"replicas": 2}."""
    finals = [(i, e) for i, e in _of(history, "final.engines")]
    if not finals:
        return
    f, last = finals[-1]
    done = {e["job"] for _, e in _of(history, "final.job") if e["state"] == "done"}
    for i, sub in _of(history, "job.submitted"):
        policy = sub.get("serving")
        if policy is None or sub["job"] not in done:
            continue
        want = (
            PLACED_ENGINES["all"]
            if policy == "all"
            else min(int(policy["replicas"]), PLACED_ENGINES["all"])
        )
        names = {n for ns in last["adapters"].values() if ns for n in ns
                 if n.rsplit("-", 1)[0] == sub["job"]}  # fmt: skip
        held = max((len(_holders(last, n)) for n in names), default=0)
        if held < want:
            yield Violation(
                "placed",
                f"job {sub['job']} (serving {json.dumps(policy)}) is done and on {held} "
                f"engine(s) at the end, not {want}",
                (i, f),
            )


def right_adapter(history: list[Entry]) -> Iterator[Violation]:
    """Every chat answered (whole or in part) was answered by the adapter asked
    for: the stand-in's text names the engine's name for the model it ran,
    `<job>-<sha12>` for a fine-tuned model, the base's own for the base."""
    base = _run_start(history).get("base")
    for i, e in _of(history, "chat"):
        if e["status"] != 200 or " says:" not in e["text"]:
            continue
        by = e["text"].split(" says:", 1)[0]
        if e["job"] is None:
            ok = by == base
        else:
            prefix, _, sha = by.rpartition("-")
            ok = prefix == e["job"] and len(sha) == 12
        if not ok:
            yield Violation(
                "right-adapter",
                f"a chat with {e['model']} (project {e['project']}, {e['gateway']}) was "
                f"answered by {by!r}",
                (i,),
            )


def _owner(filename: str) -> str:
    """The project a file's name says it was uploaded by (`<project>-<n>.jsonl`)."""
    return filename.rsplit("-", 1)[0]


def uploads_whole(history: list[Entry]) -> Iterator[Violation]:
    """No upload half visible: every file a project lists at the end downloads
    and is, byte for byte, one of its uploads of that name; every upload
    answered with a file id is listed."""
    sent: dict[str, list[tuple[int, Entry]]] = defaultdict(list)
    for i, e in _of(history, "upload"):
        sent[e["filename"]].append((i, e))
    for i, e in _of(history, "final.files"):
        if e["files"] is None:
            yield Violation("upload", f"project {e['project']}'s files could not be listed "
                            f"at the end: {e.get('error')}", (i,))  # fmt: skip
            continue
        listed = {f["id"] for f in e["files"]}
        for f in e["files"]:
            ups = sent.get(f["filename"], [])
            if f["sha256"] is None:
                yield Violation("upload", f"{f['id']} ({f['filename']}) is listed but its "
                                f"content does not download: {f['why']}", (i,))  # fmt: skip
            elif not any(u["sha256"] == f["sha256"] for _, u in ups):
                yield Violation(
                    "upload",
                    f"{f['id']} ({f['filename']}, {f['bytes']} bytes) is listed but its "
                    f"content is not what was uploaded under that name",
                    (*(j for j, _ in ups), i),
                )
        for j, u in (x for xs in sent.values() for x in xs):
            if u["project"] == e["project"] and u.get("file") and u["file"] not in listed:
                yield Violation("upload", f"{u['file']} ({u['filename']}) was answered but "
                                "is not listed at the end", (j, i))  # fmt: skip


def projects_apart(history: list[Entry]) -> Iterator[Violation]:
    """No file or job of one project is listed for, or given by id to, a key
    of another (nor a job made around the gateway, which is no project's)."""
    for i, e in _of_any(history, ("tenancy.list", "final.tenancy")):
        for f in e["files"]:
            if _owner(f["filename"]) != e["project"]:
                yield Violation("projects", f"project {e['project']} lists file {f['id']} "
                                f"({f['filename']})", (i,))  # fmt: skip
        for j in e["jobs"]:
            if j["project"] != e["project"]:
                yield Violation("projects", f"project {e['project']} lists job {j['id']} "
                                f"(project {j['project']})", (i,))  # fmt: skip
    for i, e in _of(history, "tenancy.get"):
        if e["status"] == 200:
            yield Violation("projects", f"project {e['project']} got {e['owner']}'s "
                            f"{e['what']} {e['id']} by its id", (i,))  # fmt: skip


def faults_are_retries(history: list[Entry]) -> Iterator[Violation]:
    """What a fault shows a gateway client is a 503 that says to retry (or a
    4xx that says what to change), never a 500: "the service failed ... it
    is logged" tells a client nothing to do."""
    for i, e in _of_any(history, ("chat", "upload", "job.submit_failed")):
        if e.get("status") == 500:
            what = e["kind"].split(".")[0]
            yield Violation("retry", f"a{'n' if what == 'upload' else ''} {what} through "
                            f"{e.get('gateway', 'the gateway')} got a 500: "
                            f"{e.get('error', '')[:200]}", (i,))  # fmt: skip


def _of_any(history: list[Entry], kinds: tuple[str, ...]) -> Iterator[tuple[int, Entry]]:
    return ((i, e) for i, e in enumerate(history) if e["kind"] in kinds)


def client_outcomes(history: list[Entry]) -> dict[str, dict[str, int]]:
    """What gateway clients saw while each kind of fault was under way (and
    with none): "<chat|upload> <status>" counted, a stream broken after its
    200 as "chat 200 broken", no answer as "<what> no answer". For the
    operators' page (docs/nemesis.md), not a rule."""
    spans = fault_spans(history)
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for _, e in _of_any(history, ("chat", "upload")):
        at = e["mono"]
        kinds = {s.fault for s in spans if s.start <= at <= s.end} or {"none"}
        status = e["status"]
        seen = "no answer" if status is None else str(status)
        if e["kind"] == "chat" and status == 200 and not e["whole"]:
            seen += " broken"
        for kind in kinds:
            out[kind][f"{e['kind']} {seen}"] += 1
    return {k: dict(v) for k, v in out.items()}


#: Entries a window quotes from the moments before its evidence: the faults,
#: and the run's own stalls (what any process on the machine suffered too);
#: also the fences of its nodes' agents.
_CONTEXT_KINDS = ("fault.", "host.stall")


def window(history: list[Entry], violation: Violation) -> list[tuple[int, Entry]]:
    """The smallest stretch of the history that shows `violation`: from its first
    to its last evidence, keeping the evidence, the faults and what concerns the
    same jobs and nodes, and the faults of the WINDOW_LOOKBACK_S before (at
    most WINDOW_MAX_ENTRIES, the evidence kept first)."""
    lo, hi = min(violation.evidence), max(violation.evidence)
    about = {history[i].get(k) for i in violation.evidence for k in ("job", "node")} - {None}
    # The faults of the moments before: what a lone entry (a loss) came after.
    since = history[lo]["mono"] - WINDOW_LOOKBACK_S
    before = [
        (i, history[i])
        for i in range(lo)
        if history[i]["mono"] >= since
        and (
            history[i]["kind"].startswith(_CONTEXT_KINDS)
            or (history[i]["kind"] == "agent.fenced" and history[i].get("node") in about)
        )
    ]
    kept = before + [
        (i, history[i])
        for i in range(lo, hi + 1)
        if i in violation.evidence
        or history[i]["kind"].startswith(_CONTEXT_KINDS)
        or about & {history[i].get("job"), history[i].get("node")}
    ]
    if len(kept) > WINDOW_MAX_ENTRIES:
        head = [(i, e) for i, e in kept if i in violation.evidence]
        rest = [(i, e) for i, e in kept if i not in violation.evidence]
        kept = sorted(head + rest[: max(0, WINDOW_MAX_ENTRIES - len(head))], key=lambda t: t[0])
    return kept


def report(history: list[Entry], violations: list[Violation]) -> str:
    """What a person reads when the run fails: the seed, each violation and its window."""
    seed = _run_start(history).get("seed")
    out = [f"nemesis seed {seed}: {len(violations)} violation(s)"]
    for v in violations:
        out.append(f"\n[{v.rule}] {v.message}\n  rerun: bench/nemesis.py --seed {seed}")
        out.extend(f"  {i:6d} {json.dumps(e, sort_keys=True)}" for i, e in window(history, v))
    return "\n".join(out)
