"""The generator of lorafleet_trainer/params.py (the trainer's parameters,
from `TrainerParams`): `python -m lorafleet_services.paramgen.generate`."""
