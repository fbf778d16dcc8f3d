"""`python -m lorafleet_services.gateway`: run the gateway until SIGTERM."""

from lorafleet import _runtime as runtime
from lorafleet_services.gateway.service import PROGRAM

if __name__ == "__main__":
    runtime.main(PROGRAM)
