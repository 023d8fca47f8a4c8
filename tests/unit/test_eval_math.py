"""Evaluation's pure parts: pass@k against hand-computed values, the metrics, the held-out split and its refusals."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest

from cluster.config import ConfigError, load_config
from cluster.demo.task import Problem
from cluster.run.data import ArithmeticPrompts, ChainSumPrompts, is_held_out, make_prompt_source
from cluster.run.evaluation import eval_metrics, eval_problems, eval_seeds, pass_at_k, reported_ks


def test_pass_at_k_is_chen_et_al_s_unbiased_estimator():
    # 1 - C(n - c, k) / C(n, k), by hand: n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25, abs=1e-15)  # pass@1 is the share that passes
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4), abs=1e-15)  # 1 - 35/210
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(3, 2, 2) == 1.0  # n - c < k
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(*bad)


def test_the_reported_k_are_powers_of_two_and_n():
    assert reported_ks(1) == [1] and reported_ks(4) == [1, 2, 4] and reported_ks(6) == [1, 2, 4, 6]


def test_eval_metrics_by_hand():
    rewards = [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.5]]  # prompt 1: 2 of 4 pass; prompt 2: none (0.5 < 1)
    metrics = eval_metrics(rewards, {"correct": [1, 0, 1, 0, 0, 0, 0, 0.5]}, [3, 4, 3, 4, 2, 2, 2, 2], 1.0)
    assert metrics["eval/reward/mean"] == pytest.approx(2.5 / 8)
    assert metrics["eval/reward/correct"] == pytest.approx(2.5 / 8)
    assert metrics["eval/response_length/mean"] == pytest.approx(22 / 8)
    assert metrics["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert metrics["eval/pass@2"] == pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2)) / 2)  # (1 - 1/6) / 2
    assert metrics["eval/pass@4"] == pytest.approx(0.5)
    assert metrics["eval/mean@4"] == pytest.approx((0.5 + 0.125) / 2)
    assert metrics["eval/prompts"] == 2.0
    assert eval_metrics(rewards, {}, [], 0.5)["eval/pass@4"] == 1.0  # the threshold decides what passes


def test_the_held_out_split_is_a_fixed_share_of_the_prompts():
    prompts = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    held = [p for p in prompts if is_held_out(p, 0.1)]
    assert 0.08 < len(held) / len(prompts) < 0.12
    assert not any(is_held_out(p, 0.0) for p in prompts)
    assert set(held) <= {p for p in prompts if is_held_out(p, 0.2)}  # a larger share holds the smaller one


def test_nothing_held_out_leaves_the_training_stream_as_it_was_and_a_share_is_never_drawn():
    config = load_config(None, ["data.prompts_per_step=64"])
    stream = ArithmeticPrompts(config.data, seed=3)
    expected = [p.prompt for b in range(3) for p in _draw_at_once(config.data, 3, b)]
    assert [p.prompt for _ in range(3) for p in stream.next_batch()] == expected
    held = load_config(None, ["data.prompts_per_step=64", "data.held_out=0.3"])
    drawn = [p.prompt for _ in range(20) for p in ArithmeticPrompts(held.data, seed=3).next_batch()]
    assert drawn and not any(is_held_out(p, 0.3) for p in drawn)
    chain = load_config(None, ["data.task=chain_sum", "data.held_out=0.3"])
    assert not any(is_held_out(p.prompt, 0.3) for p in ChainSumPrompts(chain.data, seed=0).next_batch())


def _draw_at_once(data, seed, cursor):
    """What `ArithmeticPrompts` drew before `data.held_out` existed: the whole batch from one rng at once."""
    from cluster.demo.task import make_problems

    rng = random.Random(f"relay-data:{seed}:{cursor}")
    return make_problems(rng, data.prompts_per_step, data.min_operand, data.max_operand)


def test_the_demo_evaluates_on_distinct_held_out_problems_training_never_draws():
    config = load_config(None, ["data.held_out=0.1", "eval.every=5", "eval.max_prompts=64"])
    training = make_prompt_source(config.data, 0, 32, None, 100)
    problems = eval_problems(config, None, training)
    assert len({p.prompt for p in problems}) == 64
    assert all(is_held_out(p.prompt, 0.1) and p.label == str(eval(p.prompt[:-1])) for p in problems)
    training.next_batch()
    assert problems == eval_problems(config, None, training)  # the same prompts every time, wherever training is
    assert eval_seeds(0, 4) == eval_seeds(0, 4) != eval_seeds(1, 4)


def test_an_evaluation_set_that_training_also_draws_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="data.held_out is 0"):
        load_config(None, ["eval.every=5"])
    same_task = load_config(None, ["eval.every=5", "eval.data.task=arithmetic"])
    with pytest.raises(ConfigError, match=r"eval.data: \d+ of the 128 evaluation prompts are training prompts too"):
        eval_problems(same_task, None, None)
    larger = load_config(None, ["eval.every=5", "eval.data.task=arithmetic", "eval.data.min_operand=100",
                                "eval.data.max_operand=999"])
    assert len(eval_problems(larger, None, None)) == 128  # other operands: nothing training draws
    assert eval_problems(same_task.model_copy(update={"eval": same_task.eval.model_copy(
        update={"disjoint": False})}), None, None)  # asked not to check

    rows = [{"prompt": f"{i}*{i}=", "label": str(i * i)} for i in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[15:] + [{"prompt": "99*99=",
                                                                                                "label": "9801"}]))
    dataset = ["data.task=dataset", f"data.path={tmp_path / 'train.jsonl'}", "eval.every=5",
               "eval.data.task=dataset", f"eval.data.path={tmp_path / 'test.jsonl'}"]
    config = load_config(None, dataset)
    training = make_prompt_source(config.data, 0, 4, None, 100)
    with pytest.raises(ConfigError, match="5 of the 6 evaluation prompts are training prompts too .*'15\\*15='"):
        eval_problems(config, None, training)
    split = load_config(None, [*dataset[:2], "data.held_out=0.5", "eval.every=5"])
    training = make_prompt_source(split.data, 0, 4, None, 100)
    held = eval_problems(split, None, training)  # the same file's held-out half: disjoint by construction
    assert held and {p.prompt for p in held}.isdisjoint(p.prompt for p in training.problems)
    assert len(held) + training.num_prompts == 20


def test_bad_evaluation_keys_get_one_line():
    with pytest.raises(ConfigError, match="eval.sources names 'judge', which is not in reward.sources"):
        load_config(None, ["data.held_out=0.1", "eval.every=5", "eval.sources=[judge]"])
    with pytest.raises(ConfigError, match="in-flight updates change an engine's weights during its requests"):
        load_config(None, ["data.held_out=0.1", "eval.every=5", "rollout.max_staleness=1",
                           "rollout.in_flight_updates=true"])
    with pytest.raises(ConfigError, match="eval.max_new_tokens"):
        load_config(None, ["data.held_out=0.1", "eval.every=5", "eval.max_new_tokens=100000"])


def evaluate_once(overrides: list[str], rewards: list[float]) -> dict[str, float]:
    """The metrics `Evaluation.collect` reports for one prompt whose completions got `rewards` (the Scorer's weighted
    sums), with the pool and the scorer stood in for."""
    from cluster.run.evaluation import Evaluation

    config = load_config(None, ["data.held_out=0.1", "eval.every=1", f"eval.num_samples={len(rewards)}", *overrides])
    pool = SimpleNamespace(dispatch=lambda *args, **kwargs: "batch",
                           collect=lambda batch: [[SimpleNamespace(response_ids=[1, 2]) for _ in rewards]])
    scorer = SimpleNamespace(score=lambda problems, groups: SimpleNamespace(rewards=[rewards], dropped=[False],
                                                                            per_source={}))
    evaluation = Evaluation(config, pool, scorer, [Problem("1+1=", "2")], ["1+1="])
    evaluation.dispatch(1, 1)
    return evaluation.collect()


def test_pass_threshold_is_a_share_of_full_marks_whatever_the_weights_sum_to():
    # Full marks: every evaluation source gives 1 (a verifier's), the reward its weighted sum.
    half = ["reward.sources={correct: {verifier: exact_match, weight: 0.5}}"]
    assert evaluate_once(half, [0.5, 0.0])["eval/pass@1"] == 0.5  # 0.5 is 0.5's full marks: one of two passes
    two = ["reward.sources={correct: {verifier: exact_match}, fmt: {verifier: format, weight: 0.2}}"]
    assert evaluate_once(two, [1.2, 1.0, 0.2, 0.0])["eval/pass@1"] == 0.25  # only 1.2 is full marks
    assert evaluate_once([*two, "eval.pass_threshold=0.8"], [1.2, 1.0, 0.2, 0.0])["eval/pass@1"] == 0.5  # >= 0.96
    assert evaluate_once([*two, "eval.sources=[correct]"], [1.0, 0.0])["eval/pass@1"] == 0.5  # fmt not evaluated
    # A source of negative weight (a penalty) scores full marks at 0: 1 - 0.5 x 0 is the best reward, 1.
    penalty = ["reward.sources={correct: {verifier: exact_match}, long: {verifier: format, weight: -0.5}}"]
    assert evaluate_once(penalty, [1.0, 0.5, 0.0])["eval/pass@1"] == pytest.approx(1 / 3)
    # Full marks summed in another order than the Scorer's (it adds remote sources first) differ in the last bit:
    # 0.1 + 0.2 + 0.7 = 1.0, 0.7 + 0.2 + 0.1 = 0.9999999999999999. Full marks still pass.
    thirds = ["reward.sources={x: {verifier: exact_match, weight: 0.1}, y: {verifier: format, weight: 0.2}, "
              "z: {verifier: exact_match, weight: 0.7}}"]
    assert evaluate_once(thirds, [0.0 + 0.7 + 0.2 + 0.1, 0.7 + 0.2])["eval/pass@1"] == 0.5


def test_full_marks_by_hand_and_none_is_refused_in_one_line():
    from cluster.run.evaluation import evaluation_inputs, full_marks

    config = load_config(None, ["data.held_out=0.1", "eval.every=1", "reward.steps.delimiter=' '",
                                "reward.sources={a: {verifier: exact_match, weight: 0.5}, b: {verifier: format, "
                                "weight: -2}, s: {verifier: step_match, level: steps, weight: 3}}"])
    assert full_marks(config) == 0.5  # a's 0.5; b's best is 0; s scores steps, not the evaluation reward
    refused = load_config(None, ["data.held_out=0.1", "eval.every=1",
                                 "reward.sources={a: {verifier: exact_match, weight: -1}}"])
    assert full_marks(refused) == 0.0
    training = make_prompt_source(refused.data, 0, 4, None, 100)
    with pytest.raises(ConfigError) as err:
        evaluation_inputs(refused, None, training)
    assert str(err.value).startswith("eval.pass_threshold") and "\n" not in str(err.value)


def test_a_run_evaluates_at_every_multiple_and_the_last_step():
    from cluster.run.evaluation import Evaluation

    config = load_config(None, ["data.held_out=0.1", "eval.every=3", "max_steps=7"])
    evaluation = Evaluation(config, SimpleNamespace(), SimpleNamespace(), [Problem("1+1=", "2")], ["1+1="])
    assert [s for s in range(1, 8) if evaluation.due(s)] == [3, 6, 7]


def test_an_evaluation_batch_is_split_evenly_whatever_the_workers_speeds():
    """Evaluation requests go to the workers in equal shares, in order (the same engine batches in `relay eval`), and
    the speeds that split training batches (`rollout.balance=speed`) do not decide them."""
    from cluster.fleet.rollout_pool import RolloutPool

    pool = RolloutPool.__new__(RolloutPool)
    pool.config = load_config(None, [])
    pool.fleet = SimpleNamespace(rollout=[SimpleNamespace(id=0), SimpleNamespace(id=1), SimpleNamespace(id=2)])
    pool.speeds = {0: 30.0, 1: 10.0, 2: 10.0}
    assert pool._shares(15) == [8, 4, 3]  # training: by speed (at least one each, largest remainders)
    assert pool._shares(15, even=True) == [5, 5, 5] and pool._shares(16, even=True) == [6, 5, 5]
