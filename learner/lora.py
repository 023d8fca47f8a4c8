"""LoRA on the learner's policy (`learner.lora`): which layers get adapters, adding them, their weights as a sync
moves them, their checkpoint, and the merged model an export writes.

Owns: `lora_targets` and `whole_modules` (the module names `learner.lora.target_modules` and `modules_to_save` resolve
to, checked against the policy's layers), `check_lora` (those checks on the model's config alone), `add_adapters`
(peft's `get_peft_model`: the base frozen), `adapter_weights` (the adapters and whole modules by peft's saved names,
which the engines load), `save_adapters` / `load_adapters` (a checkpoint's `policy/`, in peft's format) and
`merge_adapters` (one Hugging Face model, `relay export --merge`).
Does not own: training (learner/learner.py), how adapters reach the engines (sync/, actors/engine.py, which writes
what it receives as a peft directory for vLLM) or the config (learner/config.py). Imports torch, transformers,
peft and sync/.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from learner.config import LoraConfig

from sync.adapters import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

ALL_LINEAR = "all-linear"
# A decoder block's module path: `model.layers.<i>.` (Llama, Qwen2, Mistral and their kin, as vLLM names them too).
_BLOCK = re.compile(r"(^|\.)layers\.\d+\.")


def linear_layers(model: torch.nn.Module) -> set[str]:
    """The names (last path component) of the linear layers inside the model's decoder blocks: what vLLM serves LoRA
    on (attention and MLP projections; not the embedding or the output head), and `all-linear`'s meaning."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and _BLOCK.search(name)}


def lora_targets(model: torch.nn.Module, target_modules: str | list[str]) -> list[str]:
    """`learner.lora.target_modules` as the sorted module names that get adapters; ValueError (one line) for a name
    that matches no linear layer of the decoder blocks."""
    linear = linear_layers(model)
    if not linear:
        raise ValueError(f"learner.lora: the policy ({type(model).__name__}) has no linear layers under "
                         "model.layers.<i>, so there is nothing LoRA can adapt; set learner.lora.rank=0")
    if target_modules == ALL_LINEAR:
        return sorted(linear)
    unknown = [name for name in target_modules if name not in linear]
    if unknown or not target_modules:
        raise ValueError(f"learner.lora.target_modules={list(target_modules)}: {', '.join(map(repr, unknown)) or '[]'} "
                         f"matches no linear layer of the policy's decoder blocks (vLLM serves LoRA on those only); "
                         f"use some of {', '.join(sorted(linear))}, or all-linear")
    return sorted(set(target_modules))


def whole_modules(model: torch.nn.Module, names: list[str]) -> list[str]:
    """`learner.lora.modules_to_save`, checked: each the exact path of a layer of the policy outside its decoder
    blocks (weights of its own, no sub-layers with weights) that shares no weight with another (tied embeddings);
    ValueError (one line) otherwise."""
    modules = dict(model.named_modules())
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))

    def layer(module: torch.nn.Module) -> bool:
        own = list(module.parameters(recurse=False))
        return bool(own) and len(own) == len(list(module.parameters()))

    for name in names:
        module = modules.get(name)
        if module is None or _BLOCK.search(f"{name}.") or not layer(module):
            outside = sorted(n for n, m in modules.items() if n and not _BLOCK.search(f"{n}.") and layer(m))
            raise ValueError(f"learner.lora.modules_to_save: {name!r} is not a layer with weights outside the "
                             f"policy's decoder blocks; use some of {', '.join(outside)}")
        if any(uses[id(p)] > 1 for p in module.parameters()):
            raise ValueError(f"learner.lora.modules_to_save: {name!r} shares its weights with another layer (tied "
                             "embeddings), which the engines cannot load apart; remove it")
    return sorted(set(names))


def check_lora(config: LoraConfig, model_config: Any) -> list[str]:
    """`lora_targets` of a policy with this transformers config, built on the meta device (no weights: the driver
    checks before anything starts), after `whole_modules`' check; ValueError as they raise."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    whole_modules(model, config.modules_to_save)
    return lora_targets(model, config.target_modules)


def add_adapters(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """`model` wrapped by peft with adapters on `lora_targets` (A random, B zero: the policy starts as the base),
    everything else frozen. The adapters take the base's parameter dtype (the learner's master dtype)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(r=config.rank, lora_alpha=config.scale_alpha, lora_dropout=config.dropout,
                                 target_modules=lora_targets(model, config.target_modules), bias="none",
                                 task_type="CAUSAL_LM",
                                 modules_to_save=whole_modules(model, config.modules_to_save) or None)
    return get_peft_model(model, peft_config)


def adapter_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights by the names of peft's saved format (`base_model.model.<path>.lora_A.weight`), and the
    trained copies of the whole modules (`base_model.model.<path>.weight`): views of the live parameters, no copy."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, save_embedding_layers=False)


@contextlib.contextmanager
def adapter_dropout(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """With `enabled`, the adapters' dropout on (`learner.lora.dropout`) for the training passes: the learner keeps
    its policy in eval mode otherwise, so that old logprobs, the reference and the engines see it without dropout."""
    layers = [m for name, m in model.named_modules()
              if isinstance(m, torch.nn.Dropout) and ".lora_dropout." in f".{name}."] if enabled else []
    for layer in layers:
        layer.train()
    try:
        yield
    finally:
        for layer in layers:
            layer.eval()


def save_adapters(model: torch.nn.Module, directory: str | os.PathLike, weights: dict[str, torch.Tensor]) -> None:
    """`weights` (`adapter_weights`' names) and the adapters' config as a peft directory, which
    `PeftModel.from_pretrained`, `load_adapters` and vLLM load."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].save_pretrained(str(directory))
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in weights.items()},
              str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})


def read_adapters(model: torch.nn.Module, directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The adapter weights a `save_adapters` directory holds, checked against `model`'s adapters (the same names and
    shapes; ValueError naming the directory otherwise), in the adapters' dtype."""
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"{directory} holds no LoRA adapters ({ADAPTER_WEIGHTS_FILE}); resume with the "
                         "checkpoint's learner.lora settings")
    saved = load_file(str(path))
    own = adapter_weights(model)
    if saved.keys() != own.keys() or any(saved[k].shape != own[k].shape for k in own):
        raise ValueError(f"{directory}: its adapters (rank, target modules) are not this run's learner.lora; resume "
                         "with the checkpoint's learner.lora settings")
    return {name: saved[name].to(own[name].dtype) for name in own}


def load_adapters(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy `adapter_weights`-named tensors into the model's adapters in place."""
    own = adapter_weights(model)
    with torch.no_grad():
        for name, tensor in weights.items():
            own[name].copy_(tensor)


def merge_adapters(base_path: str, adapter_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str) -> None:
    """The base model at `base_path` with the adapters of `adapter_dir` merged into its weights (W + B A x
    alpha / r), saved as a Hugging Face directory in `dtype` with the base's tokenizer and generation files:
    transformers and vLLM load it as any model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from learner.critic import save_model_dir

    # Merged in float32, then cast: bfloat16 sums would round the small update away.
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir), dtype=torch.float32).merge_and_unload()
    target = getattr(torch, dtype)
    save_model_dir(merged.to(target), base_path, out_dir)


def base_model_path(adapter_dir: str | os.PathLike) -> str:
    """The base model a `save_adapters` directory was trained on (its config's `base_model_name_or_path`)."""
    return json.loads((Path(adapter_dir) / ADAPTER_CONFIG_FILE).read_text())["base_model_name_or_path"]
