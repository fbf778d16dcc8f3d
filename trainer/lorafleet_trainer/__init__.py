"""lorafleet's LoRA trainer: its own program, run in a node's engine Python.

    python -m lorafleet_trainer job.json            # the trainer
    python -m lorafleet_trainer.standin job.json    # a stand-in (tests, dry runs)

The agent copies this package into the job directory and runs it there, as
the engines' user, with the job directory as its working directory. It
imports only the standard library and, once the job file parses, torch,
transformers (and its huggingface_hub), peft, accelerate and safetensors:
never lorafleet's other packages or msgspec, which the engine's Python does
not have. Those import it instead, for the rules they share with it: the
job file (`jobfile`), the line protocol and exit codes (`protocol`), the
records' format (`records`), the checkpoint layout (`layout`) and the
parameters (`params`, generated from TrainerParams).
"""
