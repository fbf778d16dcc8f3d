"""A job's loss curve as a picture: in the terminal (plotext) and as a PNG (matplotlib).

plotext is a runtime dependency (pure Python, no dependencies of its own);
matplotlib is the `plots` extra (tens of MB with its own dependencies, for
the occasional `--png`): without it, `--png` says how to install it.
"""

from __future__ import annotations

from pathlib import Path

from lorafleet_schemas.messages import JobCurve, JobRecord

#: The PNG's size in inches at PNG_DPI: 1000 x 500 pixels.
PNG_SIZE_IN = (10.0, 5.0)
PNG_DPI = 100
#: Rows of the terminal plot.
TERMINAL_PLOT_ROWS = 16


class PlotsMissingError(RuntimeError):
    """matplotlib is not installed."""


def _title(job: JobRecord) -> str:
    return f"job {job.id}" + (f" ({job.name})" if job.name else "") + f" - {job.state.value}"


def eval_points(job: JobRecord, curve: JobCurve) -> tuple[list[int], list[float]]:
    """The eval-loss curve; a recorder without one (before schema 0002) gives
    the job's latest eval loss, at its step."""
    if curve.evals:
        return [p.step for p in curve.evals], [p.eval_loss for p in curve.evals]
    if job.eval_loss is None:
        return [], []
    return [job.step], [job.eval_loss]


def terminal_plot(job: JobRecord, curve: JobCurve, width: int) -> str:
    """The loss curve (and eval loss) drawn with text; ANSI colours included."""
    import plotext as plt  # type: ignore[import-untyped]

    plt.clear_figure()
    plt.theme("clear")
    plt.plotsize(max(width, 40), TERMINAL_PLOT_ROWS)
    if curve.points:
        plt.plot([p.step for p in curve.points], [p.loss for p in curve.points], label="loss")
    steps, losses = eval_points(job, curve)
    if steps:
        plt.plot(steps, losses, label="eval loss", marker="x")
    plt.title(_title(job))
    plt.xlabel("step")
    return str(plt.build())


def write_png(job: JobRecord, curve: JobCurve, out: Path) -> None:
    """The same plot as a PNG image in `out`; PlotsMissingError without matplotlib."""
    try:
        import matplotlib as mpl
    except ImportError:
        raise PlotsMissingError(
            "--png needs matplotlib: pip install 'lorafleet[plots]' (or matplotlib)"
        ) from None
    mpl.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=PNG_SIZE_IN, dpi=PNG_DPI)
    try:
        ax.plot([p.step for p in curve.points], [p.loss for p in curve.points], label="loss")
        steps, losses = eval_points(job, curve)
        if steps:
            ax.plot(steps, losses, label="eval loss", marker="x", color="tab:orange")
        ax.set_title(_title(job))
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
