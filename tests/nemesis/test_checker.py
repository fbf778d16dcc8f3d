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


def stepped_job(offset_s: float, second_attempt_at: float) -> History:
    """Job a: attempt 1 on node-1, whose clock is stepped by `offset_s` at
    1.6 s, reports until 2.0 s; attempt 2 on node-2 reports from
    `second_attempt_at` for a second. Each report stored as it is stamped."""
    h = History()
    h.add("job.submitted", 1.0, job="a", node=None, max_attempts=3, steps=10, cancel=False)
    h.add("job.state", 1.1, job="a", state="running", node="node-1", attempt=1)
    h.add("clock.offset", 1.6, node="node-1", offset_s=offset_s)
    for step in range(1, 11):
        at = 1.0 + 0.1 * step
        stamp = 1000.0 + at + (offset_s if at > 1.6 else 0.0)
        h.add("status", at, job="a", node="node-1", attempt=1, seq=step, time=stamp,
              stored=1000.0 + at, state=None, step=step)  # fmt: skip
    for step in range(1, 11):
        at = second_attempt_at + 0.1 * step
        h.add("status", at, job="a", node="node-2", attempt=2, seq=step, time=1000.0 + at,
              stored=1000.0 + at, state=None, step=step)  # fmt: skip
    h.add("job.state", second_attempt_at + 1.2, job="a", state="done", node="node-2", attempt=2)
    h.end(a={})
    return h


def test_a_stepped_clock_is_read_on_the_hosts() -> None:
    """A node's clock stepped forward (attempt 1 then seems to report past
    attempt 2's start) or back (its reports seem older): neither overlap is
    real, and a real one under a step is still caught."""
    assert rules(stepped_job(+30.0, second_attempt_at=2.5)) == []
    assert rules(stepped_job(-30.0, second_attempt_at=2.5)) == []
    # attempt 2 from 1.5 s: attempt 1, stepped back 30 s, reported until 2.0
    assert rules(stepped_job(-30.0, second_attempt_at=1.5)) == ["one-node"]
    assert rules(stepped_job(+30.0, second_attempt_at=1.5)) == ["one-node"]


def test_two_trainers_of_a_job_alive_at_once_are_caught() -> None:
    """Issue 33: a fenced agent drops its reports, so a trainer that goes on
    shows only as a process."""
    h = History()
    h.job("a", "node-1", attempts=3)
    h.add("trainers.alive", 1.2, trainers=[{"pid": 11, "job": "a", "node": "node-1"}])
    h.add("trainers.alive", 1.7, trainers=[{"pid": 11, "job": "a", "node": "node-1"},
                                           {"pid": 12, "job": "a", "node": "node-2"},
                                           {"pid": 13, "job": "b", "node": "node-3"}])  # fmt: skip
    h.end(a={})
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["one-node"]
    assert "11 on node-1, 12 on node-2" in violations[0].message


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


def test_a_lost_nodes_window_quotes_the_machines_stall_and_the_agents_fence() -> None:
    """Issue 33: losses with nothing touched came of agents silent for the
    node timeout on a machine at load 20; the window shows it (a violation
    all the same)."""
    h = History()
    h.job("a")
    h.add("host.stall", 2.0, late_s=2.8)
    h.add("agent.fenced", 4.9, node="node-1", message="NATS unreachable for 2.9 s")
    h.add("node.lost", 5.0, node="node-1", scheduler="scheduler-1")
    h.end(a={})
    [v] = check(h.entries)
    assert v.rule == "false-loss"
    shown = [e["kind"] for _, e in window(h.entries, v)]
    assert shown == ["host.stall", "agent.fenced", "node.lost"]


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


# --- the gateway and the engines -------------------------------------------

A1 = "a-0123456789ab"  # job a's adapter, as its engine names it
BASE = "/models/tiny"


def engines(h: History, at: float, **held: list[str] | None) -> None:
    """One sample of the engines: node_1=[...] is node-1's list (None: no answer)."""
    adapters = {"node-1": [], "node-2": [], "node-3": []}
    adapters.update({k.replace("_", "-"): v for k, v in held.items()})
    h.add("engines", at, adapters=adapters)


def engine_killed(
    h: History, at: float, back: float, node: str = "node-1", fault_id: int = 9
) -> None:
    h.add("fault.start", at, id=fault_id, fault="engine.kill", target=f"engine {node}",
          node=None, engine=node)  # fmt: skip
    h.add("fault.end", back, id=fault_id)


def test_an_adapter_served_again_after_its_engine_is_back_passes() -> None:
    h = History()
    h.job("a")
    engines(h, 2.0, node_1=[A1])
    engine_killed(h, 3.0, 5.0)
    engines(h, 4.0, node_1=None)
    engines(h, 6.0)  # back empty
    engines(h, 20.0, node_1=[A1])  # loaded again within the bound
    h.end(a={})
    assert check(h.entries) == []


