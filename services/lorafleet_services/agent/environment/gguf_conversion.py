"""A trained LoRA adapter to GGUF, with the installed llama.cpp release's own
conversion code.

The tensor names and metadata a llama.cpp expects of a GGUF adapter change
between releases, so the converter is always that of the installed release
(`find_llamacpp_tag`), fetched once by tag from `cfg.conversion_source` and
cached in the work directory (`ensure_conversion_code`: only the conversion
scripts and their packages are kept; a link, a device or a path leaving its
directory refuses the whole tarball). `convert_to_gguf` runs it in the
engine's Python, as the engines' user. `local_conversion_source` makes such
a source from llama-cpp-python's sdist, for the demo.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import weakref
from pathlib import Path, PurePosixPath
from typing import IO

from lorafleet_services.agent.config import AgentConfig, LlamacppTagError, check_llamacpp_tag
from lorafleet_services.agent.environment.protocol import TrainerEnvironment
from lorafleet_services.agent.node.cards import CardChoice
from lorafleet_services.agent.node.installed_engines import llamacpp_tag
from lorafleet_services.agent.node.process import ProcessResult, run_process
from lorafleet_services.agent.peft_adapter import AdapterConfigError, PeftAdapterConfig

#: Seconds a fetch may wait for the source to answer or send the next bytes.
FETCH_TIMEOUT_S = 60.0
#: Largest source tarball fetched (llama.cpp's is about 25 MiB).
MAX_TARBALL_BYTES = 1 << 30
#: Largest single file kept from it (convert_hf_to_gguf.py is well under 1 MiB).
MAX_MEMBER_BYTES = 64 << 20
#: Bytes read per step while streaming the tarball.
_CHUNK_BYTES = 1 << 20

#: Written last into a cached conversion directory: present means complete.
COMPLETE_MARKER = ".lorafleet-complete"

#: What is kept of llama.cpp's source: the scripts and the packages they import.
KEPT_FILES = frozenset({"convert_lora_to_gguf.py", "convert_hf_to_gguf.py"})
KEPT_DIRS = frozenset({"conversion", "gguf-py"})
#: Without these the release cannot convert an adapter (conversion/ is newer
#: than the scripts; older releases keep the models in convert_hf_to_gguf.py).
REQUIRED = ("convert_lora_to_gguf.py", "gguf-py/gguf/__init__.py")


class ConversionError(RuntimeError):
    """The adapter could not be converted to GGUF; the message says what to do."""


class ConversionCancelledError(ConversionError):
    """The conversion was stopped by its cancel event."""


def find_llamacpp_tag(cfg: AgentConfig) -> str:
    """The llama.cpp release to convert with: the one the heartbeat reports
    (`engines.llamacpp_tag`: `cfg.llamacpp_tag` when set, else the newest
    installed); ConversionError saying what to do when there is none."""
    tag = llamacpp_tag(cfg.engines_dir, cfg.llamacpp_tag)
    if tag is None:
        raise ConversionError(
            f"a GGUF adapter needs llama.cpp installed on {cfg.node} (nothing like "
            f"{cfg.engines_dir / 'llamacpp'}/b<build>-... there), so that the converter "
            "matches the release that serves it; install llama.cpp on this node, or set "
            "LORAFLEET_AGENT_LLAMACPP_TAG to the release tag it serves (for example b4000)"
        )
    return tag


def _check_tag(tag: str, what: str) -> str:
    try:
        return check_llamacpp_tag(tag, what)
    except LlamacppTagError as e:
        raise ConversionError(str(e)) from None


def conversion_dir(cfg: AgentConfig, tag: str) -> Path:
    """Where the conversion code of release `tag` is cached."""
    return cfg.work_dir / f"llama.cpp-{_check_tag(tag, 'the llama.cpp tag')}"


_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Path, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def _lock_for(path: Path) -> asyncio.Lock:
    per_loop = _locks.setdefault(asyncio.get_running_loop(), {})
    return per_loop.setdefault(path, asyncio.Lock())


async def ensure_conversion_code(cfg: AgentConfig, tag: str) -> Path:
    """The directory holding release `tag`'s `convert_lora_to_gguf.py`,
    `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/`: fetched from
    `cfg.conversion_source` the first time (timeout FETCH_TIMEOUT_S seconds
    per read), cached at `<work_dir>/llama.cpp-<tag>` afterwards."""
    target = conversion_dir(cfg, tag)
    if (target / COMPLETE_MARKER).is_file():
        return target
    async with _lock_for(target):
        if (target / COMPLETE_MARKER).is_file():
            return target
        source = cfg.conversion_source.replace("{tag}", tag)
        await asyncio.to_thread(_fetch_and_extract, source, target)
    return target


def _fetch_and_extract(source: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    scheme = urllib.parse.urlsplit(source).scheme
    with contextlib.ExitStack() as stack:
        if scheme in ("http", "https"):
            tmp = stack.enter_context(
                tempfile.TemporaryFile(dir=target.parent, prefix=f".{target.name}.")
            )
            _download(source, tmp)
            tmp.seek(0)
            tarball: IO[bytes] = tmp
        else:
            path = (
                Path(urllib.request.url2pathname(urllib.parse.urlsplit(source).path))
                if scheme == "file"
                else Path(source)
            )
            try:
                tarball = stack.enter_context(path.open("rb"))
            except OSError as e:
                raise ConversionError(
                    f"cannot read llama.cpp's source tarball {path} ({e.strerror}); put the "
                    "release tarball there or point LORAFLEET_AGENT_CONVERSION_SOURCE at it"
                ) from None
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
        try:
            extract_conversion_code(tarball, staging, source)
            (staging / COMPLETE_MARKER).write_text(source + "\n")
            _readable_by_all(staging)
            # A leftover without its marker is an interrupted earlier attempt.
            if target.exists() and not (target / COMPLETE_MARKER).is_file():
                shutil.rmtree(target)
            try:
                staging.rename(target)
            except OSError:
                if not (target / COMPLETE_MARKER).is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _readable_by_all(root: Path) -> None:
    """Directories 0755, files 0644, whatever the agent's umask (mkdtemp
    makes 0700): the converter runs as the engines' user."""
    root.chmod(0o755)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o644)


