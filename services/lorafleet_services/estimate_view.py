"""The memory estimate as the `lorafleet` command shows it (estimate, submit
--dry-run, models add), kept apart from the CLI's wiring: plain text in, plain
text out, so that it is tested without a bus or a terminal."""

from __future__ import annotations

from lorafleet_schemas.messages import JobEstimate


def estimate_text(answer: JobEstimate, gpu_memory_mib: int | None = None) -> str:
    """The estimate line by line with its total and margin; or why there is none.
    With `gpu_memory_mib`, whether it fits and, when not, what to change."""
    est = answer.estimate
    if est is None:
        return f"no memory estimate for model {answer.model}: {answer.reason}"
    width = max(len(x.name) for x in est.lines)
    rows = [
        f"memory estimate for model {answer.model} ({est.dtype}, rows of {est.seq_len} tokens):"
    ]
    rows += [f"  {x.name:<{width}}  {x.mib:>10.1f} MiB  {x.note}" for x in est.lines]
    rows.append(f"  {'total':<{width}}  {est.total_mib:>10} MiB")
    rows.append(
        f"  with the {est.margin_fraction:.0%} margin: {est.recommended_mib} MiB "
        "(what a submit without --gpu-mib asks for)"
    )
    if gpu_memory_mib is not None:
        rows.append(
            f"--gpu-mib {gpu_memory_mib} fits the estimate"
            if answer.fits
            else f"refused: {answer.reason}"
        )
    return "\n".join(rows)
