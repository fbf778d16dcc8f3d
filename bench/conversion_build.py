"""Which llama.cpp build the parity test should use: unoptimised (-O0) or
Release, measured as build time plus the time to run the parity evaluation.

    .venv/bin/python bench/conversion_build.py [--evals 20]

Both variants build the same `llama` target from the same cached source
(tests/conversion/llamacpp_source.py: llama.cpp b11312, CPU only, -j2) into
fresh temp dirs, one after the other; wall time and the children's CPU time
are reported. Then each variant's shim evaluates the tiny Llama base + its
GGUF adapter on a 16-token prompt `--evals` times (model load included, as in
the test), in a subprocess of its own (two libllama.so.0 cannot share a
process). The ratios are O0 / Release: below 1 means O0 is cheaper.
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conversion import llamacpp_source  # noqa: E402
from tests.conversion.adapters import base_for_gguf, make_adapter  # noqa: E402

from lorafleet_services.local.tiny_model import build_tiny_model  # noqa: E402

VARIANTS = {
    "O0": llamacpp_source.BUILD_TYPE_FLAGS,
    "Release": ("-DCMAKE_BUILD_TYPE=Release",),
}
TOKENS = list(range(1, 17))


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _convert(script: str, args: list[str], code: Path, cwd: Path) -> None:
    env = {
        "PYTHONPATH": f"{code / 'gguf-py'}:{code}",
        "HF_HUB_OFFLINE": "1",
        "PATH": "/usr/bin",
        "PYTHONDONTWRITEBYTECODE": "1",  # the cached source stays as released
    }
    subprocess.run(
        [sys.executable, str(code / script), *args],
        check=True,
        env=env,
        cwd=cwd,
        capture_output=True,
    )


def _eval_main(shim: str, base: str, adapter: str, evals: int) -> None:
    lib = ctypes.CDLL(shim)
    lib.lf_eval.restype = ctypes.c_int
    ids = (ctypes.c_int32 * len(TOKENS))(*TOKENS)
    out = (ctypes.c_float * (len(TOKENS) * 4096))()
    started = time.perf_counter()
    for _ in range(evals):
        n = lib.lf_eval(
            base.encode(),
            adapter.encode(),
            ctypes.c_float(1.0),
            ids,
            len(TOKENS),
            out,
            ctypes.c_int64(len(out)),
        )
        assert n > 0, n
    print((time.perf_counter() - started) / evals)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--evals", type=int, default=20)
    parser.add_argument("--eval", nargs=3, metavar=("SHIM", "BASE", "ADAPTER"))
    args = parser.parse_args()
    if args.eval:
        shim, base, adapter = args.eval
        _eval_main(shim, base, adapter, args.evals)
        return

    src = llamacpp_source.source_dir()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = build_tiny_model("llama", tmp / "llama")
        adapter = make_adapter(base, tmp / "lora")
        _convert(
            "convert_hf_to_gguf.py",
            [
                "--outtype",
                "f32",
                "--outfile",
                str(tmp / "base.gguf"),
                str(base_for_gguf(base, tmp / "gg")),
            ],
            src,
            tmp,
        )
        _convert(
            "convert_lora_to_gguf.py",
            [
                "--base",
                str(base),
                "--outtype",
                "f16",
                "--outfile",
                str(tmp / "lora.gguf"),
                str(adapter),
            ],
            src,
            tmp,
        )
        results: dict[str, tuple[float, float, float]] = {}
        for name, flags in VARIANTS.items():
            out = tmp / f"build-{name}"
            cpu0, wall0 = _children_cpu_s(), time.monotonic()
            llamacpp_source.build_library(src, out, flags)
            wall, cpu = time.monotonic() - wall0, _children_cpu_s() - cpu0
            shim = tmp / f"shim-{name}.so"
            llamacpp_source.compile_shim(src, out, shim)
            per_eval = float(
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--evals",
                        str(args.evals),
                        "--eval",
                        str(shim),
                        str(tmp / "base.gguf"),
                        str(tmp / "lora.gguf"),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.split()[-1]
            )
            results[name] = (wall, cpu, per_eval)
            print(
                f"{name:8s} build {wall:6.1f} s wall, {cpu:6.1f} s CPU; "
                f"eval {per_eval * 1000:7.2f} ms (load + 16 tokens)",
                flush=True,
            )
        (o_wall, o_cpu, o_eval), (r_wall, r_cpu, r_eval) = results["O0"], results["Release"]
        print(
            f"O0/Release: build wall {o_wall / r_wall:.2f}, build CPU {o_cpu / r_cpu:.2f}, "
            f"eval {o_eval / r_eval:.2f}; build + 8 evals (the parity test) "
            f"{(o_wall + 8 * o_eval) / (r_wall + 8 * r_eval):.2f}"
        )


if __name__ == "__main__":
    main()