def _download(url: str, out: IO[bytes]) -> None:
    req = urllib.request.Request(url, headers={"User-Agent": "lorafleet-agent"})
    try:
        with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT_S) as res:
            size = 0
            while chunk := res.read(_CHUNK_BYTES):
                size += len(chunk)
                if size > MAX_TARBALL_BYTES:
                    raise ConversionError(
                        f"{url} sent more than {MAX_TARBALL_BYTES >> 20} MiB; that is not "
                        "llama.cpp's source tarball (check LORAFLEET_AGENT_CONVERSION_SOURCE)"
                    )
                out.write(chunk)
    except urllib.error.HTTPError as e:
        raise ConversionError(
            f"fetching llama.cpp's source from {url}: it answered {e.code} {e.reason}; "
            "check the release tag and LORAFLEET_AGENT_CONVERSION_SOURCE (a mirror or a "
            "local file for nodes without internet)"
        ) from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConversionError(
            f"fetching llama.cpp's source from {url} failed ({reason}); a node without "
            "internet needs LORAFLEET_AGENT_CONVERSION_SOURCE set to a mirror or a local file"
        ) from None


def _kept(rel: PurePosixPath) -> bool:
    if not rel.parts:
        return False
    if len(rel.parts) == 1:
        return rel.parts[0] in KEPT_FILES or rel.parts[0] in KEPT_DIRS
    return rel.parts[0] in KEPT_DIRS


def extract_conversion_code(tarball: IO[bytes], dest: Path, source: str = "the tarball") -> None:
    """Extract, of a llama.cpp source tarball (any compression tarfile reads),
    the kept files into the existing directory `dest`, without the tarball's
    top directory. Refuses (ConversionError) a tarball with an absolute path
    or a '..' anywhere, or a link, device or fifo among the kept members."""
    files = 0
    try:
        with tarfile.open(fileobj=tarball, mode="r:*") as tf:
            for member in tf:
                files += _extract_member(tf, member, dest, source)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ConversionError(
            f"{source} is not a readable tar archive ({e}); it should be llama.cpp's "
            "release tarball: check the conversion source, or fetch it again"
        ) from None
    missing = [r for r in REQUIRED if not (dest / r).is_file()]
    if missing:
        raise ConversionError(
            f"{source} has no {', '.join(missing)} (kept {files} files): it is not a llama.cpp "
            "release that converts LoRA adapters; check the tag and the conversion source"
        )


