"""Where the trainer's files are: its checkpoints and its adapter.

A checkpoint is a directory `<checkpoint_dir>/step-NNNNNNNN` (`checkpoint_name`)
holding ADAPTER_WEIGHTS and ADAPTER_CONFIG (so it is a peft adapter directory
too), TRAINER_STATE (optimizer, LR scheduler, GradScaler and RNG states:
python's, torch's CPU and, on a card, CUDA's) and, written last,
CHECKPOINT_META: {format (CHECKPOINT_FORMAT), job_id, step, epoch, position
{epoch, index: steps done of that epoch's plan}, progress, fingerprint
(data_sha256, model, total_steps and the parameters but checkpoint_every_*,
dtype), files {name: bytes}, time}. It is written as `TMP_PREFIX + name`,
each file fsynced, then renamed and its parent fsynced: a crash leaves a
TMP_PREFIX directory (never resumed from, cleared at the next start) or a
complete checkpoint. The trainer never removes a checkpoint (the agent
removes superseded ones); a resumed run that passes a step again replaces
that step's checkpoint by its equal.

The result: `<out_dir>/ADAPTER_DIR/` with the peft adapter, CHAT_TEMPLATE
(the template it was trained with) and TRAINING_SUMMARY.
"""

from __future__ import annotations

from pathlib import Path

#: checkpoint.json's "format": a reader refuses any other.
CHECKPOINT_FORMAT = 1
CHECKPOINT_META = "checkpoint.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: The optimizer, LR scheduler, GradScaler and RNG states (torch.save; read
#: back with weights_only: no code runs on load).
TRAINER_STATE = "trainer_state.pt"
#: A checkpoint being written; never one to resume from.
TMP_PREFIX = ".tmp-"
#: Every complete checkpoint's name matches it; in step order when sorted.
CHECKPOINT_GLOB = "step-*"

#: Under the job's out_dir: the trained adapter.
ADAPTER_DIR = "adapter"
CHAT_TEMPLATE = "chat_template.jinja"
TRAINING_SUMMARY = "training_summary.json"


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint after optimizer step `step`."""
    return f"step-{step:08d}"


def is_temporary(path: Path) -> bool:
    """Whether `path` is a checkpoint still being written (or cut short)."""
    return path.name.startswith(TMP_PREFIX)


def newest_checkpoint(parent: Path) -> Path | None:
    """The newest complete checkpoint directly in `parent` (one with its
    CHECKPOINT_META), or None."""
    for c in sorted(parent.glob(CHECKPOINT_GLOB), reverse=True):
        if (c / CHECKPOINT_META).is_file():
            return c
    return None
