"""One job on this node, from a StartRequest to delivered artifacts.

    preparing  the dataset (and what it resumes from, resume.py) fetched and
               checked, the trainer's environment, the card, job.json and
               the trainer package written into work_dir/jobs/<job>/
    running    the trainer in its own session; its lines become status
               reports (trainer_lines.py, status_reports.py), its
               checkpoints delivered meanwhile (transfer/checkpoints.py)
    converting GGUF, when the start request asks for it
    uploading  the PEFT adapter and the GGUF, in chunks

`done` is not the agent's to say: the artifact-store tells the recorder once
every artifact is stored. A failure is one `failed` report saying what to do,
`retryable` when the cause is not the job's own (`trainer_failure`).
`JobRun.stop(StopRequest)` cancels the pipeline wherever it is, with one
final report saying why. What becomes of the job directory: agent/DESIGN.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from nats.js import JetStreamContext

import lorafleet_services.agent.environment.environments as environment
import lorafleet_services.agent.environment.gguf_conversion as conversion
import lorafleet_services.agent.node.cards as cards_mod
import lorafleet_services.agent.training.resume as resume
import lorafleet_services.agent.transfer.delivery as delivery
import lorafleet_services.agent.transfer.packing as packing
from lorafleet import log
from lorafleet._process import die_with_parent
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet_schemas.messages import ArtifactKind, JobState, StartRequest, TrainerDone
from lorafleet_services.agent.config import AgentConfig
from lorafleet_services.agent.environment.protocol import (
    ConversionRequest,
    TrainerEnvironment,
    TrainerSetupError,
)
from lorafleet_services.agent.node.card_memory import MemorySampler
from lorafleet_services.agent.node.cards import CardChoice, NoCardError
from lorafleet_services.agent.node.leftovers import JOB_DIR_VAR
from lorafleet_services.agent.node.process import ManagedProcess, ProcessResult
from lorafleet_services.agent.training.status_reports import Reporter
from lorafleet_services.agent.training.trainer_lines import TrainerLines, job_estimate_mib
from lorafleet_services.agent.training.yielding import (
    PAUSE_FILE,
    LoadTargets,
    start_yielding,
    stop_yielding,
)
from lorafleet_services.agent.transfer.checkpoints import CHECKPOINT_NOW_FILE, CheckpointSender
from lorafleet_services.agent.transfer.fetch import (
    DATA_FILE,
    EVAL_DATA_FILE,
    DatasetFetchError,
    fetch_datasets,
)
from lorafleet_trainer.jobfile import Base, JobFile, parse_resume
from lorafleet_trainer.params import Params
from lorafleet_trainer.protocol import ExitCode

#: Seconds the final reports of a job may take to publish when the agent stops.
STOP_DRAIN_TIMEOUT_S = 5.0
#: Seconds the last reports of a finished job may take to publish. Longer
#: outages fence the agent first; a server that keeps refusing them (no
#: status stream, no permission) must not keep the node busy for ever.
FINISHED_DRAIN_TIMEOUT_S = 60.0
#: Seconds a card read for the card choice may take.
CARD_CHOICE_READ_TIMEOUT_S = 10.0
#: Failed job directories kept for reading (the newest ones).
KEEP_FAILED_DIRS = 5
#: In the job directory: where the trainer writes its checkpoints.
CHECKPOINTS_DIR = "checkpoints"


class JobStepError(Exception):
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
    `protocol.RUN_ENV` included), and the job's directory."""
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
    delivers and removes them: agent/transfer/checkpoints.py); pause_path:
    the pause file of a job that yields to serving (training/yielding.py); resume: where it
    starts from (agent/training/resume.py's entry {"dir", "mode"}), or None. The
    evaluation set, when the job has one, is EVAL_DATA_FILE beside the data.
    """
    has_eval = req.eval_dataset is not None
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
        eval_data_path=data_path.with_name(EVAL_DATA_FILE) if has_eval else None,
        eval_data_sha256=req.eval_dataset_sha256 if has_eval else None,
        pause_path=job_dir / PAUSE_FILE if req.params.yield_to_serving == "auto" else None,
        checkpoint_now_path=job_dir / CHECKPOINT_NOW_FILE,
    )


def card_choice_text(choice: CardChoice, node: str) -> str:
    if choice.index is None:
        return f"training on the CPU of {node} (it has no card; CPU training is allowed)"
    return f"training on GPU {choice.index} ({choice.name}) of {node}, {choice.free_mib} MiB free"


@dataclass(frozen=True, slots=True)
class StopRequest:
    """Why a job stops, and the report that ends it.

    state: the final report's state; None sends none (fenced: the scheduler
    failed the job already and NATS is out of reach). retryable: the cause
    is not the job's own (the agent stopping, the node fenced)."""

    state: JobState | None
    message: str
    retryable: bool = False

    @classmethod
    def cancelled(cls, message: str) -> StopRequest:
        """Cancelled by the control plane: `cancelled`, not retried."""
        return cls(JobState.CANCELLED, message)

    @classmethod
    def agent_stopping(cls, message: str) -> StopRequest:
        """The agent shuts down: `failed`, retryable."""
        return cls(JobState.FAILED, message, retryable=True)

    @classmethod
    def fenced(cls) -> StopRequest:
        """The agent fenced itself: no final report (the agent reports the
        fence itself once NATS answers again)."""
        return cls(None, "fenced")