def _extract_member(tf: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, source: str) -> int:
    name = member.name
    path = PurePosixPath(name)
    if name.startswith("/") or ".." in path.parts:
        raise ConversionError(
            f"{source} has a member {name!r} that leaves its directory; refusing it "
            "(a genuine llama.cpp release has none)"
        )
    rel = PurePosixPath(*path.parts[1:])
    if not _kept(rel):
        return 0
    if not (member.isreg() or member.isdir()):
        kind = (
            "a symlink"
            if member.issym()
            else "a hard link"
            if member.islnk()
            else "a device or fifo"
            if (member.isdev())
            else "not a plain file"
        )
        raise ConversionError(
            f"{source} has {name!r}, which is {kind}, among the conversion code; "
            "refusing it (a genuine llama.cpp release has none there)"
        )
    try:
        # The standard library's guarantees too (no absolute or escaping
        # path, no special file, safe modes), on the name as it is written.
        tarfile.data_filter(member.replace(name=rel.as_posix(), deep=False), str(dest))
    except tarfile.FilterError as e:
        raise ConversionError(
            f"{source} has {name!r}, which tarfile's data filter refuses ({e}); refusing it"
        ) from None
    out = dest.joinpath(*rel.parts)
    if member.isdir():
        out.mkdir(mode=0o755, parents=True, exist_ok=True)
        return 0
    if member.size > MAX_MEMBER_BYTES:
        raise ConversionError(f"{source} has {name!r} of {member.size} bytes; refusing it")
    out.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    src = tf.extractfile(member)
    if src is None:  # tarfile gives no data for a non-file, and only files get here
        raise ConversionError(f"{source} has {name!r} without data; refusing it")
    # O_EXCL: a duplicated member is a tarball trying to overwrite what it wrote.
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ConversionError(f"{source} has {name!r} twice; refusing it") from None
    with os.fdopen(fd, "wb") as f:
        shutil.copyfileobj(src, f, _CHUNK_BYTES)
    return 1


def check_adapter(adapter_dir: Path) -> PeftAdapterConfig:
    """The adapter's config (peft_adapter.py's one parse), refused
    (ConversionError) when it is none or uses what llama.cpp's LoRA format
    cannot express."""
    try:
        config = PeftAdapterConfig.read(adapter_dir)
    except AdapterConfigError as e:
        raise ConversionError(str(e)) from None
    used = config.llamacpp_refusals()
    if used:
        raise ConversionError(
            f"the adapter uses {', '.join(used)}, which llama.cpp's LoRA format cannot "
            "express (it scales every module by alpha/rank); train without it for GGUF"
        )
    return config


async def convert_to_gguf(
    cfg: AgentConfig,
    env: TrainerEnvironment,
    adapter_dir: Path,
    base_dir: Path,
    out_file: Path,
    cancel: asyncio.Event | None = None,
) -> Path:
    """Convert the PEFT adapter in `adapter_dir` (trained on the Hugging Face
    model in `base_dir`) to a GGUF LoRA adapter at `out_file` (f16), with the
    installed llama.cpp release's converter, in `env.python` as `env.user`.
    Setting `cancel` stops it (ConversionCancelledError). Answers `out_file`,
    written whole or not at all."""
    check_adapter(adapter_dir)
    tag = find_llamacpp_tag(cfg)
    code = await ensure_conversion_code(cfg, tag)
    if cancel is not None and cancel.is_set():
        raise ConversionCancelledError("the GGUF conversion was cancelled")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    # The converter's cwd and output live beside out_file (same filesystem,
    # so the final rename is atomic) and are handed to the engines' user.
    work = Path(tempfile.mkdtemp(dir=out_file.parent, prefix=".gguf-"))
    try:
        env.give(out_file.parent)
        partial = work / "adapter.gguf"
        result = await run_process(
            _converter_argv(env, code, base_dir, adapter_dir, partial),
            env=_converter_env(env, code),
            cwd=work,
            user=env.user,
            cancel=cancel,
            grace_s=cfg.cancel_grace_s,
        )
        if result.stopped or (cancel is not None and cancel.is_set()):
            raise ConversionCancelledError("the GGUF conversion was cancelled")
        _check_converted(tag, result, partial)
        os.replace(partial, out_file)
        return out_file
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _converter_argv(
    env: TrainerEnvironment, code: Path, base_dir: Path, adapter_dir: Path, out: Path
) -> list[str]:
    return [
        env.python,
        str(code / "convert_lora_to_gguf.py"),
        "--base",
        str(base_dir),
        "--outtype",
        "f16",
        "--outfile",
        str(out),
        str(adapter_dir),
    ]


