"""`python -m lorafleet_services.scheduler`: the scheduler process."""

from lorafleet import runtime
from lorafleet_services.scheduler.service import run

if __name__ == "__main__":
    runtime.main("scheduler", run)
