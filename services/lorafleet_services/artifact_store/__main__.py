"""`python -m lorafleet_services.artifact_store`: run the artifact-store."""

from lorafleet import runtime
from lorafleet_services.artifact_store.service import run

if __name__ == "__main__":
    runtime.main("artifact-store", run)
