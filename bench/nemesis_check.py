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
  seconds), state, step (every report in the status stream, read from it).
- `node.lost`: node, scheduler (a scheduler's `node.lost` log line).
- `trainer.alive`: job, pid (a trainer process seen alive, sampled).
- `final.job`: job, state, steps, curve_steps, artifacts [{kind, ok, why}].
- `final.orphan`: subject, newest_wall (an object chunk no object refers to).
- `final.trainers`: alive [pids] (trainer processes left at the end).
- `store.started`: the artifact-store (re)started (it sweeps at start).
- `fault.error`: fault, target, error (a fault's do or undo failed: a
  restarted service did not start, the cluster did not become ready).
- `heal`: target (a service found not running once the faults were over).

`check(history)` returns every violation of the rules below, each with the
indices of the entries that show it; `window()` the smallest stretch of the
history around them, for a person to read.
"""

from __future__ import annotations

import json
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
        *done_jobs_whole(history),
        *no_false_node_loss(history),
        *no_trainer_outlives_its_job(history),
        *no_orphans_after_sweep(history),
        *everything_comes_back(history),
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


def one_node_at_a_time(history: list[Entry]) -> Iterator[Violation]:
    """No two attempts of a job report at overlapping times (the status stream's
    own reports, by their times): a job never runs in two places at once."""
    spans: dict[str, dict[tuple[str, int], list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, e in _of(history, "status"):
        spans[e["job"]][(e["node"], e["attempt"])].append(i)
    for job, by_attempt in spans.items():
        ranges = sorted(
            (min(history[i]["time"] for i in idx), max(history[i]["time"] for i in idx), key, idx)
            for key, idx in by_attempt.items()
        )
        # Each range against the one reaching furthest before it (a long
        # attempt may overlap one that is not its neighbour).
        _, hi_a, key_a, idx_a = ranges[0]
        for lo_b, hi_b, key_b, idx_b in ranges[1:]:
            if lo_b < hi_a:
                last_a = max(idx_a, key=lambda i: history[i]["time"])
                first_b = min(idx_b, key=lambda i: history[i]["time"])
                yield Violation(
                    "one-node",
                    f"job {job}: attempt {key_a[1]} on {key_a[0]} reported until "
                    f"{hi_a:.3f} while attempt {key_b[1]} on {key_b[0]} had reported "
                    f"since {lo_b:.3f}",
                    (min(first_b, last_a), max(first_b, last_a)),
                )
            if hi_b > hi_a:
                hi_a, key_a, idx_a = hi_b, key_b, idx_b


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
        if history[i]["mono"] >= since and history[i]["kind"].startswith("fault.")
    ]
    kept = before + [
        (i, history[i])
        for i in range(lo, hi + 1)
        if i in violation.evidence
        or history[i]["kind"].startswith("fault.")
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
