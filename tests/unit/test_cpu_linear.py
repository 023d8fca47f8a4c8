"""Which kernel a CPU engine's linear layers take (`rollout.cpu_linear`): decided before the engine starts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from actors.engine import EngineSettings, wants_torch_linear
from learner.device import SMALL_MODEL_PARAMETERS


def _model(tmp_path, parameters: int) -> str:
    save_file({"embed.weight": torch.zeros(parameters // 100, 100), "norm.weight": torch.zeros(parameters % 100)},
              str(tmp_path / "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("parameters,expected", [(SMALL_MODEL_PARAMETERS - 1, True), (SMALL_MODEL_PARAMETERS, False)])
def test_auto_takes_torch_linear_below_the_small_model_size_in_a_one_shard_engine_here(tmp_path, parameters,
                                                                                          expected):
    path = _model(tmp_path, parameters)
    assert wants_torch_linear(EngineSettings(model_path=path), in_process=True) is expected
    assert not wants_torch_linear(EngineSettings(model_path=path), in_process=False)
    assert not wants_torch_linear(EngineSettings(model_path=path, tensor_parallel_size=2), in_process=True)
    assert not wants_torch_linear(EngineSettings(model_path=str(tmp_path / "none")), in_process=True)  # size unknown


def test_an_explicit_kernel_is_taken_whatever_the_size_and_torch_needs_a_one_shard_engine_here(tmp_path):
    path = _model(tmp_path, 10 * SMALL_MODEL_PARAMETERS)
    assert wants_torch_linear(EngineSettings(model_path=path, cpu_linear="torch"), in_process=True)
    (tmp_path / "small").mkdir()
    small = _model(tmp_path / "small", 1000)
    assert not wants_torch_linear(EngineSettings(model_path=small, cpu_linear="onednn"), in_process=True)
    for settings, here in ((EngineSettings(model_path=path, cpu_linear="torch"), False),
                           (EngineSettings(model_path=path, cpu_linear="torch", tensor_parallel_size=2), True)):
        with pytest.raises(ValueError, match="rollout.cpu_linear=torch needs a one-shard engine"):
            wants_torch_linear(settings, in_process=here)
