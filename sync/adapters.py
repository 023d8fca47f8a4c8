"""LoRA adapters as they travel: peft's directory format, which the learner saves and vLLM loads.

Owns the file names and `adapter_config` (the `adapter_config.json` of adapters with given settings, the keys peft
writes and vLLM reads). Both ends import it: the learner (learner/lora.py) and the engines (actors/engine.py), which
write the adapters a sync hands them as such a directory. Imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def adapter_config(targets: Sequence[str], rank: int, alpha: float, base: str) -> dict:
    """The `adapter_config.json` of rank-`rank` LoRA adapters on the modules named `targets` of the model at `base`,
    scaled by alpha / rank, as peft writes it."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": list(targets), "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "base_model_name_or_path": base}
