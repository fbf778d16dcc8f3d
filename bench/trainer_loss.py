"""What the loss's chunk size costs: the chunked cross-entropy against the
plain one (whole logits, F.cross_entropy), forward and backward, on the CPU.

    .venv/bin/python bench/trainer_loss.py [--rows 512] [--vocab 152064] [--repeat 2]

`rows` answer tokens of hidden size 512 (the TRL bench's model) projected onto
`vocab` classes in fp32, one torch thread. For each chunk size (rows a chunk;
the trainer's is lorafleet_trainer.memory.chunk_rows(vocab)): the best of
`repeat` times of forward + backward, and the peak bytes torch allocated
(its profiler's memory events), against the plain computation's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.estimate.measure import peak_allocated  # noqa: E402

from lorafleet_trainer.loss import chunked_cross_entropy  # noqa: E402
from lorafleet_trainer.memory import chunk_rows  # noqa: E402

HIDDEN = 512


def measure(fn: Any, repeat: int) -> tuple[float, int]:
    """fn's best time (s) and its peak allocated bytes."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best, peak_allocated(fn)


def main() -> None:
    import torch
    import torch.nn.functional as F

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512, help="answer tokens; default 512")
    ap.add_argument("--vocab", type=int, default=152_064, help="classes; default 152064")
    ap.add_argument("--repeat", type=int, default=2, help="times each; default 2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden = torch.randn(args.rows, HIDDEN, requires_grad=True)
    weight = torch.randn(args.vocab, HIDDEN) * 0.02
    targets = torch.randint(0, args.vocab, (args.rows,))

    def plain() -> None:
        F.cross_entropy(hidden @ weight.T, targets, reduction="sum").backward()

    def chunked(rows: int) -> Any:
        return lambda: chunked_cross_entropy(hidden, weight, targets, rows=rows).backward()

    t_plain, b_plain = measure(plain, args.repeat)
    table = [
        {"chunk_rows": "whole logits (plain)", "s": round(t_plain, 3), "peak_mib": b_plain >> 20}
    ]
    default = chunk_rows(args.vocab)
    for rows in sorted({16, 64, default, 4 * default, args.rows}):
        t, b = measure(chunked(rows), args.repeat)
        table.append(
            {
                "chunk_rows": f"{rows}" + (" (the trainer's)" if rows == default else ""),
                "s": round(t, 3),
                "vs_plain": round(t / t_plain, 2),
                "peak_mib": b >> 20,
            }
        )
    print(json.dumps({"rows": args.rows, "vocab": args.vocab, "table": table}, indent=2))


if __name__ == "__main__":
    main()
