"""A trained adapter's `adapter_config.json` (PEFT's), read and checked once.

`PeftAdapterConfig.read(directory)` is the one parse: the file must be a
JSON object describing a LoRA adapter (`peft_type` LORA, the default) with
a whole positive rank `r`; anything else is an `AdapterConfigError` saying
so. Like vLLM's `PEFTHelper`, it keeps the fields lorafleet reads and
ignores the rest. What one engine's format cannot express is a method
beside the fields it reads: `llamacpp_refusals()` for the GGUF converter;
the vLLM preflight (serving/vllm_adapters.py) compares `rank`,
`target_modules` and `modules_to_save` with the running engine's flags.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet_trainer.layout import ADAPTER_CONFIG

#: PEFT settings llama.cpp's adapter format cannot express: it scales every
#: module by alpha / rank, so a GGUF made from these would silently differ.
LLAMACPP_CANNOT_EXPRESS = {
    "use_rslora": "rank-stabilised LoRA (scale alpha/sqrt(r))",
    "use_dora": "DoRA",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
}


class AdapterConfigError(ValueError):
    """adapter_config.json is missing, unreadable, or not a LoRA adapter's."""


@dataclass(frozen=True, slots=True)
class PeftAdapterConfig:
    """The fields of a LoRA adapter's adapter_config.json lorafleet reads."""

    rank: int
    #: Module names, the last part of each (PEFT may save full paths,
    #: `model.layers.0.mlp.down_proj`, as the trainer's adapters have them;
    #: vLLM and llama.cpp match the last part).
    target_modules: frozenset[str] = frozenset()
    modules_to_save: tuple[str, ...] = ()
    #: The settings in LLAMACPP_CANNOT_EXPRESS that are set (truthy).
    features: frozenset[str] = frozenset()

    @classmethod
    def read(cls, directory: Path) -> PeftAdapterConfig:
        """The adapter in `directory`'s config, or AdapterConfigError."""
        path = directory / ADAPTER_CONFIG
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise AdapterConfigError(
                f"{path} cannot be read ({e}); the trainer's output is not a PEFT adapter"
            ) from None
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: Any, where: str = ADAPTER_CONFIG) -> PeftAdapterConfig:
        if not isinstance(raw, Mapping):
            raise AdapterConfigError(f"{where} is not a JSON object")
        if raw.get("peft_type", "LORA") != "LORA":
            raise AdapterConfigError(
                f"the adapter is {raw.get('peft_type')}, not LoRA; lorafleet serves and "
                "converts only LoRA adapters"
            )
        rank = raw.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise AdapterConfigError(f"{where}: r (the rank) is {rank!r}, not a whole number >= 1")
        targets = raw.get("target_modules") or []
        if isinstance(targets, str):
            targets = [targets]
        return cls(
            rank=rank,
            target_modules=frozenset(str(t).rsplit(".", 1)[-1] for t in targets),
            modules_to_save=tuple(str(m) for m in raw.get("modules_to_save") or ()),
            features=frozenset(key for key in LLAMACPP_CANNOT_EXPRESS if raw.get(key)),
        )

    def llamacpp_refusals(self) -> list[str]:
        """What of this adapter llama.cpp's LoRA format cannot express (none: it converts)."""
        return [what for key, what in LLAMACPP_CANNOT_EXPRESS.items() if key in self.features]
