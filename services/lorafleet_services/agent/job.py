"""One job on this node, from a StartRequest to delivered artifacts.

    preparing  fetch the dataset into work_dir/jobs/<job>/, check its sha256,
               fetch what it resumes from (agent/resume.py), prepare the
               trainer's environment, choose the card, write job.json and
               the trainer script
    running    the trainer in its own session (as the engines' user when
               there is one); each stdout JSON line becomes a StatusReport,
               each checkpoint line goes to the CheckpointSender, which
               delivers the newest meanwhile (agent/checkpoints.py)
    converting GGUF, when the start request asks for it
    uploading  the PEFT adapter (tar.gz) and the GGUF, in chunks

`done` is not the agent's to say: the artifact-store tells the recorder
when every artifact is stored and verified. Any failure is one `failed`
report whose message says what to do (the trainer's "error" line, else the
last lines of its stderr), `retryable` when the cause is not the job's own
(`trainer_failure`).

Reports go through a `Reporter`: a queue and one publisher task per job
and attempt, so a slow or absent NATS never blocks reading the trainer's
output (the trainer would stall on a full pipe). Each report is a JetStream
publish, awaited for its ack and retried on failure, with the message id
`<job>.<attempt>.<seq>` so a retry is stored once.

Stopping: `JobRun.stop()` cancels the pipeline task; whatever step it is
in stops (the trainer's process group gets SIGTERM, then SIGKILL after
`cancel_grace_s`), and one final report says why (`cancelled`, or `failed`
when the agent itself stops). A fenced agent sends no final report: its job
was failed by the scheduler already, and NATS is out of reach anyway.

The job directory is removed after success or cancel. After a failure it is
kept, without the data and the adapter, so that job.json, the trainer and
its stderr (trainer-stderr.txt) can be read; the newest KEEP_FAILED_DIRS are
kept and every job directory goes when the agent restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil
import stamina
from nats.js import JetStreamContext

import lorafleet_trainer
from lorafleet import log, metrics, objects
from lorafleet._bus import encode
from lorafleet._process import die_with_parent
from lorafleet.estimate import EstimateError, estimate_memory
from lorafleet.log import Event
from lorafleet.names import Header, Names
from lorafleet_schemas.messages import (
    ArtifactKind,
    JobState,
    StartRequest,
    StatusReport,
    TrainerCheckpoint,
    TrainerDone,
    TrainerError,
    TrainerEval,
    TrainerLengths,
    TrainerLine,
    TrainerLog,
    TrainerState,
    TrainerStep,
)
from lorafleet_services.agent import cards as cards_mod
from lorafleet_services.agent import conversion, delivery, environment, resume
from lorafleet_services.agent.cards import CardChoice, NoCardError
from lorafleet_services.agent.checkpoints import CheckpointSender
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.environment import StandinEnvironment, TrainerEnvironment
from lorafleet_services.agent.fetch import fetch_object
from lorafleet_services.agent.process import ManagedProcess, ProcessResult
from lorafleet_trainer.jobfile import Base, JobFile, parse_resume
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import ExitCode
from lorafleet_trainer.standin import gguf_bytes

#: Seconds one status publish waits for its ack before it is retried.
PUBLISH_TIMEOUT_S = 2.0
#: First and longest pause between retries of a status publish; seconds.
PUBLISH_RETRY_FIRST_S = 0.1
PUBLISH_RETRY_MAX_S = 2.0
#: Seconds the final reports of a job may take to publish when the agent stops.
STOP_DRAIN_TIMEOUT_S = 5.0
#: Seconds the last reports of a finished job may take to publish. Longer
#: outages fence the agent first; a server that keeps refusing them (no
#: status stream, no permission) must not keep the node busy for ever.
DRAIN_TIMEOUT_S = 60.0
#: Seconds between NVML samples of the trainer's card memory.
NVML_SAMPLE_S = 1.0
#: Seconds a card read for the card choice may take.
CARD_READ_TIMEOUT_S = 10.0
#: Failed job directories kept for reading (the newest ones).
KEEP_FAILED_DIRS = 5
#: In the job directory: where the trainer writes its checkpoints.
CHECKPOINTS_DIR = "checkpoints"

_line_decoder: msgspec.json.Decoder[TrainerLine] = msgspec.json.Decoder(TrainerLine)


class JobFailedError(Exception):
    """A step of the job failed; the message is what the job's `failed` report says.

    retryable: the cause is not the job's own (StatusReport.retryable).
    """

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


#: Said of a retryable failure.
RETRYABLE_NOTE = "not the job's own failure, so a job with attempts left runs again"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def trainer_failure(result: ProcessResult, error_line: str | None) -> tuple[str, bool]:
    """The message of a trainer that ended without an adapter, and whether it
    is retryable: ExitCode.NODE_FAILED (a failure of the node: another node,
    or another try, may well succeed), or a death by a signal the agent did
    not send (the kernel's out-of-memory killer, an operator). The job's own
    failure and bad input are not."""
    tail = result.stderr_tail or "(no stderr)"
    rc = result.returncode
    said = f"the trainer failed: {error_line}" if error_line else ""
    if rc == ExitCode.NODE_FAILED:
        what = said or f"the trainer exited with code {rc}: {tail}"
        return f"{what} (exit {rc}: a failure of the node's environment; {RETRYABLE_NOTE})", True
    killed_by = -rc if rc < 0 else signal.SIGTERM if rc == ExitCode.STOPPED else None
    if killed_by is not None and not result.stopped:
        cause = (
            "the out-of-memory killer, or an operator?"
            if killed_by == signal.SIGKILL
            else "an operator, or the host stopping?"
        )
        return (
            f"the trainer was killed by {signal_name(killed_by)}, which the agent did not send "
            f"({cause}); {RETRYABLE_NOTE}; its last words: {error_line or tail}",
            True,
        )
    if said:
        return said, False
    if rc == 0:
        return f"the trainer exited without saving an adapter; its last words: {tail}", False
    return f"the trainer exited with code {rc}: {tail}", False


#: In the trainer's environment (and so its children's): its job directory.
#: A restarted agent finds what an earlier one left running by it.
JOB_DIR_VAR = "LORAFLEET_JOB_DIR"


def trainer_argv(python: str, program: Path, job_json: Path) -> list[str]:
    """The trainer's command line. `program`: a module of a package copied
    into the job directory (the working directory), run as `python -m`
    (package/__main__.py as `-m package`), or a script of one's own. With a
    parent-death SIGKILL: if the agent dies (SIGKILL, OOM), the trainer does
    not train on as an orphan that holds the card. The prelude runs in the
    engine's Python."""
    if (program.parent / "__init__.py").is_file():
        package = program.parent.name
        run = ["-m", package if program.stem == "__main__" else f"{package}.{program.stem}"]
    else:
        run = [str(program)]
    return die_with_parent([python, *run, str(job_json)], signal.SIGKILL, python=python)


def trainer_env(
    env: TrainerEnvironment, choice: CardChoice, job_dir: Path | None = None
) -> dict[str, str]:
    """The trainer process's environment: the environment's (its card and
    `environment.RUN_ENV` included), and the job's directory."""
    return env.process_env(choice, None if job_dir is None else {JOB_DIR_VAR: str(job_dir)})


def job_file(
    req: StartRequest,
    cfg: AgentConfig,
    job_dir: Path,
    data_path: Path,
    choice: CardChoice,
    resume: dict[str, Any] | None = None,
) -> JobFile:
    """job.json for the trainer (its format: lorafleet_trainer.jobfile).

    checkpoint_dir: where the trainer writes its checkpoints (the agent
    delivers and removes them: agent/checkpoints.py); resume: where it
    starts from (agent/resume.py's entry {"dir", "mode"}), or None.
    """
    return JobFile(
        job_id=req.job_id,
        base=Base(
            hf_repo=req.model.hf_repo,
            hf_revision=req.model.hf_revision,
            local_dir=req.model.local_dir,
        ),
        data_path=data_path,
        data_sha256=req.dataset_sha256,
        out_dir=job_dir / "out",
        params=Params(**msgspec.to_builtins(req.params)),
        device=choice.device,
        hf_offline=cfg.hf_offline,
        # On a card the trainer keeps the whole process within this (CUDA context included).
        gpu_memory_mib=req.gpu_memory_mib,
        estimate_mib=job_estimate_mib(req),
        checkpoint_dir=job_dir / CHECKPOINTS_DIR,
        resume=parse_resume(resume),
    )


def lengths_note(line: TrainerLengths, req: StartRequest) -> str:
    """The trainer's token lengths as a progress message, with the memory
    estimate refined by them: a micro-batch's rows are as wide as its longest
    record, so the longest one seen replaces max_seq_len."""
    text = (
        f"tokenized {line.records_tokenized} records: {line.p50} tokens at the median, "
        f"{line.p95} at p95, {line.max} the longest; {line.records_cut} cut at max_seq_len "
        f"{req.params.max_seq_len}"
    )
    if req.model.architecture is None:
        return text
    try:
        refined = estimate_memory(req.model.architecture, req.params, seq_len=line.max)
    except EstimateError:
        return text
    return (
        f"{text}; memory estimate for rows of {refined.seq_len} tokens {refined.total_mib} MiB "
        f"(was {job_estimate_mib(req)} MiB for {req.params.max_seq_len}; the job has "
        f"{req.gpu_memory_mib} MiB)"
    )


def job_estimate_mib(req: StartRequest) -> int | None:
    """The job's memory estimate on a card, when its model's architecture is known."""
    if req.model.architecture is None:
        return None
    try:
        return estimate_memory(req.model.architecture, req.params).total_mib
    except EstimateError:
        return None


def session_pids(sid: int) -> set[int]:
    """Every process in session `sid` (the trainer and whatever it started)."""
    pids: set[int] = set()
    for pid in psutil.pids():
        with contextlib.suppress(OSError):  # gone since the listing
            if os.getsid(pid) == sid:
                pids.add(pid)
    return pids


def card_choice_text(choice: CardChoice, node: str) -> str:
    if choice.index is None:
        return f"training on the CPU of {node} (it has no card; CPU training is allowed)"
    return f"training on GPU {choice.index} ({choice.name}) of {node}, {choice.free_mib} MiB free"


def leftover_trainers(work_dir: Path) -> set[int]:
    """Processes an earlier agent with this work directory left running: the
    trainers (and whatever they started) whose LORAFLEET_JOB_DIR is under it."""
    prefix = f"{work_dir / 'jobs'}/"
    found: set[int] = set()
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            job_dir = proc.environ().get(JOB_DIR_VAR, "")
        except psutil.Error:  # gone, or another user's (the agent runs them as itself then)
            continue
        if job_dir.startswith(prefix):
            found.add(proc.pid)
    return found


def kill_leftover_trainers(work_dir: Path) -> list[int]:
    """SIGKILL what `leftover_trainers` finds; answers the pids."""
    pids = sorted(leftover_trainers(work_dir))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids


def remove_job_dirs(work_dir: Path) -> list[str]:
    """Remove every job directory (at agent start: no job survives a restart)."""
    root = work_dir / "jobs"
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for d in root.iterdir():
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    return removed


class MemorySampler:
    """The trainer's card memory from NVML, sampled in a thread; keeps the peak."""

    def __init__(self, sid: int, interval_s: float = NVML_SAMPLE_S) -> None:
        self.sid = sid
        self.interval_s = interval_s
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not cards_mod.nvml_available()[0]:
            return
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                used = cards_mod.process_memory_mib(session_pids(self.sid))
                self.peak_mib = max(self.peak_mib, used)
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()


class Reporter:
    """The job's status reports, published in order, each until acknowledged."""

    def __init__(self, js: JetStreamContext, names: Names, node: str, req: StartRequest) -> None:
        self.js = js
        self.subject = names.status(node, req.job_id)
        self.node = node
        self.job_id = req.job_id
        self.attempt = req.attempt
        self.seq = 0
        self.published = 0
        self._queue: asyncio.Queue[StatusReport | None] = asyncio.Queue()
        self._task = asyncio.create_task(self._publish_all())
        self.logger = log.get(node=node, job_id=req.job_id)

    def report(self, state: JobState | None = None, message: str = "", **fields: Any) -> None:
        self.seq += 1
        metrics.RUNNING_JOBS.report(self.node, self.job_id, fields)
        self._queue.put_nowait(
            StatusReport(
                job_id=self.job_id,
                node=self.node,
                attempt=self.attempt,
                seq=self.seq,
                time=dt.datetime.now(dt.UTC),
                state=state,
                message=message,
                **fields,
            )
        )

    async def _publish_all(self) -> None:
        while (report := await self._queue.get()) is not None:
            await self._publish(report)
            self.published = report.seq

    async def _publish(self, report: StatusReport) -> None:
        """Publish until acknowledged: no limit here, the job's drain timeout
        and the fence bound it."""
        payload = encode(report)
        headers = {Header.MSG_ID: f"{self.job_id}.{self.attempt}.{report.seq}"}
        async for attempt in stamina.retry_context(
            on=Exception,
            attempts=None,
            timeout=None,
            wait_initial=PUBLISH_RETRY_FIRST_S,
            wait_max=PUBLISH_RETRY_MAX_S,
            wait_jitter=0,
        ):
            with attempt:
                try:
                    await self.js.publish(
                        self.subject, payload, timeout=PUBLISH_TIMEOUT_S, headers=headers
                    )
                except Exception as e:
                    self.logger.warning(Event.STATUS_RETRY, seq=report.seq, error=repr(e))
                    raise

    async def stop(self, timeout_s: float | None = None) -> None:
        """Publish what is queued (at most `timeout_s` seconds; None: until done)."""
        self._queue.put_nowait(None)
        await asyncio.wait({self._task}, timeout=timeout_s)
        self.abandon()

    def abandon(self) -> None:
        """Drop what is not published yet (fenced: no one is listening for it)."""
        if not self._task.done():
            self._task.cancel()
            self.logger.warning(Event.STATUS_DROPPED, dropped=self.seq - self.published)


class TrainerLines:
    """The trainer's stdout, line by line: status reports, log lines, and what
    the job keeps of it (the done and error lines, the peak MiB it reported).
    A checkpoint line goes to the job's CheckpointSender, which never waits."""

    def __init__(
        self, reporter: Reporter, req: StartRequest, logger: Any, sampled: Callable[[], int]
    ) -> None:
        self.reporter = reporter
        self.req = req
        self.logger = logger
        #: The NVML sampler's peak MiB so far.
        self.sampled = sampled
        self.done_line: TrainerDone | None = None
        self.error_line: str | None = None
        self.peak_trainer_mib = 0
        self.checkpoints: CheckpointSender | None = None

    def peak(self) -> int:
        return max(self.peak_trainer_mib, self.sampled())

    async def __call__(self, raw: bytes) -> None:
        if not raw.strip():
            return
        try:
            line = _line_decoder.decode(raw)
        except msgspec.DecodeError as e:
            self.logger.warning(
                Event.TRAINER_LINE_BAD, error=str(e), line=raw[:200].decode(errors="replace")
            )
            return
        if isinstance(line, TrainerStep):
            self._step(line)
        elif isinstance(line, TrainerCheckpoint):
            self.logger.info(Event.TRAINER_LINE, message="checkpoint", step=line.step)
            if self.checkpoints is not None:
                self.checkpoints.offer(line)
        else:
            self._other(line)

    def _step(self, line: TrainerStep) -> None:
        self.peak_trainer_mib = max(self.peak_trainer_mib, line.peak_mib)
        peak = self.peak()
        self.reporter.report(
            step=line.step,
            steps=line.steps,
            loss=line.loss,
            learning_rate=line.learning_rate,
            tokens_per_s=line.tokens_per_s,
            eta_s=line.eta_s,
            peak_mib=peak,
        )
        self.logger.info(
            Event.JOB_PROGRESS, step=line.step, steps=line.steps, loss=line.loss, peak_mib=peak
        )

    def _other(self, line: TrainerLine) -> None:
        r = self.reporter
        if isinstance(line, TrainerState):
            if line.state == "running":
                r.report(JobState.RUNNING, line.message or "training")
            else:
                r.report(message=line.message or line.state)
            self.logger.info(Event.TRAINER_LINE, state=line.state, message=line.message)
        elif isinstance(line, TrainerEval):
            r.report(step=line.step, eval_loss=line.eval_loss)
            self.logger.info(Event.JOB_EVAL, step=line.step, eval_loss=line.eval_loss)
        elif isinstance(line, TrainerLog):
            r.report(message=line.message)
            self.logger.info(Event.TRAINER_LINE, message=line.message, trainer_level=line.level)
        elif isinstance(line, TrainerError):
            self.error_line = line.message
            self.logger.warning(Event.TRAINER_LINE, error=line.message)
        elif isinstance(line, TrainerLengths):
            note = lengths_note(line, self.req)
            r.report(message=note)
            self.logger.info(Event.TRAINER_LINE, message=note)
        elif isinstance(line, TrainerDone):
            self.done_line = line
            self.logger.info(Event.TRAINER_LINE, message="done", adapter_dir=line.adapter_dir)


class JobRun:
    """One StartRequest's pipeline, as a task. `stop()` ends it from anywhere."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        cfg: AgentConfig,
        req: StartRequest,
    ) -> None:
        self.js = js
        self.names = names
        self.cfg = cfg
        self.req = req
        self.node = cfg.node
        self.job_id = req.job_id
        self.job_dir = cfg.work_dir / "jobs" / req.job_id
        self.logger = log.get(node=cfg.node, job_id=req.job_id, attempt=req.attempt)
        self.reporter = Reporter(js, names, cfg.node, req)
        self.trainer_pid: int | None = None
        self.final_state: JobState | None = None
        self.sampler: MemorySampler | None = None
        self.lines = TrainerLines(self.reporter, req, self.logger, self._sampled)
        self._stop_state: JobState | None = None
        self._stop_message = ""
        self._stop_retryable = False
        self._stopping = False
        self.task: asyncio.Task[None] | None = None
        #: Set by stop(); steps that stop on an event (the conversion) get it too.
        self.stopping = asyncio.Event()

    def start(self) -> asyncio.Task[None]:
        """Run the job in a task of its own; that task."""
        self.reporter.report(JobState.PREPARING, f"preparing on {self.node}: fetching the dataset")
        self.task = asyncio.create_task(self._run(), name=f"job-{self.job_id}")
        return self.task

    async def stop(
        self, state: JobState | None, message: str, timeout_s: float, *, retryable: bool = False
    ) -> None:
        """Stop the job; report `state` with `message` (none when `state` is None);
        `retryable`: the cause is not the job's own (the agent stopping)."""
        if self.task is None or self.task.done():
            return
        if not self._stopping:
            self._stopping = True
            self._stop_state, self._stop_message = state, message
            self._stop_retryable = retryable
            self.stopping.set()
            self.task.cancel()
        await asyncio.wait({self.task}, timeout=timeout_s)

    async def wait(self) -> None:
        if self.task is not None:
            await asyncio.wait({self.task})

    # --- the pipeline -------------------------------------------------------

    async def _run(self) -> None:
        drain_timeout_s = DRAIN_TIMEOUT_S
        try:
            await self._pipeline()
        except asyncio.CancelledError:
            if not self._stopping:  # the loop is going away: nothing more to say
                self.reporter.abandon()
                raise
            self.final_state = self._stop_state
            if self._stop_state is None:
                self.reporter.abandon()
            else:
                self.reporter.report(
                    self._stop_state, self._stop_message, retryable=self._stop_retryable
                )
                drain_timeout_s = STOP_DRAIN_TIMEOUT_S
            self.logger.info(
                Event.JOB_CANCELLED, state=self._stop_state, message=self._stop_message
            )
        except JobFailedError as e:
            self._fail(str(e), retryable=e.retryable)
        except Exception as e:
            self.logger.exception(Event.JOB_FAILED, error=repr(e))
            self._fail(f"the agent on {self.node} failed on this job: {e!r}; it is in its log")
        finally:
            if self.sampler is not None:
                self.sampler.stop()
            await self.reporter.stop(drain_timeout_s)
            await asyncio.to_thread(self._clean_dir)

    def _fail(self, message: str, *, retryable: bool = False) -> None:
        self.final_state = JobState.FAILED
        self.reporter.report(
            JobState.FAILED, message, peak_mib=self.lines.peak() or None, retryable=retryable
        )
        self.logger.warning(Event.JOB_FAILED, message=message, retryable=retryable)

    async def _pipeline(self) -> None:
        await asyncio.to_thread(self._make_dir)
        data_path = self.job_dir / "data.jsonl"
        await self._fetch_dataset(data_path)
        resume = await self._fetch_resume()
        self.reporter.report(message="preparing the trainer's environment")
        env = await self._environment()
        for note in env.notes:
            self.reporter.report(message=note)
            self.logger.info(Event.JOB_STATE, message=note)
        choice = await self._choose_card()
        self.reporter.report(message=card_choice_text(choice, self.node))
        script, job_json = await asyncio.to_thread(self._write_files, data_path, choice, resume)
        await asyncio.to_thread(env.give, self.job_dir)
        done = await self._train(env, choice, script, job_json)

        adapter_dir = Path(done.adapter_dir)
        files: list[tuple[ArtifactKind, Path]] = []
        if ArtifactKind.GGUF in self.req.artifacts:
            self.reporter.report(JobState.CONVERTING, "converting the adapter to GGUF")
            gguf = await self._convert(env, adapter_dir, Path(done.base_dir))
        self.reporter.report(JobState.UPLOADING, "delivering the artifacts")
        if ArtifactKind.PEFT in self.req.artifacts:
            packed = self.job_dir / "adapter.tar.gz"
            await asyncio.to_thread(delivery.pack_adapter, adapter_dir, packed)
            files.append((ArtifactKind.PEFT, packed))
        if ArtifactKind.GGUF in self.req.artifacts:
            files.append((ArtifactKind.GGUF, gguf))
        delivered: list[str] = []
        for kind, path in files:
            try:
                size, sha = await delivery.deliver(
                    self.js,
                    self.names,
                    node=self.node,
                    job_id=self.job_id,
                    attempt=self.req.attempt,
                    kind=kind,
                    path=path,
                    chunk_bytes=self.cfg.chunk_bytes,
                )
            except delivery.DeliveryError as e:
                raise JobFailedError(f"delivering the {kind.value} artifact: {e}") from None
            delivered.append(f"{kind.value} ({size} bytes, sha256 {sha[:12]}…)")
        self.final_state = JobState.UPLOADING
        self.reporter.report(
            message="delivered "
            + ", ".join(delivered or ["nothing (no artifact asked for)"])
            + "; the artifact-store finishes the job"
        )

    def _make_dir(self) -> None:
        shutil.rmtree(self.job_dir, ignore_errors=True)
        self.job_dir.mkdir(parents=True, mode=0o755)
        (self.job_dir / CHECKPOINTS_DIR).mkdir(mode=0o755)

    async def _fetch_dataset(self, path: Path) -> None:
        bucket = self.names.datasets_bucket
        name = self.req.dataset
        try:
            _size, sha = await fetch_object(self.js, bucket, name, path)
        except objects.ObjectNotFoundError:
            raise JobFailedError(
                f"the dataset {name!r} is not in the object store {bucket}: "
                "submit the job's data again"
            ) from None
        except Exception as e:
            raise JobFailedError(f"fetching the dataset {name!r} from {bucket}: {e!r}") from None
        if sha != self.req.dataset_sha256:
            raise JobFailedError(
                f"the dataset {name!r} in {bucket} has sha256 {sha}, but the job says "
                f"{self.req.dataset_sha256}: it was replaced or damaged; submit the data again"
            )

    async def _fetch_resume(self) -> dict[str, Any] | None:
        """What job.json's `resume` says: the checkpoint or adapter fetched,
        checked and unpacked (agent/resume.py); None to start afresh."""
        ref = self.req.resume
        if ref is None:
            return None
        self.reporter.report(message=f"fetching {resume.describe(ref)} to start from")
        try:
            entry = await resume.fetch_resume(self.js, self.names, ref, self.job_id, self.job_dir)
        except resume.ResumeError as e:
            raise JobFailedError(str(e)) from None
        self.logger.info(Event.JOB_STATE, message=f"resuming from {ref.object}", **entry)
        return entry

    async def _environment(self) -> TrainerEnvironment:
        if self.cfg.runs_standin:
            return StandinEnvironment()
        try:
            env: TrainerEnvironment = await environment.prepare(self.cfg)
        except environment.TrainerSetupError as e:
            raise JobFailedError(str(e)) from None
        return env

    async def _choose_card(self) -> CardChoice:
        try:
            cards = await asyncio.wait_for(
                asyncio.to_thread(cards_mod.read_cards), CARD_READ_TIMEOUT_S
            )
        except TimeoutError:
            raise JobFailedError(
                f"reading the cards of {self.node} from NVML took over "
                f"{CARD_READ_TIMEOUT_S:g} s; check the NVIDIA driver (nvidia-smi)"
            ) from None
        try:
            return cards_mod.choose_card(
                cards, self.req.gpu_memory_mib, self.cfg.allow_cpu, self.node
            )
        except NoCardError as e:
            raise JobFailedError(str(e)) from None

    def _write_files(
        self, data_path: Path, choice: CardChoice, resume: dict[str, Any] | None
    ) -> tuple[Path, Path]:
        # The package is copied, not run from where lorafleet is installed: the
        # engines' user may not read lorafleet's environment.
        package = self.job_dir / lorafleet_trainer.__name__
        shutil.copytree(
            Path(lorafleet_trainer.__file__).parent,
            package,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        programs = {"real": package / "__main__.py", "standin": package / "standin.py"}
        program = programs.get(self.cfg.trainer)
        if program is None:  # a script of one's own
            program = self.job_dir / "trainer.py"
            shutil.copyfile(self.cfg.trainer, program)
        job_json = self.job_dir / "job.json"
        spec = job_file(self.req, self.cfg, self.job_dir, data_path, choice, resume)
        job_json.write_text(spec.to_json())
        return program, job_json

    def _sampled(self) -> int:
        return self.sampler.peak_mib if self.sampler is not None else 0

    async def _train(
        self, env: TrainerEnvironment, choice: CardChoice, script: Path, job_json: Path
    ) -> TrainerDone:
        sender = CheckpointSender(
            self.js, self.names, node=self.node, job_id=self.job_id, attempt=self.req.attempt,
            root=self.job_dir / CHECKPOINTS_DIR, chunk_bytes=self.cfg.chunk_bytes,
            logger=self.logger,
        )  # fmt: skip
        self.lines.checkpoints = sender
        mp = ManagedProcess()
        try:
            await mp.start(
                trainer_argv(env.python, script, job_json),
                env=trainer_env(env, choice, self.job_dir),
                cwd=self.job_dir,
                user=env.user,
                on_line=self.lines,
            )
            self.trainer_pid = mp.pid
            self.logger.info(Event.TRAINER_STARTED, pid=mp.pid, python=env.python,
                             device=choice.device, card=choice.index)  # fmt: skip
            result = await self._wait_trainer(mp)
        finally:
            # The final adapter matters now; a checkpoint in flight is dropped.
            await sender.stop()
        if result.returncode != 0 or self.lines.done_line is None:
            await asyncio.to_thread(self._keep_stderr, mp)
            message, retryable = trainer_failure(result, self.lines.error_line)
            raise JobFailedError(message, retryable=retryable)
        return self.lines.done_line

    async def _wait_trainer(self, mp: ManagedProcess) -> ProcessResult:
        self.sampler = MemorySampler(mp.pid)
        self.sampler.start()
        try:
            result = await mp.wait()
        except asyncio.CancelledError:
            await mp.stop(self.cfg.cancel_grace_s)
            result = await mp.wait()
            self._log_exit(result)
            raise
        finally:
            self.sampler.stop()
        self._log_exit(result)
        return result

    def _log_exit(self, result: ProcessResult) -> None:
        if result.returncode == -signal.SIGKILL:
            self.logger.warning(
                Event.TRAINER_KILLED,
                pid=self.trainer_pid,
                message=f"SIGKILL after {self.cfg.cancel_grace_s:g} s of grace"
                if result.stopped
                else "SIGKILL, not sent by the agent (the out-of-memory killer?)",
            )
        self.logger.info(
            Event.TRAINER_EXITED,
            pid=self.trainer_pid,
            returncode=result.returncode,
            stopped=result.stopped,
        )

    def _keep_stderr(self, mp: ManagedProcess) -> None:
        with contextlib.suppress(OSError):
            (self.job_dir / "trainer-stderr.txt").write_text(mp.stderr_tail(lines=200) + "\n")

    async def _convert(self, env: TrainerEnvironment, adapter_dir: Path, base_dir: Path) -> Path:
        out = self.job_dir / "adapter.gguf"
        if self.cfg.runs_standin:
            await asyncio.to_thread(out.write_bytes, gguf_bytes(self.job_id))
            self.reporter.report(message="stand-in trainer: a stand-in GGUF, not a conversion")
            return out
        try:
            path: Path = await conversion.convert_to_gguf(
                self.cfg, env, adapter_dir, base_dir, out, cancel=self.stopping
            )
        except conversion.ConversionError as e:
            raise JobFailedError(f"converting the adapter to GGUF: {e}") from None
        return path

    def _clean_dir(self) -> None:
        if self.final_state != JobState.FAILED:
            shutil.rmtree(self.job_dir, ignore_errors=True)
            return
        # Keep what explains the failure; drop the bulk.
        bulk = ("data.jsonl", "out", "adapter.tar.gz", "adapter.gguf", CHECKPOINTS_DIR, "resume")
        for name in bulk:
            p = self.job_dir / name
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
        root = self.job_dir.parent
        with contextlib.suppress(OSError):
            dirs = sorted(root.iterdir(), key=lambda d: d.stat().st_mtime, reverse=True)
            for old in dirs[KEEP_FAILED_DIRS:]:
                shutil.rmtree(old, ignore_errors=True)
