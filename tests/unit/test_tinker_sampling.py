"""`relay serve`'s reading of the SDK's `sampling_params.stop` (cluster/tinker/sampling.py): a string, strings or token
ids, anything else refused with a user error (the SDK itself refuses a mixed list before sending it)."""

from __future__ import annotations

import pytest

from cluster.tinker.models import UserError
from cluster.tinker.sampling import stop_sequences


@pytest.mark.parametrize("stop, expected", [
    (None, ((), ())), ([], ((), ())), ("\n", (("\n",), ())), (["a", "bc"], (("a", "bc"), ())),
    ([3, 0], ((), (3, 0))),
])
def test_stop_is_strings_or_token_ids(stop, expected):
    assert stop_sequences(stop) == expected


@pytest.mark.parametrize("stop", [["+", 3], [""], [-1], [True], {"a": 1}, 7])
def test_anything_else_is_refused(stop):
    with pytest.raises(UserError, match="sampling_params.stop must be"):
        stop_sequences(stop)


def test_full_fine_tuning_only_where_the_config_trains_no_lora(tmp_path):
    from cluster.tinker.models import FULL, TrainingRuns, UserError
    from learner.config import LearnerConfig, LoraConfig

    def runs(lora: LoraConfig) -> TrainingRuns:
        return TrainingRuns("relay-demo", str(tmp_path), LearnerConfig(lora=lora), "float32", None, tmp_path)

    assert runs(LoraConfig()).check_new("relay-demo", None) == FULL
    assert runs(LoraConfig()).check_new("relay-demo", 8) == 8
    with pytest.raises(UserError, match="asks for full fine-tuning, which this server's config does not allow"):
        runs(LoraConfig(rank=16)).check_new("relay-demo", None)
    with pytest.raises(UserError, match="LoRA rank 129 is out of bounds"):
        runs(LoraConfig(rank=16)).check_new("relay-demo", 129)
