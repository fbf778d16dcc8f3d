"""Following a job: the live display, the plain lines, the JSON lines, the summary.

The view is fed the job's events (`Client.watch`) and never asks the server
for more while the job runs. Its pieces are plain functions of a `JobView`,
tested without a bus; `follow()` wires them to a client and a console: a
Rich Live display on a terminal, a line per state change and per
`PlainPacer` period when piped (never one per step), or every event as a
JSON line. The exit code says how the job ended (`exit_code`,
`follow_serving`; the table: lorafleet/exits.py).
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from lorafleet.client import Client, job_order
from lorafleet.exits import Exit
from lorafleet_schemas.messages import (
    YIELDING_TO_SERVING,
    ArtifactRecord,
    JobEvent,
    JobRecord,
    JobState,
    ServingRecord,
    ServingState,
)

Mode = Literal["live", "plain", "json"]

#: Exit code of a follow that saw the job end in each final state.
EXIT_CODES: dict[JobState, Exit] = {
    JobState.DONE: Exit.OK,
    JobState.FAILED: Exit.JOB_FAILED,
    JobState.CANCELLED: Exit.JOB_CANCELLED,
}
#: A plain line at least every this many seconds while steps advance.
PLAIN_EVERY_S = 30.0
#: ... and at least every this fraction of the steps.
PLAIN_EVERY_FRACTION = 0.1
#: Redraws of the live display per second (a local redraw, not a request).
LIVE_REFRESH_PER_S = 4
#: Seconds without an event after which the job is read once, in case an
#: event was missed (a reconnect); progress itself comes only from events.
RESYNC_AFTER_S = 15.0


def exit_code(job: JobRecord) -> Exit:
    """How the job ended; a job not final when its events stopped: the watch
    was cut (Exit.UNREACHABLE), never a success."""
    return EXIT_CODES.get(job.state, Exit.UNREACHABLE)


@dataclass
class JobView:
    """What the display shows of one job, updated by its events."""

    job: JobRecord
    tokens_per_s: float | None = None
    eta_s: float | None = None
    #: time.monotonic() of the event that set `eta_s`: the ETA counts down from it.
    eta_at: float = 0.0
    best_eval_loss: float | None = None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)

    def update(self, event: JobEvent, now: float | None = None) -> list[str]:
        """Take `event`; the lines to print above the display (a state change,
        a new message), oldest first."""
        before, job = self.job, event.job
        if job_order(job) < job_order(before):
            return []  # older than what is shown
        self.job = job
        if event.tokens_per_s is not None:
            self.tokens_per_s = event.tokens_per_s
        if event.eta_s is not None:
            self.eta_s, self.eta_at = event.eta_s, time.monotonic() if now is None else now
        if job.eval_loss is not None and job.eval_loss != before.eval_loss:
            self.eval_losses.append((job.step, job.eval_loss))
        if job.eval_loss is not None:
            self.best_eval_loss = min(job.eval_loss, self.best_eval_loss or job.eval_loss)
        if job.state != before.state:
            return [state_line(job)]
        if job.message and job.message != before.message:
            return [f"{_clock(job.updated_at)}  {job.message}"]
        return []

    def eta_left_s(self, now: float | None = None) -> float | None:
        if self.eta_s is None or self.job.state is not JobState.RUNNING:
            return None
        return max(0.0, self.eta_s - ((time.monotonic() if now is None else now) - self.eta_at))


def shown_state(job: JobRecord) -> str:
    """The job's state, with "yielding to serving" while its trainer pauses
    for the node's engines (its latest message says so)."""
    if job.state is JobState.RUNNING and job.message.startswith(YIELDING_TO_SERVING):
        return f"{job.state.value}, {YIELDING_TO_SERVING}"
    return job.state.value


def state_line(job: JobRecord) -> str:
    said = f"  {job.message}" if job.message else ""
    where = f" on {job.node}" if job.node else ""
    step = f" at step {job.step}/{job.steps}" if job.steps else ""
    return f"{_clock(job.updated_at)}  {job.id} {job.state.value}{where}{step}{said}"


def _clock(t: dt.datetime) -> str:
    return t.astimezone().strftime("%H:%M:%S")


