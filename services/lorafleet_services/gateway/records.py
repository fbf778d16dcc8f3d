"""The training records' rules, as the gateway checks an uploaded file.

The one place the gateway imports them from: the rules move into the
trainer's package (`lorafleet_trainer.records`, issue 18), and switching
this import is all the gateway needs then.
"""

from lorafleet_services.recorder.data import DataError, validate

__all__ = ["DataError", "validate"]
