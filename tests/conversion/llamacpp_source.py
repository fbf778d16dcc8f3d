"""llama.cpp's real source for the conversion tests, fetched once and cached.

llama-cpp-python's source distribution on PyPI vendors llama.cpp;
version 0.3.36 carries ggml-org/llama.cpp@0c1e57098, which is release tag
b11312 (the vendored copy has no git, so its build number is not recorded
in it: the tag comes from llama-cpp-python's CHANGELOG "update llama.cpp to
ggml-org/llama.cpp@0c1e57098" and public references to `b11312-0c1e57098`).

Under the cache directory (`LORAFLEET_TEST_CACHE`, default
~/.cache/lorafleet-test), `llama-cpp-python-0.3.36/` holds, each made once:

- the sdist, downloaded with pip and checked against `SDIST_SHA256`;
- `llama.cpp/`: its vendored llama.cpp, extracted;
- `b11312.tar.gz`: that directory repacked as a release tarball with the top
  directory `llama.cpp-b11312/`, as GitHub serves a tag's source;
- `build-<sha12>/`: llama.cpp's shared library built from it (CPU only)
  plus a small C shim (`llama_eval.c`) the parity test calls through ctypes.

A file lock makes concurrent test processes wait for one another.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from lorafleet_services.agent.environment import gguf_conversion as conversion

# The same pinned sdist the demo repacks: one pin, in the package.
SDIST_NAME = conversion.PYPI_SDIST_FILE
SDIST_SHA256 = conversion.PYPI_SDIST_SHA256
TAG = conversion.PYPI_SDIST_TAG
SDIST_VERSION = SDIST_NAME.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
#: Seconds the one-time pip download may take.
DOWNLOAD_TIMEOUT_S = 600.0
#: Seconds the one-time library build may take (2 shared cores: ~2-4 minutes).
BUILD_TIMEOUT_S = 1500.0

CMAKE_FLAGS = (
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_CURL=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_BLAS=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_OPENMP=OFF",
)
#: Unoptimised: less CPU to build than Release, and a tiny model runs in
#: milliseconds either way (bench/conversion_build.py measures both).
BUILD_TYPE_FLAGS = ("-DCMAKE_BUILD_TYPE=None", "-DCMAKE_C_FLAGS=-O0", "-DCMAKE_CXX_FLAGS=-O0")

SHIM = Path(__file__).with_name("llama_eval.c")


def cache_root() -> Path:
    root = os.environ.get("LORAFLEET_TEST_CACHE") or str(Path.home() / ".cache" / "lorafleet-test")
    path = Path(root) / f"llama-cpp-python-{SDIST_VERSION}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    with (root / ".lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def sdist() -> Path:
    """The verified sdist, downloaded from PyPI the first time."""
    root = cache_root()
    path = root / SDIST_NAME
    with _locked(root):
        if not path.is_file():
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                cmd = [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    f"llama-cpp-python=={SDIST_VERSION}",
                    "-d",
                    tmp,
                ]
                subprocess.run(cmd, check=True, timeout=DOWNLOAD_TIMEOUT_S)
                os.replace(Path(tmp) / SDIST_NAME, path)
        got = sha256_of(path)
        if got != SDIST_SHA256:
            path.unlink()
            raise RuntimeError(
                f"{SDIST_NAME} has sha256 {got}, not the pinned {SDIST_SHA256}; removed it"
            )
    return path


def source_dir() -> Path:
    """The vendored llama.cpp source tree, extracted once."""
    root = cache_root()
    target = root / "llama.cpp"
    archive = sdist()
    with _locked(root):
        if not (target / ".complete").is_file():
            shutil.rmtree(target, ignore_errors=True)
            prefix = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
            staging = Path(tempfile.mkdtemp(dir=root, prefix=".llama.cpp."))
            try:
                with tarfile.open(archive) as tf:
                    members = []
                    for m in tf.getmembers():
                        if m.name.startswith(prefix):
                            m.name = m.name[len(prefix) :]
                            members.append(m)
                    tf.extractall(staging, members=members, filter="data")
                (staging / ".complete").write_text(SDIST_SHA256 + "\n")
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


def release_tarball() -> Path:
    """The vendored llama.cpp as `<TAG>.tar.gz`, top directory `llama.cpp-<TAG>/`."""
    root = cache_root()
    src = source_dir()
    path = root / f"{TAG}.tar.gz"
    with _locked(root):
        if not path.is_file():
            tmp = path.with_suffix(".partial")
            with tarfile.open(tmp, "w:gz", compresslevel=1) as tf:
                for p in sorted(src.rglob("*")):
                    rel = p.relative_to(src)
                    if rel.parts[0] == ".complete" or "__pycache__" in rel.parts:
                        continue
                    tf.add(p, arcname=f"llama.cpp-{TAG}/{rel.as_posix()}", recursive=False)
            os.replace(tmp, path)
    return path


def _run(cmd: list[str], timeout_s: float) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({done.returncode}):\n{tail}")


def build_library(src: Path, out: Path, type_flags: tuple[str, ...] = BUILD_TYPE_FLAGS) -> None:
    """Configure and build llama.cpp's `llama` target (CPU only) into `out`."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(
        ["cmake", "-S", str(src), "-B", str(out), *generator, *CMAKE_FLAGS, *type_flags],
        BUILD_TIMEOUT_S,
    )
    _run(["cmake", "--build", str(out), "-j2", "--target", "llama"], BUILD_TIMEOUT_S)


def compile_shim(src: Path, build: Path, out: Path) -> None:
    """The C shim against `src`'s llama.h, linked to `build`'s libllama."""
    partial = out.with_suffix(".partial")
    _run(
        [
            "cc",
            "-O1",
            "-shared",
            "-fPIC",
            f"-I{src / 'include'}",
            f"-I{src / 'ggml' / 'include'}",
            str(SHIM),
            f"-L{build / 'bin'}",
            "-lllama",
            f"-Wl,-rpath,{build / 'bin'}",
            "-o",
            str(partial),
        ],
        120,
    )
    os.replace(partial, out)


def build_dir() -> Path:
    """llama.cpp's shared library (`bin/libllama.so`) and the C shim
    (`liblfeval-<sha12 of the shim>.so`), built once per source sha256."""
    root = cache_root()
    src = source_dir()
    out = root / f"build-{SDIST_SHA256[:12]}"
    with _locked(root):
        if not (out / ".complete").is_file():
            shutil.rmtree(out, ignore_errors=True)
            started = time.monotonic()
            build_library(src, out)
            (out / ".complete").write_text(f"{time.monotonic() - started:.1f} s\n")
        shim = out / f"liblfeval-{sha256_of(SHIM)[:12]}.so"
        if not shim.is_file():
            compile_shim(src, out, shim)
    return out


def shim_library() -> Path:
    out = build_dir()
    return out / f"liblfeval-{sha256_of(SHIM)[:12]}.so"
