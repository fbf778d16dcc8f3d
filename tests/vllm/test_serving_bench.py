"""bench/serving_load.py in the suite: its answer comparison and phase order
(pure), and its short mode on the session's vLLM (seconds a phase, one
adapter): every base request answered, every load served, nothing left
loaded. Its figures are the bench's to print, not asserted here.

bench/serving_latency.py has no short mode here: its baseline restarts the
server (about 40 s a start on two cores, and a second vLLM beside the
session's); its agent half is test_serving.py's serve-then-complete.
bench/trainer_vllm_python.py neither: two trainer runs in two interpreters
and the overlay's install cost over 30 s.
"""

from __future__ import annotations

from pathlib import Path

from bench.serving_common import adapter, scanned
from bench.serving_load import (
    Phase,
    PhaseResult,
    measure,
    phases,
    variation,
)

from lorafleet_services.agent.serving.vllm_adapters import Continuation, loaded_adapters
from lorafleet_services.agent.serving.vllm_client import PROBE_REQUEST_TIMEOUT_S, VllmClient
from tests.vllm_server import RunningVllm


def test_answers_are_compared_up_to_their_first_difference() -> None:
    reference = [Continuation([1, 2, 3], [-0.5, -1.0, -2.0]), Continuation([4, 5, 6], [-1.0] * 3)]
    result = PhaseResult(Phase("none", 2, False))
    result.answers = [
        (0, Continuation([1, 2, 3], [-0.5, -1.0, -2.0])),  # the same
        (0, Continuation([1, 9, 9], [-0.6, -7.0, -7.0])),  # differs at the second token
        (1, Continuation([7, 5, 6], [-3.0, -1.0, -1.0])),  # differs at the first
        (1, Continuation([4, 5, 6], [-1.0, -1.0, -1.25])),  # same tokens, another logprob
    ]
    assert variation(result, reference) == {
        "answers_differing": 0.5,
        "first_token_differing": 0.25,
        # 0.1 before the second answer's difference, 0.25 in the last; none
        # of the tokens after a difference, nor of the third answer.
        "max_logprob_deviation_before_difference": 0.25,
    }


def test_the_throughput_pair_runs_in_abba_order_then_one_worker() -> None:
    assert [(p.name, p.workers) for p in phases(4, 2)] == [
        ("none", 4), ("loads", 4), ("loads", 4), ("none", 4), ("solo", 1), ("solo+loads", 1),
        ("load-only", 4), ("adapter-requests", 4),
    ]  # fmt: skip


async def test_the_load_bench_short_on_the_session_server(
    vllm_server: RunningVllm, tmp_path: Path
) -> None:
    adapter_dir = adapter(vllm_server.model_dir, tmp_path / "adapter", seed=5)
    engine = scanned(vllm_server.url)
    async with VllmClient(vllm_server.url, timeout_s=PROBE_REQUEST_TIMEOUT_S) as client:
        out = await measure(
            client, engine, vllm_server.model_dir, [adapter_dir], tmp_path / "work",
            seconds=1.0, rounds=1, workers=2,
        )  # fmt: skip
        assert loaded_adapters(engine, await client.models()) == []
    assert (out["failed_requests"], out["failed_loads"]) == (0, 0), out
    figures = out["phases"]
    assert list(figures) == [
        "none", "loads", "solo", "solo+loads", "load-only", "adapter-requests",
    ]  # fmt: skip
    assert all(f["completions"] > 0 for f in figures.values()), figures
    loads = {name: f["loads_done"] for name, f in figures.items()}
    assert loads["none"] == loads["solo"] == 0 and loads["adapter-requests"] == 1, loads
    assert min(loads["loads"], loads["solo+loads"], loads["load-only"]) >= 1, loads
    assert figures["adapter-requests"]["adapter_requests"] >= 1
    assert out["ratio_loads_over_none"] > 0
    assert not list((tmp_path / "work" / "served").iterdir())
