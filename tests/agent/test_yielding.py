"""The yielding decision (agent/training/yielding.py) from load samples and
the node's thresholds, with an injected clock: no engine, no process."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx2
import pytest

from lorafleet import log
from lorafleet.metrics import TRAINER_YIELD
from lorafleet_schemas.messages import YIELDING_TO_SERVING, JobState, TrainerParams, TrainerYield
from lorafleet_services.agent.config import AgentConfig, AgentConfigError
from lorafleet_services.agent.node.cards import CardChoice
from lorafleet_services.agent.node.engine_load import EngineLoad, LoadSource, LoadTarget
from lorafleet_services.agent.training.job_run import job_file
from lorafleet_services.agent.training.yielding import (
    PAUSE_FILE,
    PauseFile,
    Yielder,
    YieldNotes,
    YieldState,
    YieldThresholds,
    decide,
    load_targets,
    pause_cause,
    start_yielding,
    stop_yielding,
)
from lorafleet_services.cli.follow import shown_state
from lorafleet_trainer.protocol import LineWriter, PauseGate
from tests.agent.conftest import start_request
from tests.records import job_record

TH = YieldThresholds(sample_s=0.1, busy_requests=1, idle_s=0.3, run_share=0.25, period_s=4.0)
IDLE = [EngineLoad("http://e:8000", 0, 0)]
BUSY = [EngineLoad("http://e:8000", 1, 2)]


def run(samples: list[tuple[float, list[EngineLoad]]], th: YieldThresholds = TH) -> list[bool]:
    """The paused flag after each (time, loads) sample."""
    state, out = YieldState(), []
    for now, loads in samples:
        state = decide(state, loads, now, th)
        out.append(state.paused)
    return out


def test_busy_pauses_at_once_and_idle_resumes_after_idle_s() -> None:
    samples = [(0.0, IDLE), (0.1, BUSY), (0.2, BUSY), (0.3, IDLE), (0.45, IDLE), (0.55, IDLE)]
    assert run(samples) == [False, True, True, True, True, False]


def test_the_reason_names_the_busiest_engine() -> None:
    loads = [EngineLoad("http://a:1", 1, 0), EngineLoad("http://b:2", 3, 4)]
    state = decide(YieldState(), loads, 1.0, TH)
    assert state.paused and state.reason == "http://b:2 has 3 running, 4 waiting"


def test_below_busy_requests_is_not_busy() -> None:
    th = YieldThresholds(busy_requests=4)
    assert run([(0.0, BUSY), (0.1, [EngineLoad("e", 2, 2)])], th) == [False, True]


def test_an_engine_too_busy_to_answer_pauses_and_is_named() -> None:
    late = EngineLoad("http://slow:8000", 0, 0, late=True)
    state = decide(YieldState(), [*BUSY, late], 1.0, TH)
    assert state.paused and state.reason == "http://slow:8000 did not answer its 1 s load read"
    assert run([(0.0, IDLE), (0.1, [late]), (0.3, IDLE), (0.5, IDLE)]) == [False, True, True, False]


def test_tokens_counted_since_the_last_read_are_busy_when_one_request_is() -> None:
    worked = [EngineLoad("http://e:8000", 0, 0, tokens=400.0, worked=True)]
    assert run([(0.0, IDLE), (0.1, worked), (0.2, IDLE)]) == [False, True, True]
    state = decide(YieldState(), worked, 1.0, TH)
    assert state.reason == "http://e:8000 processed tokens since the last read"
    assert run([(0.0, worked)], YieldThresholds(busy_requests=2)) == [False]


def test_the_yielder_marks_an_engine_worked_when_its_tokens_grew(tmp_path: Path) -> None:
    yielder = Yielder(PauseFile(tmp_path / "pause"), list, TH, log.get())
    reads = [10.0, 10.0, 250.0, 3.0, 3.0, None]  # a restart sets the count back
    marks = [yielder._worked(EngineLoad("e", 0, 0, tokens=t)).worked for t in reads]
    assert marks == [False, False, True, False, False, False]


def test_a_server_working_a_share_of_a_core_is_busy() -> None:
    """Read from /proc: `busy_cpu_share` of a core since the last read pauses,
    less (a server at rest) does not."""
    th = YieldThresholds(busy_cpu_share=0.1)
    at_rest, working = EngineLoad("e", 0, 0, cpu_share=0.03), EngineLoad("e", 0, 0, cpu_share=0.14)
    assert run([(0.0, [at_rest]), (0.01, [working]), (0.02, [at_rest])], th) == [False, True, True]
    state = decide(YieldState(), [working], 0.0, th)
    assert state.reason == "e's server is working (14% of a core)"


def test_unanswered_engines_hold_no_pause() -> None:
    """read_load's None is left out: no loads at all is not busy."""
    assert run([(0.0, []), (0.1, BUSY), (0.2, []), (0.6, [])]) == [False, True, True, False]