def duration(seconds: float | None) -> str:
    """1:02:03, 2:03 or 45s."""
    if seconds is None:
        return "-"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}" if m else f"{sec}s"


def preference_words(numbers: dict[str, float], prefix: str) -> str:
    """A DPO job's reward margin and preference accuracy ("" without them)."""
    margin, accuracy = numbers.get(f"{prefix}margin"), numbers.get(f"{prefix}accuracy")
    if margin is None or accuracy is None:
        return ""
    return f"margin {margin:.3g} acc {accuracy:.0%}"


def progress_fields(view: JobView, now: float | None = None) -> list[str]:
    """step, loss, eval, tokens/s, ETA, peak: what is known of them."""
    job = view.job
    parts = []
    if job.steps:
        parts.append(f"step {job.step}/{job.steps} ({100 * job.step // job.steps}%)")
    if job.loss is not None:
        parts.append(f"loss {job.loss:.4g}")
    if job.eval_loss is not None:
        parts.append(f"eval {job.eval_loss:.4g}")
    for numbers, prefix in ((job.preference, ""), (job.eval_preference, "eval_")):
        words = preference_words(numbers or {}, prefix)
        if words:
            parts.append(("eval " if prefix else "") + words)
    if view.tokens_per_s is not None:
        parts.append(f"{view.tokens_per_s:,.0f} tok/s")
    left = view.eta_left_s(now)
    if left is not None:
        parts.append(f"ETA {duration(left)}")
    if job.peak_mib:
        parts.append(f"peak {job.peak_mib} MiB")
    return parts


def plain_line(view: JobView, now: float | None = None) -> str:
    job = view.job
    return "  ".join(
        [f"{_clock(job.updated_at)}  {shown_state(job):<10}", *progress_fields(view, now)]
    )