def test_an_adapter_not_served_again_after_its_engine_is_back_is_caught() -> None:
    h = History()
    h.job("a")
    engines(h, 2.0, node_1=[A1], node_2=[A1])
    engine_killed(h, 3.0, 5.0)
    engines(h, 6.0, node_2=[A1])
    engines(h, 30.0, node_2=[A1])
    engines(h, 40.0, node_1=[A1], node_2=[A1])  # past the bound (5 + 30 s)
    h.end(a={})
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["served-again"]
    assert "was on 2 engine(s), node-1's among them" in violations[0].message
    assert "it was on 1 at most" in violations[0].message


def test_an_adapter_moved_elsewhere_or_unserved_by_the_run_is_not_owed() -> None:
    h = History()
    h.job("a")
    h.job("b", at=1.0)
    b1 = "b-ba9876543210"
    engines(h, 2.0, node_1=[A1, b1], node_2=[A1])
    engine_killed(h, 3.0, 5.0)
    h.add("serving.change", 4.0, job="b", action="unserve", node=None)
    engines(h, 8.0, node_2=[A1], node_3=[A1])  # a's replica placed on node-3
    h.end(a={}, b={})
    assert check(h.entries) == []


def test_an_unserve_just_before_the_sample_is_no_debt_but_one_long_before_is() -> None:
    """Seed 44's hour: unserved 0.3 s before the sample that still listed it
    (its unload under way), 0.6 s before its engine was killed. Unserved
    longer than the bound before and still listed, it is owed again."""
    for unserved_at, owed in ((40.0, False), (5.0, True)):
        h = History()
        h.job("a")
        h.add("serving.change", unserved_at, job="a", action="unserve", node=None)
        engines(h, 40.3, node_1=[A1])
        engine_killed(h, 40.6, 42.0)
        engines(h, 45.0)
        h.end(a={})
        rules = [v.rule for v in check(h.entries)]
        assert rules == (["served-again"] if owed else []), (unserved_at, rules)


def test_another_engine_killed_meanwhile_owes_its_adapters_under_its_own_fault() -> None:
    """Seed 47's second hour: on three engines before node-1's was killed;
    node-2's, killed within node-1's bound, had it back within its own
    bound but past node-1's. Not killed, node-2 owes it within node-1's."""
    for node_2_killed, owed in ((True, False), (False, True)):
        h = History()
        h.job("a")
        engines(h, 2.0, node_1=[A1], node_2=[A1], node_3=[A1])
        engine_killed(h, 3.0, 5.0)
        if node_2_killed:
            engine_killed(h, 20.0, 25.0, node="node-2", fault_id=10)
        engines(h, 10.0, node_1=[A1], node_2=[], node_3=[A1])
        engines(h, 26.0, node_1=[A1], node_2=[], node_3=[A1])
        engines(h, 45.0, node_1=[A1], node_2=[A1], node_3=[A1])  # past node-1's bound
        h.end(a={})
        assert ("served-again" in rules(h)) is owed, (node_2_killed, rules(h))


def test_a_job_the_run_took_for_unsubmitted_is_owed_its_policys_replicas() -> None:
    """Seed 47: a submit timed out at the client yet made the job, of two
    replicas; with no policy in the history it was owed all three engines."""
    g1 = "g-0123456789ab"
    for serving, owed in (({"replicas": 2}, False), (None, True)):
        h = History()
        engines(h, 2.0, node_1=[g1], node_2=[g1], node_3=[g1])  # a surplus, for a moment
        engine_killed(h, 3.0, 5.0)
        engines(h, 8.0, node_2=[g1], node_3=[g1])
        h.end(g={"serving": serving})
        assert ("served-again" in rules(h)) is owed, (serving, rules(h))


def test_a_replicas_surplus_before_the_fault_is_not_owed() -> None:
    """Seed 16: on three engines for a moment (one placed before another was
    unloaded), a job of two replicas was back on two: not a violation."""
    h = History()
    h.add("job.submitted", 1.0, job="a", node=None, max_attempts=1, steps=10, cancel=False,
          serving={"replicas": 2})  # fmt: skip
    engines(h, 2.0, node_1=[A1], node_2=[A1], node_3=[A1])
    engine_killed(h, 3.0, 5.0)
    engines(h, 8.0, node_2=[A1], node_3=[A1])
    assert [v.rule for v in check(h.entries)] == ["final-state"]  # never seen done: no more
    h.entries[2]["serving"] = None  # no policy: it was on three, it is owed three
    assert "served-again" in [v.rule for v in check(h.entries)]


def test_a_placed_job_short_of_its_engines_at_the_end_is_caught() -> None:
    h = History()
    h.add("job.submitted", 1.0, job="a", node=None, max_attempts=1, steps=10, cancel=False,
          serving={"replicas": 2})  # fmt: skip
    h.add("job.state", 1.1, job="a", state="running", node="node-1", attempt=1)
    h.add("job.state", 2.2, job="a", state="done", node="node-1", attempt=1)
    h.end(a={})
    h.add("final.engines", adapters={"node-1": [A1], "node-2": [], "node-3": None})
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["placed"]
    assert "on 1 engine(s) at the end, not 2" in violations[0].message
    h.entries[-1]["adapters"]["node-3"] = [A1]
    assert check(h.entries) == []


