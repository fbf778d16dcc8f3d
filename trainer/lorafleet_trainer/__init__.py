"""lorafleet's LoRA trainer: its own program, run in a node's engine Python.

    python -m lorafleet_trainer job.json            # the trainer
    python -m lorafleet_trainer.standin job.json    # a stand-in (tests, dry runs)

It imports only the standard library and, once the job file parses, torch,
transformers, peft, accelerate and safetensors: never lorafleet's other
packages or msgspec, which the engine's Python does not have. Those import
it instead, for the rules they share with it (trainer/DESIGN.md).
"""
