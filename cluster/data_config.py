"""The run config's sections about prompts: where the training prompts come from (`data`, with reasoning-gym's tasks)
and what the run evaluates on while it trains (`eval`).

Owns: `DataConfig`, `ReasoningGymConfig`, `EvalConfig` and their own checks; `cluster/config.py` composes them into
`RunConfig` (and checks them against the other sections). Imports nothing heavier than pydantic.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ReasoningGymDataset(_Section):
    weight: float = Field(1.0, gt=0, le=1_000_000)
    """Relative weight: each entry comes from this dataset with probability weight / (sum of the weights)."""
    config: dict[str, Any] = {}
    """The dataset's own settings, the fields of its config class in reasoning-gym (e.g. `{min_terms: 2, max_terms:
    3}` for `basic_arithmetic`); empty: its defaults. Unset `seed` and `size` follow `data.reasoning_gym`'s, as
    reasoning-gym's composite dataset sets them. Each entry's label records them (`config`), and the `reasoning_gym`
    verifier scores with the dataset so configured: several scorers read them (decimal_arithmetic's tolerance)."""


class ReasoningGymConfig(_Section):
    datasets: dict[str, ReasoningGymDataset] = {}
    """reasoning-gym datasets by their registered names (`basic_arithmetic`, `leg_counting`, ...), mixed by weight
    in reasoning-gym's composite dataset; needed with `data.task=reasoning_gym`. A name reasoning-gym does not know
    stops the run before anything starts, with the closest names."""
    size: int = Field(1000, ge=1, le=10_000_000)
    """Entries generated when the run starts (all at once, before any actor): the prompts of one epoch, cycled and
    shuffled like a dataset file's."""
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    """Seed reasoning-gym generates the entries from (the same seed, datasets and reasoning-gym version give the same
    entries); empty: the run's `seed`."""

    @model_validator(mode="after")
    def _names(self) -> ReasoningGymConfig:
        for name in self.datasets:
            if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name == "composite":
                raise ValueError(f"datasets: {name!r} is not a reasoning-gym dataset name (lower-case, like "
                                 "basic_arithmetic; list several names instead of 'composite')")
        return self


class DataConfig(_Section):
    task: Literal["arithmetic", "chain_sum", "calc", "dataset", "reasoning_gym"] = "arithmetic"
    """Prompt source: `arithmetic` draws `a+b=` prompts whose label is the sum; `chain_sum` draws `12+34+56=` prompts
    whose label is the partial sums, one step each, separated by single spaces (`46 102`); `dataset` reads
    `data.path`; `calc` draws `37*48=` prompts whose label is the product, for multi-turn episodes with the
    calculator tool (`env.spec: rewards.environments.examples:Calculator`); `reasoning_gym` generates
    `data.reasoning_gym`'s tasks (needs `pip install -e '.[reasoning-gym]'`), each labelled with its whole entry,
    and, unless `reward.sources` is given, scores them with the `reasoning_gym` verifier. With an empty `model.path`,
    `chain_sum` and `calc` run on their own demo models, the others on the arithmetic one."""
    reasoning_gym: ReasoningGymConfig = ReasoningGymConfig()
    """The reasoning-gym tasks of `task=reasoning_gym` (docs/verifiers.md, reasoning-gym)."""
    path: str | None = None
    """Prompt file for `task=dataset`: JSONL (`.jsonl`), Parquet (`.parquet`) or a Hugging Face `datasets`
    directory (written by `save_to_disk`)."""
    split: str = Field("train", min_length=1)
    """Split to read when `data.path` is a `datasets` directory holding several splits."""
    prompt_field: str = Field("prompt", min_length=1)
    """Row field holding the prompt: a string, or chat messages (a list of {role, content})."""
    label_field: str | None = "label"
    """Row field holding the label the verifiers compare with (any JSON value); empty: no label."""
    label_format: Literal["value", "json"] = "value"
    """`value`: a label is used as the file holds it; `json`: a label that is a string is JSON text and is decoded
    when the file loads (other values are kept), the lossless way to store labels of different shapes in Parquet or
    `datasets` columns, and a string label in JSONL (written as JSON text, so "42" stays a string), as `write_prompts`
    and the reasoning-gym export write them."""
    chat_template: bool = False
    """Wrap string prompts as one user message and apply the tokenizer's chat template (message prompts always
    get it)."""
    system_prompt: str | None = None
    """System message put before every prompt when the chat template is applied. With `task=reasoning_gym` it
    replaces reasoning-gym's instruction (a system message, or a prefix without the chat template): unset, that
    instruction is reasoning-gym's default system prompt, which asks for the answer in `<answer>` tags; `''`, none
    (with the chat template, an empty system message)."""
    tools: list[str] = []
    """Functions offered to a chat model as tools (`package.module:function`, typed, with a Google-style docstring):
    their JSON schemas go into the chat template (`tools=`) of every prompt it renders; run them with
    `env.spec: rewards.environments.tools:ToolEnvironment` and `env.params.tools` (docs/environments.md)."""
    max_prompt_tokens: int | None = Field(None, ge=1, le=1_048_576)
    """Longer prompts are skipped and counted (`data/filtered_prompts`); empty: `rollout.max_model_len -
    rollout.max_new_tokens`."""
    untokenizable: Literal["refuse", "filter"] = "refuse"
    """A dataset or reasoning-gym prompt the model's tokenizer cannot hold (its token ids decode to other text, spaces
    aside, or hold the unknown token): `refuse` stops before anything starts, naming the row and the character;
    `filter` skips it, counted in `data/filtered_prompts`."""
    shuffle: bool = True
    """Shuffle the dataset with `seed`, a new order each epoch."""
    min_operand: int = Field(0, ge=0, le=10**6)
    """Smallest operand of the arithmetic and chain_sum tasks (their demo models learned operands 0 to 99)."""
    max_operand: int = Field(99, ge=0, le=10**6)
    """Largest operand of the arithmetic and chain_sum tasks."""
    num_terms: int = Field(3, ge=2, le=8)
    """Terms of the chain_sum task (its demo model learned 3; its answers then fit `rollout.max_new_tokens=8`)."""
    prompts_per_step: int = Field(32, ge=1, le=1_000_000)
    """Prompts drawn per step (B); each gets `rollout.group_size` completions."""
    held_out: float = Field(0.0, ge=0, lt=1)
    """Share of the problems kept out of training for evaluation (`eval`): a problem is held out when a hash of its
    prompt text falls in this share, so the split is the same on every machine and for every seed. Training never
    draws a held-out problem (the demo tasks draw again; a dataset or reasoning-gym's entries skip it), and `eval`
    without its own `eval.data` evaluates on them. 0: nothing is held out (the training stream is what it was)."""
    replay_fraction: float = Field(0.0, ge=0, le=0.5)
    """Iterative GRPO's replay: the share of each step's batch made of past scored groups (prompt, completions,
    rewards, behaviour logprobs, the version that sampled them) drawn from a buffer, reproducibly, on top of the
    `prompts_per_step` fresh groups: round(prompts_per_step x f / (1 - f)) groups (e.g. 0.1 with 32 prompts: 4).
    Replayed groups are off-policy: an unset `learner.rollout_correction` becomes `tis`. 0 turns it off."""
    replay_buffer_size: int = Field(256, ge=1, le=1_000_000)
    """Groups the replay buffer keeps (the most recent fresh ones; older ones leave first)."""

    @model_validator(mode="after")
    def _operands_ordered(self) -> DataConfig:
        if self.min_operand > self.max_operand:
            raise ValueError(
                f"min_operand ({self.min_operand}) must not exceed max_operand ({self.max_operand}); swap them"
            )
        return self


class EvalConfig(_Section):
    every: int = Field(0, ge=0, le=10_000_000)
    """Evaluate every this many steps, and after the last step (0: never). The engines sample the evaluation prompts
    with the weights the step's update produced; it changes nothing the run trains on. Its metrics are in that step's
    record; with `rollout.max_staleness` >= 1 it overlaps the next update, and the record is written with the next
    step's (at a checkpoint or the last step at once; a stopped run writes it before it ends). `eval/step` names the
    weights' step."""
    data: DataConfig | None = None
    """Where the evaluation prompts come from, in any form `data` takes (a demo task, a dataset file or directory,
    reasoning-gym's tasks); only its source keys apply (`prompts_per_step`, replay and `held_out` do not). Empty: the
    training data's held-out problems (`data.held_out` > 0)."""
    max_prompts: int = Field(128, ge=1, le=1_000_000)
    """Evaluate on the first this many prompts (a dataset's in file order; a demo task's in a fixed order drawn from
    `seed`): the same prompts at every evaluation."""
    num_samples: int = Field(1, ge=1, le=1024)
    """Completions per prompt (n): `eval/pass@k` is reported for k = 1, 2, 4, ... up to n, and `eval/mean@n`."""
    temperature: float = Field(0.0, ge=0, le=10)
    """Sampling temperature of the evaluation; 0: greedy (then `num_samples` > 1 repeats the same completion)."""
    max_new_tokens: int | None = Field(None, ge=1, le=1_048_576)
    """Longest evaluation completion, in tokens; empty: `rollout.max_new_tokens`."""
    sources: list[str] | None = None
    """Reward sources (names in `reward.sources`) whose weighted sum is the evaluation reward, each also reported as
    `eval/reward/<name>`; empty: every training source. An episode's environment (`env`) always scores."""
    pass_threshold: float = 1.0
    """A completion passes (`eval/pass@k`) when its evaluation reward is at least this share of full marks: the reward
    when every evaluation source gives a verifier's full marks, 1 (0 for a source of negative weight), i.e. the sum of
    their positive weights. 1: full marks from every source, whatever the weights sum to."""
    disjoint: bool = True
    """Refuse evaluation prompts that training also draws (an `eval.data` overlapping `data`): the point of a held-out
    set. false: evaluate on them anyway."""