@dataclass
class PlainPacer:
    """When a plain progress line is due: every `fraction` of the steps, or
    every `every_s` seconds while the step advances — never per step."""

    every_s: float = PLAIN_EVERY_S
    fraction: float = PLAIN_EVERY_FRACTION
    last_step: int = 0
    last_at: float = field(default_factory=time.monotonic)

    def due(self, job: JobRecord, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if job.step <= self.last_step:
            return False
        every_steps = max(1, int(job.steps * self.fraction))
        if job.step - self.last_step >= every_steps or now - self.last_at >= self.every_s:
            self.last_step, self.last_at = job.step, now
            return True
        return False


def live_panel(view: JobView, now: float | None = None) -> RenderableType:
    """The live display: a header, the bar, the numbers, the latest message."""
    job = view.job
    head = Text.assemble(
        ("job ", "dim"),
        (job.id, "bold"),
        (f" {job.name}" if job.name else "", ""),
        "  ",
        (shown_state(job), _STATE_STYLE.get(job.state, "")),
        (f"  on {job.node}" if job.node else "  not placed yet", "dim"),
        (f"  {job.model}", "dim"),
    )
    bar = ProgressBar(total=max(job.steps, 1), completed=job.step, width=60)
    grid = Table.grid(padding=(0, 1))
    grid.add_row(bar, Text(f"{100 * job.step // job.steps}%" if job.steps else ""))
    numbers = Text("  ".join(progress_fields(view, now)) or "waiting for the first step")
    rows: list[RenderableType] = [head, grid, numbers]
    if job.message:
        rows.append(Text(job.message, style="dim", overflow="ellipsis", no_wrap=True))
    return Group(*rows)


_STATE_STYLE = {
    JobState.DONE: "bold green",
    JobState.FAILED: "bold red",
    JobState.CANCELLED: "bold yellow",
    JobState.RUNNING: "bold cyan",
}


def summary_lines(view: JobView, artifacts: list[ArtifactRecord]) -> list[str]:
    """What the job came to: state, final and best eval loss, duration, artifacts."""
    job = view.job
    lines = [f"job {job.id} {job.state.value}" + (f": {job.message}" if job.message else "")]
    numbers = []
    if job.loss is not None:
        numbers.append(f"final loss {job.loss:.4g}")
    if job.eval_loss is not None:
        numbers.append(f"final eval loss {job.eval_loss:.4g}")
    if view.best_eval_loss is not None:
        numbers.append(f"best eval loss {view.best_eval_loss:.4g}")
    if job.steps:
        numbers.append(f"{job.step}/{job.steps} steps")
    if job.peak_mib:
        numbers.append(f"peak {job.peak_mib} MiB")
    start, end = job.started_at or job.created_at, job.finished_at
    if end is not None:
        numbers.append(f"took {duration((end - start).total_seconds())}")
    if numbers:
        lines.append("  " + ", ".join(numbers))
    lines.extend(f"  {a.kind.value}: {human_bytes(a.size)}  sha256 {a.sha256}" for a in artifacts)
    if artifacts:
        lines.append(f"  download: lorafleet download {job.id} --out DIR")
    return lines


def human_bytes(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def choose_mode(plain: bool, as_json: bool, console: Console) -> Mode:
    if as_json:
        return "json"
    return "plain" if plain or not console.is_terminal else "live"


async def follow(
    client: Client,
    job_id: str,
    mode: Mode,
    console: Console,
    every_s: float = PLAIN_EVERY_S,
) -> JobRecord:
    """Follow the job to its end in `mode` on `console`; its last record.
    The summary follows, except in json mode."""
    events = client.watch(job_id, poll_s=RESYNC_AFTER_S)
    first = await anext(events)
    view = JobView(first.job)
    pacer = PlainPacer(every_s=every_s, last_step=0)
    if mode == "json":
        _json_line(first)
    elif mode == "plain":
        _say(console, state_line(view.job))
    if mode == "live":
        with Live(live_panel(view), console=console, refresh_per_second=LIVE_REFRESH_PER_S) as live:
            _say(console, state_line(view.job))
            async for event in events:
                for line in view.update(event):
                    _say(console, line)
                live.update(live_panel(view))
            live.update(live_panel(view), refresh=True)
    else:
        async for event in events:
            if mode == "json":
                _json_line(event)
                continue
            lines = view.update(event)
            for line in lines:
                _say(console, line)
            if not lines and pacer.due(view.job):
                _say(console, plain_line(view))
    if mode != "json":
        artifacts = await client.artifacts(job_id) if view.job.artifacts_stored else []
        for line in summary_lines(view, artifacts):
            _say(console, line)
    return view.job


def _say(console: Console, line: str) -> None:
    # One line per thing said, however narrow the terminal or pipe (no wrapping).
    console.print(line, highlight=False, soft_wrap=True, markup=False)


def _json_line(event: JobEvent) -> None:
    sys.stdout.write(msgspec.json.encode(event).decode() + "\n")
    sys.stdout.flush()


def serving_line(r: ServingRecord) -> str:
    why = f": {r.reason}" if r.reason else ""
    lift = f" (lift: {r.lift})" if r.lift else ""
    where = f"{r.node} {r.engine}" if r.engine else r.node  # no engine: a refusal saying so
    return f"serving: {r.state.value} on {where} as {r.served_name}{why}{lift}"


async def follow_serving(
    client: Client, job: JobRecord, mode: Mode, console: Console, timeout_s: float
) -> Exit:
    """A done job's serving, a line (or a JSON event) per change, until it
    settles or `timeout_s` passes: 0 when an engine serves it, else
    Exit.NOT_SERVED."""
    if job.serve is False:
        _say(console, "serving: off for this job (serve: false)")
        return Exit.NOT_SERVED
    latest: dict[tuple[str, str, str], ServingRecord] = {}
    async for r in client.serving_changes(job.id, timeout_s):
        latest[(r.node, r.engine, r.served_name)] = r
        if mode == "json":
            _json_line(JobEvent(kind="serving", job=job, serving=r))
        else:
            _say(console, serving_line(r))
    if not latest:
        _say(
            console,
            f"serving: nothing reported within {timeout_s:g} s: no engine on {job.node} "
            f"serves {job.model}? (`lorafleet serve {job.id} --engine URL` names one)",
        )
        return Exit.NOT_SERVED
    served = any(r.state == ServingState.SERVED for r in latest.values())
    return Exit.OK if served else Exit.NOT_SERVED
