"""`python -m lorafleet_services.scheduler`: the scheduler process."""

from lorafleet import _runtime as runtime
from lorafleet_services.scheduler.service import PROGRAM

if __name__ == "__main__":
    runtime.main(PROGRAM)