def chat(h: History, model: str, job: str | None, text: str, status: int = 200) -> None:
    h.add("chat", project="proj-a", gateway="gateway-1", model=model, job=job, stream=True,
          status=status, text=text, whole=True, error="")  # fmt: skip


def test_a_chat_answered_by_another_adapter_is_caught() -> None:
    h = History()
    h.entries[0]["base"] = BASE
    chat(h, "ft:tiny:nem:a", "a", f"{A1} says: chat number 1")
    chat(h, "tiny", None, f"{BASE} says: chat number 2")
    chat(h, "ft:tiny:nem:a", "a", "", status=404)  # not served: no answer, no violation
    chat(h, "ft:tiny:nem:a", "a", f"{A1[:5]}")  # a stream broken before the name: unjudged
    assert check(h.entries) == []
    chat(h, "ft:tiny:nem:a", "a", "b-ba9876543210 says: chat number 3")
    chat(h, "tiny", None, f"{A1} says: chat number 4")
    chat(h, "ft:tiny:nem:a", "a", f"{BASE} says: chat number 5")
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["right-adapter"] * 3
    assert "answered by 'b-ba9876543210'" in violations[0].message


def upload(h: History, filename: str, sha: str, file: str | None) -> None:
    h.add("upload", project=filename.rsplit("-", 1)[0], key="alice", gateway="gateway-1",
          filename=filename, bytes=10, sha256=sha, status=200 if file else None,
          file=file, error="")  # fmt: skip


def final_files(h: History, project: str, *files: tuple[str, str, str | None]) -> None:
    h.add("final.files", project=project, files=[
        {"id": i, "filename": n, "bytes": 10, "sha256": s, "why": "" if s else "404"}
        for i, n, s in files])  # fmt: skip


def test_uploads_whole_or_not_at_all_pass() -> None:
    h = History()
    upload(h, "proj-a-1.jsonl", "s1", "file-1")
    upload(h, "proj-a-2.jsonl", "s2", None)  # killed mid-upload: not listed
    upload(h, "proj-a-3.jsonl", "s3", None)  # its answer lost, but it is whole: fine
    final_files(h, "proj-a", ("file-1", "proj-a-1.jsonl", "s1"), ("file-3", "proj-a-3.jsonl", "s3"))
    assert check(h.entries) == []


def test_an_upload_half_visible_or_lost_is_caught() -> None:
    h = History()
    upload(h, "proj-a-1.jsonl", "s1", "file-1")
    upload(h, "proj-a-2.jsonl", "s2", None)
    upload(h, "proj-a-3.jsonl", "s3", "file-3")
    final_files(h, "proj-a", ("file-1", "proj-a-1.jsonl", "half"),
                ("file-2", "proj-a-2.jsonl", None))  # fmt: skip
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["upload"] * 3
    assert "not what was uploaded" in violations[0].message
    assert "content does not download" in violations[1].message
    assert "file-3 (proj-a-3.jsonl) was answered but is not listed" in violations[2].message


def test_another_projects_file_or_job_seen_is_caught() -> None:
    h = History()
    listing = {"files": [{"id": "file-1", "filename": "proj-a-1.jsonl"}],
               "jobs": [{"id": "ftjob-a", "project": "proj-a"}]}  # fmt: skip
    h.add("tenancy.list", project="proj-a", **listing)
    h.add("tenancy.get", project="proj-b", owner="proj-a", what="file", id="file-1", status=404)
    assert check(h.entries) == []
    h.add("tenancy.list", project="proj-b", **listing)
    h.add("tenancy.get", project="proj-b", owner="proj-a", what="job", id="ftjob-a", status=200)
    h.add("final.tenancy", project="proj-a", files=[],
          jobs=[{"id": "ftjob-x", "project": None}])  # fmt: skip
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["projects"] * 4
    assert "project proj-b lists file file-1 (proj-a-1.jsonl)" in violations[0].message
    assert "lists job ftjob-x (project None)" in violations[2].message
    assert "got proj-a's job ftjob-a by its id" in violations[3].message


def test_a_500_through_the_gateway_is_caught() -> None:
    h = History()
    chat(h, "tiny", None, "", status=503)  # a fault of the moment: retry
    h.add("job.submit_failed", via="gateway", gateway="gateway-2", status=400, error="bad file")
    assert check(h.entries) == []
    chat(h, "tiny", None, "", status=500)
    failed = "the service failed on this request: OperationalError(...); it is logged"
    h.add("job.submit_failed", via="gateway", gateway="gateway-2", status=500, error=failed)
    upload(h, "proj-a-1.jsonl", "s1", None)
    h.entries[-1].update(status=500, error="Internal Server Error")
    violations = check(h.entries)
    assert [v.rule for v in violations] == ["retry"] * 3
    assert "a job through gateway-2 got a 500: the service failed" in violations[1].message
    assert "an upload through gateway-1 got a 500" in violations[2].message
