"""How busy each engine on the node is: read every fraction of a second by
the trainer's yielding (agent/training/yielding.py).

One plain parser per engine kind, of what the engine itself publishes:
vLLM's Prometheus `/metrics` (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, summed over its series: one per model name and
engine index), llama.cpp's `/metrics` (`llamacpp:requests_processing`,
`llamacpp:requests_deferred`; llama-server needs `--metrics`) or, without
it, its `/slots` (a slot `is_processing`, older releases `state` 1). From
/metrics also the tokens it has processed (`EngineLoad.tokens`): a count
that grew between two reads is work done between them, which the gauges
miss when a request starts and ends between two reads, and when a CPU
engine's API server is starved (it then takes a request's outputs in one
burst, and its gauges read 0 whenever /metrics is answered). A read
costs the engine one small text render (vLLM: about 10 KB); `read_load`
bounds it by `LOAD_READ_TIMEOUT_S`. An engine that takes the connection but
not answer in time is taken as busy (`EngineLoad.late`): its API server is
too loaded to render a page of text, and its users feel it. One that
refuses the connection or answers an error reads None, which the yielding
takes as not busy: an engine that is down has no users to yield to.

Where the agent sees the engine's process (a vLLM the engine watch found
on the node), its load is first read from /proc instead, for free and at
once: `main_thread_cpu_ns` is how long the server's main thread has run.
vLLM's API server runs every request there (its parsing, tokens in and
out, the stream), and at rest it runs a few hundred microseconds in ten
milliseconds; measured on this repository's CPU vLLM, a request showed as
over a tenth of a core within 4-12 ms of being sent, where a /metrics read
costs that same thread ~1 ms (~6 ms to answer) and its gauges see the
request only once an engine step has taken it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

import httpx2

#: Seconds one engine's load read may take; a busy CPU engine answers in
#: tens of milliseconds, and a read that takes longer is worth less than
#: the next one.
LOAD_READ_TIMEOUT_S = 1.0


class LoadSource(StrEnum):
    """What is read of an engine."""

    VLLM_METRICS = "vllm"
    LLAMACPP_METRICS = "llamacpp"
    LLAMACPP_SLOTS = "llamacpp-slots"


class EngineLoadError(ValueError):
    """An engine's answer is not what its kind publishes."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's requests now: being processed, and queued behind them."""

    engine: str
    running: int
    waiting: int
    #: It did not answer within LOAD_READ_TIMEOUT_S (counts are unknown: 0).
    late: bool = False
    #: Prompt and generated tokens since the engine started (its counters);
    #: None where it publishes none (llama.cpp's /slots).
    tokens: float | None = None
    #: Tokens were processed since the reader's previous read (the reader sets it).
    worked: bool = False
    #: The share of a core its server's main thread ran since the reader's
    #: previous read (`main_thread_cpu_ns`); None where it was not read so.
    cpu_share: float | None = None

    @property
    def requests(self) -> int:
        return self.running + self.waiting

    def describe(self) -> str:
        if self.late:
            return f"{self.engine} did not answer its {LOAD_READ_TIMEOUT_S:g} s load read"
        if self.worked and not self.requests:
            return f"{self.engine} processed tokens since the last read"
        if self.cpu_share is not None:
            return f"{self.engine}'s server is working ({self.cpu_share:.0%} of a core)"
        return f"{self.engine} has {self.running} running, {self.waiting} waiting"


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """An engine to read: its URL (`http://host:port`), what to read, and
    the API key its endpoints need (vLLM's --api-key guards /metrics too)
    and its process, when the node's /proc shows it."""

    url: str
    source: LoadSource
    api_key: str | None = None
    #: Its server process, where the agent sees it (`main_thread_cpu_ns`).
    pid: int | None = None

    @property
    def path(self) -> str:
        return "/slots" if self.source is LoadSource.LLAMACPP_SLOTS else "/metrics"


def prometheus_sums(
    text: str, names: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, float]:
    """The sum over every series of each metric in `names` and `optional` in
    a Prometheus text exposition (labels ignored); EngineLoadError when one
    of `names` is missing."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        name = line[:name_end] if name_end >= 0 else line
        if name not in names and name not in optional:
            continue
        rest = line[len(name) :]
        fields = (rest[rest.rfind("}") + 1 :] if rest.startswith("{") else rest).split()
        try:
            sums[name] = sums.get(name, 0.0) + float(fields[0])
        except (IndexError, ValueError):
            raise EngineLoadError(f"a {name} line without a number: {line[:120]!r}") from None
    missing = [n for n in names if n not in sums]
    if missing:
        raise EngineLoadError(f"no {', '.join(missing)} in the engine's /metrics")
    return sums


VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_TOKENS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
LLAMACPP_PROCESSING = "llamacpp:requests_processing"
LLAMACPP_DEFERRED = "llamacpp:requests_deferred"
LLAMACPP_TOKENS = ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total")


def _tokens(sums: dict[str, float], names: tuple[str, ...]) -> float | None:
    found = [sums[n] for n in names if n in sums]
    return sum(found) if found else None


def parse_vllm_metrics(engine: str, text: str) -> EngineLoad:
    """vLLM's /metrics: requests running and waiting, and its tokens, over all its series."""
    sums = prometheus_sums(text, (VLLM_RUNNING, VLLM_WAITING), VLLM_TOKENS)
    return EngineLoad(engine, round(sums[VLLM_RUNNING]), round(sums[VLLM_WAITING]),
                      tokens=_tokens(sums, VLLM_TOKENS))  # fmt: skip


def parse_llamacpp_metrics(engine: str, text: str) -> EngineLoad:
    """llama-server's /metrics (started with --metrics): requests processing
    and deferred (waiting for a free slot), and its tokens."""
    sums = prometheus_sums(text, (LLAMACPP_PROCESSING, LLAMACPP_DEFERRED), LLAMACPP_TOKENS)
    return EngineLoad(engine, round(sums[LLAMACPP_PROCESSING]), round(sums[LLAMACPP_DEFERRED]),
                      tokens=_tokens(sums, LLAMACPP_TOKENS))  # fmt: skip


def parse_llamacpp_slots(engine: str, text: str) -> EngineLoad:
    """llama-server's /slots: the slots processing a request (`is_processing`,
    or `state` 1 in releases before it). Requests deferred for want of a
    slot are not listed there: waiting is 0."""
    try:
        slots = json.loads(text)
    except json.JSONDecodeError as e:
        raise EngineLoadError(f"the engine's /slots is not JSON: {e}") from None
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        raise EngineLoadError("the engine's /slots is not a list of slots")
    busy = 0
    for s in slots:
        if "is_processing" in s:
            busy += bool(s["is_processing"])
        elif "state" in s:
            busy += s["state"] != 0
        else:
            raise EngineLoadError(
                "a slot of the engine's /slots has neither is_processing nor state"
            )
    return EngineLoad(engine, busy, 0)


PARSERS = {
    LoadSource.VLLM_METRICS: parse_vllm_metrics,
    LoadSource.LLAMACPP_METRICS: parse_llamacpp_metrics,
    LoadSource.LLAMACPP_SLOTS: parse_llamacpp_slots,
}


async def read_load(http: httpx2.AsyncClient, target: LoadTarget) -> EngineLoad | None:
    """One read of `target`'s load: `late` when it took the connection but
    did not answer in LOAD_READ_TIMEOUT_S; None when it is not there,
    answers an error status or something its kind does not publish
    (`parse_*` says what, for the caller's log)."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else None
    try:
        response = await http.get(
            target.url + target.path, headers=headers, timeout=LOAD_READ_TIMEOUT_S
        )
    except httpx2.ReadTimeout:
        return EngineLoad(target.url, 0, 0, late=True)
    except httpx2.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return PARSERS[target.source](target.url, response.text)
    except EngineLoadError:
        return None


def main_thread_cpu_ns(pid: int) -> int | None:
    """Nanoseconds process `pid`'s main thread has run: the first field of
    /proc/PID/schedstat, which any user may read (one small read, ~20 us).
    None when the process is gone or the kernel keeps no schedstat."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cpu_load(target: LoadTarget, ran_ns: int, window_s: float) -> EngineLoad:
    """`target`'s load from its main thread having run `ran_ns` in the last
    `window_s` seconds (its counts unknown: 0)."""
    return EngineLoad(target.url, 0, 0, cpu_share=ran_ns / 1e9 / max(window_s, 1e-6))