def test_steady_load_gets_a_duty_cycle() -> None:
    """Never 0.3 s of quiet: paused 3 s of each 4 s, then a 1 s turn however busy."""
    samples = [(t / 10, BUSY) for t in range(0, 121)]  # 12 s, always busy
    paused = run(samples)
    share = paused.count(False) / len(paused)
    assert 0.2 <= share <= 0.3
    runs = [t for (t, _), p in zip(samples, paused, strict=True) if not p]
    assert runs[:3] == [3.0, 3.1, 3.2] and 4.0 not in runs


def test_a_run_share_of_zero_waits_for_quiet_however_long() -> None:
    th = YieldThresholds(run_share=0.0)
    assert not any(not p for p in run([(t / 10, BUSY) for t in range(200)], th))


def test_bursts_with_gaps_train_in_the_gaps() -> None:
    """A burst of 1 s every 3 s: the trainer runs in each gap less idle_s."""
    samples = [(t / 10, BUSY if (t % 30) < 10 else IDLE) for t in range(90)]
    paused = run(samples)
    for c in range(0, 90, 30):
        assert all(paused[c : c + 10])  # the burst
        assert not any(paused[c + 14 : c + 30])  # the gap, less idle_s


def test_paused_seconds_are_counted_by_cause() -> None:
    busy = decide(YieldState(), BUSY, 1.0, TH)
    assert pause_cause(busy, 1.0) == "engine_busy"
    quiet = decide(busy, IDLE, 1.1, TH)
    assert quiet.paused and pause_cause(quiet, 1.1) == "idle_wait"


def _counted(cause: str) -> float:
    return float(TRAINER_YIELD.labels(cause)._value.get())


async def test_the_yielder_counts_the_seconds_it_holds_the_pause(tmp_path: Path) -> None:
    """Held since a busy read; a read 2.5 s later finds every engine gone
    (none to read): idle_wait seconds, and then it lets go."""
    now = [0.0]
    yielder = Yielder(PauseFile(tmp_path / "pause"), list, TH, log.get(), clock=lambda: now[0])
    yielder.state = decide(YieldState(), BUSY, 0.0, TH)
    yielder.pause.hold(yielder.state.reason)
    before = _counted("idle_wait")
    now[0] = 2.5
    async with httpx2.AsyncClient() as http:
        await yielder.sample(http)
    assert _counted("idle_wait") - before == pytest.approx(2.5)
    assert not yielder.state.paused and not yielder.pause.path.exists()


def test_notes_say_why_once_and_when_it_goes_on() -> None:
    now = [0.0]
    notes = YieldNotes(clock=lambda: now[0])
    paused = TrainerYield(state="paused", step=5, cause="http://e has 1 running, 0 waiting")
    resumed = TrainerYield(state="resumed", step=5, paused_s=0.8)
    first = notes.message(paused)
    assert first is not None and first.startswith(YIELDING_TO_SERVING)
    assert "after step 5: http://e has 1 running" in first
    assert notes.message(resumed) == f"training again after 0.8 s {YIELDING_TO_SERVING}"
    now[0] = 3.0  # a pause within YIELD_NOTE_S: summed, not said
    assert notes.message(paused) is None and notes.message(resumed) is None
    now[0] = 11.0
    later = notes.message(paused)
    assert later is not None and "(2 pauses, 1.6 s in all, since the last note)" in later


