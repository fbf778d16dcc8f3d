"""The control plane's side of the trainer (lorafleet_trainer, its own package).

`generate.py` writes lorafleet_trainer/params.py from `TrainerParams`; the
trainer itself, which the agent copies into each job directory, is the
lorafleet_trainer package at the repository's trainer/ folder.
"""