def _converter_env(env: TrainerEnvironment, code: Path) -> dict[str, str]:
    """The trainer's environment, the release's gguf-py and code first on PYTHONPATH."""
    choice = CardChoice(index=None, name="cpu", free_mib=0)
    existing = env.process_env(choice).get("PYTHONPATH", "")
    pythonpath = os.pathsep.join(p for p in (str(code / "gguf-py"), str(code), existing) if p)
    # The base is local (--base): nothing needs the hub.
    return env.process_env(choice, extra={"PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"})


def _check_converted(tag: str, result: ProcessResult, partial: Path) -> None:
    if result.returncode != 0:
        raise ConversionError(
            f"llama.cpp {tag}'s convert_lora_to_gguf.py failed (exit {result.returncode}): "
            f"{result.stderr_tail or 'no output'}"
        )
    if not partial.is_file() or partial.stat().st_size == 0:
        raise ConversionError(
            f"llama.cpp {tag}'s convert_lora_to_gguf.py wrote no GGUF file: "
            f"{result.stderr_tail or 'no output'}"
        )


# ------------------------------------------------- a source for the demo

#: llama-cpp-python's source distribution on PyPI vendors llama.cpp; this one
#: carries ggml-org/llama.cpp@0c1e57098, release b11312 (the vendored copy has
#: no git, so the tag comes from its CHANGELOG's commit).
PYPI_SDIST = "llama-cpp-python==0.3.36"
PYPI_SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
PYPI_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PYPI_SDIST_TAG = "b11312"
_VENDORED = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
#: Seconds pip may take to fetch the sdist (it also prepares its metadata).
PIP_DOWNLOAD_TIMEOUT_S = 600.0


async def local_conversion_source(directory: Path) -> tuple[str, str]:
    """(conversion_source, llamacpp_tag) for a machine without llama.cpp
    installed (the demo): llama-cpp-python's sdist (PYPI_SDIST) is fetched
    with pip into `directory` (once; checked against PYPI_SDIST_SHA256) and
    its llama.cpp's conversion code repacked there as `<tag>.tar.gz`, the
    shape of a release tarball, so the agent's own fetch path reads it."""
    return await asyncio.to_thread(_local_conversion_source, directory)


def _local_conversion_source(directory: Path) -> tuple[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    tarball = directory / f"{PYPI_SDIST_TAG}.tar.gz"
    if not tarball.is_file():
        sdist = directory / PYPI_SDIST_FILE
        if not sdist.is_file():
            _pip_download(directory)
        digest = hashlib.sha256()
        with sdist.open("rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
        if digest.hexdigest() != PYPI_SDIST_SHA256:
            sdist.unlink()
            raise ConversionError(
                f"{PYPI_SDIST_FILE} from PyPI has sha256 {digest.hexdigest()}, not the pinned "
                f"{PYPI_SDIST_SHA256}; removed it, try again"
            )
        partial = tarball.with_suffix(".partial")
        top = f"llama.cpp-{PYPI_SDIST_TAG}/"
        with tarfile.open(sdist) as src, tarfile.open(partial, "w:gz") as out:
            for member in src:
                if not member.name.startswith(_VENDORED):
                    continue
                rel = PurePosixPath(member.name[len(_VENDORED) :])
                if not _kept(rel) or "__pycache__" in rel.parts:
                    continue
                data = src.extractfile(member) if member.isreg() else None
                member.name = top + rel.as_posix()
                out.addfile(member, data)
        os.replace(partial, tarball)
    return str(directory / "{tag}.tar.gz"), PYPI_SDIST_TAG


def _pip_download(directory: Path) -> None:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        cmd += ["--no-binary", ":all:", PYPI_SDIST, "-d", tmp]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=PIP_DOWNLOAD_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ConversionError(f"fetching {PYPI_SDIST} with pip failed ({e})") from None
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            raise ConversionError(
                f"fetching {PYPI_SDIST} from PyPI with pip failed: {tail}; this needs PyPI "
                "reachable (or put the sdist into the directory yourself)"
            )
        os.replace(Path(tmp) / PYPI_SDIST_FILE, directory / PYPI_SDIST_FILE)
