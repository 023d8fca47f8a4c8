"""LoRA adapters as they travel: peft's directory format, which the learner saves and vLLM loads.

Owns the file names, `adapter_config` (the `adapter_config.json` of adapters with given settings, the keys peft
writes and vLLM reads) and `split_whole_modules` (the whole modules trained beside the adapters, peft's
`modules_to_save`, told apart from the adapters by their names). Both ends import it: the learner (learner/lora.py)
and the engines (actors/engine.py), which write the adapters a sync hands them as such a directory and load the whole
modules into the base. Imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's saved names: this, then the module's path in the base model


def adapter_config(targets: Sequence[str], rank: int, alpha: float, base: str) -> dict:
    """The `adapter_config.json` of rank-`rank` LoRA adapters on the modules named `targets` of the model at `base`,
    scaled by alpha / rank, as peft writes it."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": list(targets), "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "base_model_name_or_path": base}


def split_whole_modules(named_tensors: Iterable[tuple[str, Any]]) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """A LoRA sync's tensors (peft's saved names) as the adapters (`...lora_A.weight`, `...lora_B.weight`, by those
    names) and the whole modules trained beside them (`learner.lora.modules_to_save`), by the base model's own names
    (`lm_head.weight`, `model.norm.weight`): what a whole-weights load takes."""
    adapters: dict[str, Any] = {}
    whole: list[tuple[str, Any]] = []
    for name, tensor in named_tensors:
        if ".lora_A." in name or ".lora_B." in name:
            adapters[name] = tensor
        else:
            whole.append((name.removeprefix(PEFT_PREFIX), tensor))
    return adapters, whole
