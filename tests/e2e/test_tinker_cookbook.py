"""tinker-cookbook's own `rl_loop` and `sl_loop` recipes (the installed package, unmodified, run as its README runs
them) train through `relay serve` with a local chat model and local data (bench/cookbook_recipes.py prepares them):
every step runs, rl_loop's steps with a signal train, sl_loop's loss falls, and each saves its final checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.cookbook_recipes import prepare, recipes  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = prepare(tmp_path_factory.mktemp("cookbook"))
    return root, recipes(root, steps=STEPS, batch=8, group=4, overrides=[])


def test_rl_loop_trains_through_relay_serve(records):
    root, runs = records
    rows = runs["rl_loop"]
    assert [row["step"] for row in rows] == list(range(STEPS))
    assert all(0.0 <= row["reward/total"] <= 1.0 for row in rows)
    # A step whose groups all scored alike is skipped by the recipe; the others ran forward_backward + optim_step,
    # whose metrics (the gradient's norm) the recipe logs.
    assert any(row.get("grad_norm", 0.0) > 0.0 for row in rows), rows
    final = [json.loads(line) for line in (root / "rl_loop" / "checkpoints.jsonl").read_text().splitlines()][-1]
    assert final["name"] == "final" and final["state_path"].startswith("tinker://")
    assert final["sampler_path"].startswith("tinker://")


def test_sl_loop_lowers_its_loss_through_relay_serve(records):
    root, runs = records
    rows = runs["sl_loop"]
    assert [row["step"] for row in rows] == list(range(STEPS))
    assert rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"] - 0.1, rows
    assert all(row["num_sequences"] == 8 for row in rows)
