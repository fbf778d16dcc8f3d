"""The node's own facts: its cards and their memory, the engines installed
on it, and the processes the agent starts and the leftovers it clears.

- cards: the node's GPUs (NVML) and the choice of one for a job;
- card_memory: a job's peak card memory, sampled while it trains;
- engine_load: how busy each running engine is (its /metrics or /slots);
- installed_engines: the vLLM and llama.cpp versions under the engines
  directory (what the heartbeat reports);
- leftovers: trainers and job directories a crashed agent left behind;
- process: child processes, run to the end or managed while they run.
"""

from lorafleet_services.agent.node.card_memory import MemorySampler
from lorafleet_services.agent.node.cards import CardChoice, NoCardError, choose_card, read_cards
from lorafleet_services.agent.node.installed_engines import find_engines, version_order
from lorafleet_services.agent.node.leftovers import kill_leftover_trainers, remove_job_dirs
from lorafleet_services.agent.node.process import ManagedProcess, ProcessResult, run_process

__all__ = [
    "CardChoice",
    "ManagedProcess",
    "MemorySampler",
    "NoCardError",
    "ProcessResult",
    "choose_card",
    "find_engines",
    "kill_leftover_trainers",
    "read_cards",
    "remove_job_dirs",
    "run_process",
    "version_order",
]