def test_the_agents_pause_file_holds_the_trainers_gate(tmp_path: Path) -> None:
    """The two halves of the protocol: what the agent writes, the trainer obeys."""
    pause = PauseFile(tmp_path / "pause")
    out = io.StringIO()
    looks: list[float] = []

    def sleep(s: float) -> None:
        looks.append(s)
        pause.touch()
        if len(looks) == 2:
            pause.release()

    pause.hold("http://e:8000 has 1 running, 0 waiting")
    assert PauseGate(pause.path, LineWriter(out), sleep=sleep).wait(2) >= 0
    said = [json.loads(x) for x in out.getvalue().splitlines()]
    assert said[0]["cause"] == "http://e:8000 has 1 running, 0 waiting"
    assert said[1]["state"] == "resumed" and not pause.path.exists()
    pause.release()  # twice is fine


def test_load_targets_of_the_watch_and_the_configured_llama_servers() -> None:
    targets = load_targets(
        [("http://v:8000", "key", 41)], ["http://l:8080/", "http://m:8081|slots"]
    )
    assert targets == [
        LoadTarget("http://v:8000", LoadSource.VLLM_METRICS, "key", 41),
        LoadTarget("http://l:8080", LoadSource.LLAMACPP_METRICS),
        LoadTarget("http://m:8081", LoadSource.LLAMACPP_SLOTS),
    ]
    assert targets[2].path == "/slots" and targets[0].path == "/metrics"


def test_the_nodes_thresholds_come_from_its_config() -> None:
    cfg = AgentConfig.from_env(
        {"LORAFLEET_AGENT_YIELD_IDLE_S": "0.5", "LORAFLEET_AGENT_YIELD_RUN_SHARE": "0"},
        node="n1",
    )
    th = YieldThresholds.of(cfg)
    assert (th.idle_s, th.run_share, th.sample_s) == (0.5, 0.0, 0.1)
    assert (th.cpu_sample_s, th.busy_cpu_share) == (0.01, 0.1)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("YIELD_RUN_SHARE", "1.5"),
        ("YIELD_SAMPLE_S", "0"),
        ("YIELD_BUSY_REQUESTS", "0"),
        ("YIELD_BUSY_CPU_SHARE", "0"),
    ],
)
def test_a_bad_threshold_says_what_to_change(var: str, value: str) -> None:
    with pytest.raises(AgentConfigError, match=f"LORAFLEET_AGENT_{var} must be"):
        AgentConfig.from_env({f"LORAFLEET_AGENT_{var}": value}, node="n1")


def test_watch_and_top_show_a_yielding_job_so() -> None:
    yielding = job_record(state=JobState.RUNNING, message=f"{YIELDING_TO_SERVING} after step 3: x")
    assert shown_state(yielding) == f"running, {YIELDING_TO_SERVING}"
    again = job_record(state=JobState.RUNNING, message="training again after 0.8 s yielding")
    assert shown_state(again) == "running"


@pytest.mark.parametrize(("mode", "yields"), [("auto", True), ("off", False)])
async def test_a_jobs_setting_gives_the_trainer_a_pause_file_and_a_yielder(
    mode: str, yields: bool, tmp_path: Path
) -> None:
    req = start_request("j1", "d", "0" * 64, params=TrainerParams(yield_to_serving=mode))  # type: ignore[arg-type]
    cfg = AgentConfig(node="n1", work_dir=tmp_path)
    spec = job_file(req, cfg, tmp_path, tmp_path / "data.jsonl", CardChoice(None, "cpu", 0))
    assert spec.pause_path == (tmp_path / PAUSE_FILE if yields else None)
    task = start_yielding(tmp_path / PAUSE_FILE, mode, list, cfg, log.get())
    assert (task is not None) == yields
    await stop_yielding(task)
    assert TrainerParams().yield_to_serving == "auto"
