"""Which replica a completion goes to (gateway/replica_choice.py): plain
functions, no gateway."""

from __future__ import annotations

from collections import Counter

from lorafleet_services.gateway.model_location import ModelLocation
from lorafleet_services.gateway.replica_choice import Loads, engine_load, metrics_url

A, B, C = (ModelLocation(f"http://{h}:8000/v1") for h in "abc")

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_swapped{engine="0",model_name="tiny"} 9.0
vllm:request_success_total{engine="0",model_name="tiny"} 40.0
"""


def test_the_engine_s_running_and_waiting_are_summed_over_its_series() -> None:
    assert engine_load(VLLM_METRICS) == 6.0
    assert engine_load("process_cpu_seconds_total 1.0\n") is None
    assert metrics_url("http://a:8000/v1") == "http://a:8000/metrics"


def test_the_least_loaded_goes_first_and_equal_ones_take_turns() -> None:
    loads = Loads()
    firsts = Counter(loads.ranked([A, B, C])[0] for _ in range(30))
    assert firsts == {A: 10, B: 10, C: 10}
    loads.begin(A.base_url)
    loads.begin(B.base_url)
    assert all(loads.ranked([A, B, C])[0] == C for _ in range(5))
    loads.end(A.base_url)
    assert loads.ranked([A, B, C])[-1] == B


def test_the_engine_s_count_adds_only_what_is_not_the_gateway_s_own() -> None:
    loads = Loads()
    loads.begin(A.base_url)
    loads.begin(A.base_url)
    # The engine counted 2 when this gateway had 2 there: nobody else's.
    loads.engine_said(A.base_url, 2.0, own_then=2)
    loads.engine_said(B.base_url, 5.0, own_then=0)  # another gateway's five
    assert loads.load(A.base_url) == 2 and loads.load(B.base_url) == 5
    assert [loc.base_url for loc in loads.ranked([A, B, C])] == [C.base_url, A.base_url, B.base_url]
    loads.end(A.base_url)
    loads.end(A.base_url)
    loads.end(A.base_url)  # an end too many never goes below zero
    assert loads.own[A.base_url] == 0
