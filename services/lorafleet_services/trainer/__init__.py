"""The trainer: its own program, run by the agent in the node's engine Python.

`script.py` is the real LoRA trainer, `standin.py` a stand-in that speaks
the same protocol without training (tests, dry runs). Both import nothing
of lorafleet (the engine's Python does not have it): the agent copies the
file into the job directory and runs it there. `generate.py` writes the
script's parameter table from `TrainerParams` (see DESIGN.md).
"""

from __future__ import annotations

from pathlib import Path

#: The real trainer's file, copied into each job directory as trainer.py.
SCRIPT_PATH = Path(__file__).with_name("script.py")
#: The stand-in trainer's file.
STANDIN_PATH = Path(__file__).with_name("standin.py")
