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
