"""The trainer's environment on a node: the Python it runs in and the user
it runs as, and what runs in that Python besides training (GGUF conversion).

- protocol: `TrainerEnvironment`, what the agent asks of one;
- environments: the engine's and the stand-in's, and which one cfg asks for;
- overlay: peft and accelerate, pinned, beside the engine's own packages;
- engines_user: the Unix user the engines (and so the trainer) run as;
- setup_runs: helper programs run there with a clean environment;
- gguf_conversion: llama.cpp's converter, for a llama.cpp model's adapter.
"""

from lorafleet_services.agent.environment.engines_user import settle_user
from lorafleet_services.agent.environment.environments import (
    EngineEnvironment,
    StandinEnvironment,
    trainer_environment,
)
from lorafleet_services.agent.environment.gguf_conversion import (
    ConversionCancelledError,
    ConversionError,
    convert_to_gguf,
)
from lorafleet_services.agent.environment.overlay import ensure_overlay
from lorafleet_services.agent.environment.protocol import (
    ConversionRequest,
    TrainerEnvironment,
    TrainerSetupError,
)

__all__ = [
    "ConversionCancelledError",
    "ConversionError",
    "ConversionRequest",
    "EngineEnvironment",
    "StandinEnvironment",
    "TrainerEnvironment",
    "TrainerSetupError",
    "convert_to_gguf",
    "ensure_overlay",
    "settle_user",
    "trainer_environment",
]