#: The serving agent's hand-off, in plain fields (training knows nothing of
#: serving): the request, the adapter and base directories, the delivered
#: artifacts' sha256s and files, and the job directory (removed once it
#: returns, so the adapter is staged out of it before).
Delivered = Callable[
    [StartRequest, Path, Path, Mapping[ArtifactKind, str], Mapping[ArtifactKind, Path], Path],
    Awaitable[None],
]


class JobRun:
    """One StartRequest's pipeline, as a task. `stop()` ends it from anywhere."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        cfg: AgentConfig,
        req: StartRequest,
        on_delivered: Delivered | None = None,
        engines: LoadTargets | None = None,
    ) -> None:
        self.js = js
        #: The node's engines, for a job that yields to serving; None: none.
        self.engines = engines
        #: Told of the job once its artifacts are delivered (the serving
        #: agent's auto-serve), before the job directory goes; None: nothing
        #: is served.
        self.on_delivered = on_delivered
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
        #: Why and how the job stops, once stop() was called.
        self.stop_request: StopRequest | None = None
        self.task: asyncio.Task[None] | None = None
        #: Set by stop(); steps that stop on an event (the conversion) get it too.
        self.stopping = asyncio.Event()

    def start(self) -> asyncio.Task[None]:
        """Run the job in a task of its own; that task."""
        self.reporter.report(JobState.PREPARING, f"preparing on {self.node}: fetching the dataset")
        self.task = asyncio.create_task(self._run(), name=f"job-{self.job_id}")
        return self.task

    async def stop(self, request: StopRequest, timeout_s: float) -> None:
        """Stop the job as `request` says; wait at most `timeout_s` for it to
        end. A second request while it stops changes nothing."""
        if self.task is None or self.task.done():
            return
        if self.stop_request is None:
            self.stop_request = request
            self.stopping.set()
            self.task.cancel()
        await asyncio.wait({self.task}, timeout=timeout_s)

    async def wait(self) -> None:
        if self.task is not None:
            await asyncio.wait({self.task})

    # --- the pipeline -------------------------------------------------------

    async def _run(self) -> None:
        drain_timeout_s = FINISHED_DRAIN_TIMEOUT_S
        try:
            await self._pipeline()
        except asyncio.CancelledError:
            request = self.stop_request
            if request is None:  # the loop is going away: nothing more to say
                self.reporter.abandon()
                raise
            self.final_state = request.state
            if request.state is None:
                self.reporter.abandon()
            else:
                self.reporter.report(request.state, request.message, retryable=request.retryable)
                drain_timeout_s = STOP_DRAIN_TIMEOUT_S
            self.logger.info(Event.JOB_CANCELLED, state=request.state, message=request.message)
        except JobStepError as e:
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
        data_path = self.job_dir / DATA_FILE
        try:
            await fetch_datasets(self.js, self.names.datasets_bucket, self.req, self.job_dir)
        except DatasetFetchError as e:
            raise JobStepError(str(e)) from None
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
        tokens = done.summary.get("tokens_seen")
        self.reporter.report(
            JobState.UPLOADING, "delivering the artifacts",
            tokens_seen=tokens if isinstance(tokens, int) else None,
        )  # fmt: skip
        if ArtifactKind.PEFT in self.req.artifacts:
            packed = self.job_dir / "adapter.tar.gz"
            await asyncio.to_thread(packing.pack_adapter, adapter_dir, packed)
            files.append((ArtifactKind.PEFT, packed))
        if ArtifactKind.GGUF in self.req.artifacts:
            files.append((ArtifactKind.GGUF, gguf))
        delivered: list[str] = []
        shas: dict[ArtifactKind, str] = {}
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
                raise JobStepError(f"delivering the {kind.value} artifact: {e}") from None
            delivered.append(f"{kind.value} ({size} bytes, sha256 {sha[:12]}…)")
            shas[kind] = sha
        self.final_state = JobState.UPLOADING
        self.reporter.report(
            message="delivered "
            + ", ".join(delivered or ["nothing (no artifact asked for)"])
            + "; the artifact-store finishes the job"
        )
        await self._hand_to_serving(adapter_dir, Path(done.base_dir), shas, files)

    async def _hand_to_serving(
        self,
        adapter_dir: Path,
        base_dir: Path,
        shas: dict[ArtifactKind, str],
        files: list[tuple[ArtifactKind, Path]],
    ) -> None:
        """Stage the adapter out of the job directory (it goes next) and hand
        it to the serving agent, which serves it in a task of its own. The
        job is delivered whatever happens here: a failure is logged only."""
        if self.on_delivered is None or self.req.serve is False:
            return
        try:
            await self.on_delivered(
                self.req, adapter_dir, base_dir, shas, dict(files), self.job_dir
            )
        except Exception as e:
            self.logger.warning(Event.SERVING_CHANGED, state="not staged", error=repr(e))

    def _make_dir(self) -> None:
        shutil.rmtree(self.job_dir, ignore_errors=True)
        self.job_dir.mkdir(parents=True, mode=0o755)
        (self.job_dir / CHECKPOINTS_DIR).mkdir(mode=0o755)

    async def _fetch_resume(self) -> dict[str, Any] | None:
        """What job.json's `resume` says: the checkpoint or adapter fetched,
        checked and unpacked (agent/training/resume.py); None to start afresh."""
        ref = self.req.resume
        if ref is None:
            return None
        self.reporter.report(message=f"fetching {resume.describe(ref)} to start from")
        try:
            entry = await resume.fetch_resume(self.js, self.names, ref, self.job_id, self.job_dir)
        except resume.ResumeFetchError as e:
            raise JobStepError(str(e)) from None
        self.logger.info(Event.JOB_STATE, message=f"resuming from {ref.object}", **entry)
        return entry

    async def _environment(self) -> TrainerEnvironment:
        try:
            return await environment.trainer_environment(self.cfg)
        except TrainerSetupError as e:
            raise JobStepError(str(e)) from None

    async def _choose_card(self) -> CardChoice:
        try:
            cards = await asyncio.wait_for(
                asyncio.to_thread(cards_mod.read_cards), CARD_CHOICE_READ_TIMEOUT_S
            )
        except TimeoutError:
            raise JobStepError(
                f"reading the cards of {self.node} from NVML took over "
                f"{CARD_CHOICE_READ_TIMEOUT_S:g} s; check the NVIDIA driver (nvidia-smi)"
            ) from None
        try:
            return cards_mod.choose_card(
                cards, self.req.gpu_memory_mib, self.cfg.allow_cpu, self.node
            )
        except NoCardError as e:
            raise JobStepError(str(e)) from None

    def _write_files(
        self, data_path: Path, choice: CardChoice, resume: dict[str, Any] | None
    ) -> tuple[Path, Path]:
        package = environment.copy_trainer_package(self.job_dir)
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
            yielding = start_yielding(self.job_dir / PAUSE_FILE, self.req.params.yield_to_serving,
                                      self.engines, self.cfg, self.logger)  # fmt: skip
            try:
                result = await self._wait_trainer(mp)
            finally:
                await stop_yielding(yielding)
        finally:
            # The final adapter matters now; a checkpoint in flight is dropped.
            await sender.stop()
        if result.returncode != 0 or self.lines.done_line is None:
            await asyncio.to_thread(self._keep_stderr, mp)
            message, retryable = trainer_failure(result, self.lines.error_line)
            raise JobStepError(message, retryable=retryable)
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
        try:
            note = await env.convert_to_gguf(
                ConversionRequest(self.cfg, self.job_id, adapter_dir, base_dir, out, self.stopping)
            )
        except conversion.ConversionError as e:
            raise JobStepError(f"converting the adapter to GGUF: {e}") from None
        if note is not None:
            self.reporter.report(message=note)
        return out

    def _clean_dir(self) -> None:
        if self.final_state != JobState.FAILED:
            shutil.rmtree(self.job_dir, ignore_errors=True)
            return
        # Keep what explains the failure; drop the bulk.
        bulk = (
            DATA_FILE,
            EVAL_DATA_FILE,
            "out",
            "adapter.tar.gz",
            "adapter.gguf",
            CHECKPOINTS_DIR,
            "resume",
        )
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
