"""`python -m lorafleet_services.recorder`: run the recorder until SIGTERM."""

from lorafleet import _runtime as runtime
from lorafleet_services.recorder.service import PROGRAM

if __name__ == "__main__":
    runtime.main(PROGRAM)
