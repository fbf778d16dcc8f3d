"""A training job on the node, from its StartRequest to delivered artifacts.

- job_run: `JobRun`, the job's pipeline (fetch, train, convert, deliver);
- trainer_lines: the trainer's stdout lines, read as events;
- status_reports: the job's status reports, published in order;
- resume: a job started from a stored checkpoint or adapter.
"""

from lorafleet_services.agent.training.job_run import Delivered, JobRun, StopRequest
from lorafleet_services.agent.training.resume import ResumeFetchError, fetch_resume
from lorafleet_services.agent.training.status_reports import Reporter
from lorafleet_services.agent.training.trainer_lines import TrainerLines

__all__ = [
    "Delivered",
    "JobRun",
    "Reporter",
    "ResumeFetchError",
    "StopRequest",
    "TrainerLines",
    "fetch_resume",
]
