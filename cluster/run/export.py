"""`relay export`: a checkpoint's policy as a standalone Hugging Face directory.

Owns: reading the checkpoint (complete, its config and its policy), writing the export into a directory of its own
(filled beside it, renamed into place: never half written under the asked name), and what each kind of checkpoint
exports: whole weights as they are; LoRA adapters merged into the base with `--merge` (a model transformers and
vLLM load as any other, `learner.lora.merge_adapters`), else the adapters in peft's format with the base's
tokenizer (for `PeftModel.from_pretrained`, or vLLM's LoRA serving on the base).
Does not own: the checkpoint layout (cluster/run/checkpoint.py) or the merge itself (learner/lora.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from cluster.config import ConfigError, load_config
from cluster.run import checkpoint
from sync.adapters import ADAPTER_CONFIG_FILE


def export_checkpoint(path: Path, out: Path, merge: bool, base: Path | None = None) -> str:
    """Write the policy of checkpoint `path` into `out` (which must not exist yet, or be empty); returns what was
    written, in words. `base`: the LoRA base model's directory, when the one the adapters name has moved. Raises
    ConfigError (one line, nothing written) on bad input."""
    try:
        checkpoint.validate(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty directory; pass a new directory")
    policy = path / checkpoint.POLICY_DIR
    lora = (policy / ADAPTER_CONFIG_FILE).is_file()
    dtype = load_config(path / checkpoint.CONFIG_FILE).model.dtype
    if lora:
        from learner.lora import base_model_path

        base = base or Path(base_model_path(policy))
        if not (base / "config.json").is_file():
            raise ConfigError(f"the adapters' base model {base} is not a model directory here; pass --base DIR (the "
                              "model the run trained, model.path)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        if lora and merge:
            from learner.lora import merge_adapters

            merge_adapters(str(base), policy, tmp, dtype)
            what = f"the base {base} with the checkpoint's LoRA adapters merged, in {dtype}"
        else:
            shutil.copytree(policy, tmp, dirs_exist_ok=True)
            what = "the checkpoint's whole weights" if not lora else "the checkpoint's LoRA adapters (peft format)"
            if lora:  # the base's tokenizer beside the adapters, as peft's own save_pretrained users ship them
                from learner.critic import SIDE_FILE_PATTERNS

                for pattern in SIDE_FILE_PATTERNS:
                    for side in base.glob(pattern):
                        if side.is_file():
                            shutil.copyfile(side, tmp / side.name)
            if merge:
                what += " (no adapters to merge: a full fine-tuning checkpoint)"
        tmp.chmod(0o755)  # mkdtemp's directory is its owner's alone
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return what
