"""The nemesis's checker on hand-made histories: a clean one passes, and each
rule, broken once on purpose, is caught with the entries that show it."""

from __future__ import annotations

from typing import Any

from bench.nemesis_check import Entry, check, report, window


class History:
    """A history written by hand, one entry at a time, on a clock of its own."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.now = 0.0
        self.add(
            "run.start", seed=7, node_timeout_s=3, step_s=0.1, cancel_grace_s=1.0, orphan_age_s=0
        )
        self.add("store.started")

    def add(self, kind: str, at: float | None = None, **fields: Any) -> int:
        self.now = self.now if at is None else at
        self.entries.append({"kind": kind, "mono": self.now, "wall": 1000.0 + self.now, **fields})
        return len(self.entries) - 1

    def job(self, job: str, node: str = "node-1", attempts: int = 1, *, at: float = 1.0) -> None:
        """A job of 10 steps that runs on `node` from `at` and is done 1 s later."""
        self.add("job.submitted", at, job=job, node=node, max_attempts=attempts, steps=10,
                 cancel=False)  # fmt: skip
        self.add("job.state", at + 0.1, job=job, state="running", node=node, attempt=1)
        for step in range(1, 11):
            self.add("status", at + 0.1 * step, job=job, node=node, attempt=1, seq=step,
                     time=1000.0 + at + 0.1 * step, state=None, step=step)  # fmt: skip
        self.add("job.state", at + 1.2, job=job, state="done", node=node, attempt=1)

    def end(self, **jobs: dict[str, Any]) -> None:
        for job, extra in jobs.items():
            fields = {"state": "done", "steps": 10, "curve_steps": list(range(1, 11)),
                      "artifacts": [{"kind": "peft", "ok": True, "why": ""}], **extra}  # fmt: skip
            self.add("final.job", self.now + 1, job=job, **fields)
        self.add("final.trainers", alive=[])


def rules(h: History) -> list[str]:
    return [v.rule for v in check(h.entries)]


def test_a_clean_history_passes() -> None:
    h = History()
    h.job("a")
    h.add("fault.start", 3.0, id=1, fault="agent.sigkill", target="agent node-2", node="node-2")
    h.add("node.lost", 5.0, node="node-2", scheduler="scheduler-1")
    h.add("fault.end", 6.0, id=1)
    h.add("final.orphan", subject="$O.x.C.new", newest_wall=1000.0 + 6.5)
    h.end(a={})
    assert check(h.entries) == []


def test_a_job_left_active_is_caught() -> None:
    h = History()
    h.add("job.submitted", 1.0, job="a", node=None, max_attempts=1, steps=10, cancel=False)
    h.add("job.state", 1.1, job="a", state="running", node="node-1", attempt=1)
    h.end(a={"state": "running", "curve_steps": [], "artifacts": []})
    assert rules(h) == ["final-state"]


def test_a_job_ending_past_its_bound_is_caught() -> None:
    h = History()
    h.add("job.submitted", 1.0, job="a", node="node-1", max_attempts=1, steps=10, cancel=False)
    # queued behind other jobs on node-1 until 20 s: its clock starts there
    h.add("job.state", 20.0, job="a", state="starting", node="node-1", attempt=1)
    # bound: 1 x (10 x 0.1 + 3 + 40) = 44 s with no fault meanwhile
    h.add("job.state", 70.0, job="a", state="failed", node="node-1", attempt=1)
    h.end(a={"state": "failed", "curve_steps": [], "artifacts": []})
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["final-state"]
    assert "bound is 44.0 s" in violations[0].message
    assert "took 50.0 s from its dispatch" in violations[0].message


def test_a_job_waiting_its_turn_is_within_its_bound() -> None:
    h = History()
    h.add("job.submitted", 1.0, job="a", node="node-1", max_attempts=1, steps=10, cancel=False)
    h.add("job.state", 60.0, job="a", state="starting", node="node-1", attempt=1)
    h.add("job.state", 62.0, job="a", state="done", node="node-1", attempt=1)
    h.end(a={})
    assert check(h.entries) == []


def test_faults_under_way_extend_the_bound() -> None:
    h = History()
    h.add("job.submitted", 1.0, job="a", node=None, max_attempts=1, steps=10, cancel=False)
    h.add("fault.start", 2.0, id=1, fault="nats.kill", target="nats-1", node=None)
    h.add("fault.end", 12.0, id=1)
    h.add("job.state", 50.0, job="a", state="failed", node="node-1", attempt=1)
    h.end(a={"state": "failed", "curve_steps": [], "artifacts": []})
    assert check(h.entries) == []


def test_two_attempts_reporting_at_once_are_caught() -> None:
    h = History()
    h.job("a", "node-1", attempts=3)
    # a second attempt on node-2 that reported while the first still did
    h.add("status", 1.5, job="a", node="node-2", attempt=2, seq=1, time=1001.5, state="running",
          step=None)  # fmt: skip
    h.end(a={})
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["one-node"]
    assert "attempt 1 on node-1" in violations[0].message
    assert "attempt 2 on node-2" in violations[0].message


def test_a_done_job_missing_a_step_is_caught() -> None:
    h = History()
    h.job("a")
    h.end(a={"curve_steps": [1, 2, 3, 3, 5, 6, 7, 8, 9, 10]})
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["whole-curve"]
    assert (
        "misses steps [4]" in violations[0].message
        and "[3] more than once" in violations[0].message
    )


def test_an_artifact_that_does_not_match_its_sha256_is_caught() -> None:
    h = History()
    h.job("a")
    h.end(a={"artifacts": [{"kind": "peft", "ok": False, "why": "its sha256 differs"}]})
    assert rules(h) == ["artifacts"]


def test_a_node_lost_untouched_is_caught() -> None:
    h = History()
    h.job("a")
    # a server failure does not touch the node; nor does a fault on another node
    h.add("fault.start", 3.0, id=1, fault="nats.kill", target="nats-2", node=None)
    h.add("fault.start", 3.0, id=2, fault="agent.pause", target="agent node-2", node="node-2")
    h.add("node.lost", 5.0, node="node-1", scheduler="scheduler-1")
    h.add("fault.end", 6.0, id=1)
    h.add("fault.end", 6.0, id=2)
    h.end(a={})
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["false-loss"]
    assert "node node-1" in violations[0].message
    # the lone loss is quoted with the faults just before it
    shown = [e.get("fault", e["kind"]) for _, e in window(h.entries, violations[0])]
    assert shown == ["nats.kill", "agent.pause", "node.lost"]


def test_a_trainer_outliving_its_job_is_caught() -> None:
    h = History()
    h.job("a")
    h.add("trainer.alive", 3.0, job="a", node="node-1", pid=41)  # within the grace: fine
    h.add("trainer.alive", 20.0, job="a", node="node-1", pid=41)
    h.end(a={})
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["trainer-outlives"]
    assert "trainer 41" in violations[0].message


def test_a_paused_node_excuses_its_trainer_until_it_resumes() -> None:
    h = History()
    h.job("a")
    h.add("fault.start", 2.0, id=1, fault="agent.pause", target="agent node-1", node="node-1")
    h.add("trainer.alive", 15.0, job="a", node="node-1", pid=41)
    h.add("fault.end", 16.0, id=1)
    h.end(a={})
    assert check(h.entries) == []


def test_a_trainer_left_at_the_end_is_caught() -> None:
    h = History()
    h.job("a")
    h.end(a={})
    h.entries[-1]["alive"] = [41]
    assert rules(h) == ["trainer-outlives"]


def test_an_orphan_the_last_sweep_should_have_taken_is_caught() -> None:
    h = History()
    h.job("a")
    h.add("final.orphan", 4.0, subject="$O.artifacts.C.abc", newest_wall=1003.0)
    h.add("store.started", 5.0)  # swept at start, after the orphan was written
    h.end(a={})
    assert rules(h) == ["orphan"]


def test_a_service_that_did_not_come_back_is_caught() -> None:
    h = History()
    h.job("a")
    h.add("fault.start", 2.0, id=1, fault="process.sigterm", target="scheduler-2", node=None)
    h.add("fault.error", 9.0, fault="process.sigterm", target="scheduler-2",
          error="ServiceStartError('... nats: timeout')")  # fmt: skip
    h.add("fault.end", 9.0, id=1)
    h.add("heal", 10.0, target="scheduler-2")
    h.end(a={})
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["comes-back", "comes-back"]
    assert "was not undone" in violations[0].message
    assert "down after the faults" in violations[1].message


def test_the_report_names_the_seed_and_quotes_the_window() -> None:
    h = History()
    h.job("a")
    h.add("job.submitted", 2.0, job="b", node=None, max_attempts=1, steps=10, cancel=False)
    h.add("job.state", 2.2, job="b", state="running", node="node-1", attempt=1)
    h.add("fault.start", 2.5, id=1, fault="recorder.sigkill", target="recorder-1", node=None)
    h.add("fault.end", 3.0, id=1)
    h.add("trainer.alive", 3.5, job="c", node="node-2", pid=41)  # another job: left out
    h.add("job.state", 60.0, job="b", state="failed", node="node-1", attempt=1)
    h.end(a={}, b={"state": "failed", "curve_steps": [], "artifacts": []})
    violations = check(h.entries)
    [v] = violations
    shown = [e["kind"] for _, e in window(h.entries, v)]
    assert shown == ["job.submitted", "job.state", "fault.start", "fault.end", "job.state"]
    text = report(h.entries, violations)
    assert "seed 7" in text and "--seed 7" in text and "recorder.sigkill" in text
