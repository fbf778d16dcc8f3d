"""Running lorafleet services as real processes in tests (so they can be SIGKILLed).

The class lives in the package (the embedded default runs its children the
same way); tests import it from here.
"""

from lorafleet_services.stack import START_TIMEOUT_S, ServiceProcess

__all__ = ["START_TIMEOUT_S", "ServiceProcess"]
