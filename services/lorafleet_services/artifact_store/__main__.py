"""`python -m lorafleet_services.artifact_store`: run the artifact-store until SIGTERM."""

from lorafleet import _runtime as runtime
from lorafleet_services.artifact_store.service import PROGRAM

if __name__ == "__main__":
    runtime.main(PROGRAM)
