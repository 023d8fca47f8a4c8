"""reasoning-gym as a task source and a verifier, against the real package: the prompt source of `data.task=
reasoning_gym` (reasoning-gym's composite dataset, seeded and resumable, prompts with the instruction, chat and plain),
labels kept whole through JSONL, Parquet and `datasets` directories (`data.label_format=json`), the export, the
`reasoning_gym` verifier scoring with each entry's own `score_answer`, the default reward source, and the one-line
errors: an unknown dataset, a missing package, a prompt the tokenizer cannot hold.
"""

from __future__ import annotations

import json
import sys

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec  # noqa: E402
from reasoning_gym.utils import SYSTEM_PROMPTS  # noqa: E402

from cluster.config import ConfigError, DataConfig, load_config  # noqa: E402
from cluster.run.data import PromptDataset, make_prompt_source  # noqa: E402
from cluster.run.prompt_format import DataError, write_prompts  # noqa: E402
from cluster.run.reasoning_gym import export, generate, main, reasoning_gym_prompts  # noqa: E402
from rewards.config import RuleSource  # noqa: E402
from rewards.registry import load_verifier  # noqa: E402
from tests.unit.test_datasets import READABLE_TEMPLATE, byte_tokenizer  # noqa: E402

MIX = {"leg_counting": {"weight": 2}, "spell_backward": {"weight": 1},
       "basic_arithmetic": {"weight": 1, "config": {"min_terms": 2, "max_terms": 3}}}
SHAPES = ["leg_counting", "knights_knaves", "graph_color", "word_sorting"]  # differently shaped answers and metadata


def rg_config(**changes) -> DataConfig:
    return DataConfig(**{"task": "reasoning_gym", "reasoning_gym": {"datasets": MIX, "size": 24},
                         "shuffle": True} | changes)


def source(config: DataConfig, seed: int = 0, batch_size: int = 5, tokenizer=None) -> PromptDataset:
    tokenizer = tokenizer or byte_tokenizer()
    return PromptDataset(config, seed, batch_size, tokenizer, 4096, reasoning_gym_prompts(config, seed, tokenizer),
                         "data.reasoning_gym")


def as_json(value):
    return json.loads(json.dumps(value))


def mixed_entries() -> list[dict]:
    """12 entries, three of each of four datasets whose answers and metadata differ in shape (a number, a sentence,
    None with a dict of int keys, a list of words; tuples and nested dicts in their metadata)."""
    return [reasoning_gym.create_dataset(name, size=3, seed=11)[i] for name in SHAPES for i in range(3)]


def correct_answer(entry: dict) -> str:
    """graph_color has no single answer (None): any valid colouring, e.g. the one it keeps in its metadata."""
    return entry["answer"] if entry["answer"] is not None else json.dumps(entry["metadata"]["possible_answer"])


# --- the prompt source --------------------------------------------------------------------------------------------


def test_the_prompt_source_is_reasoning_gyms_composite_dataset_seeded_and_resumable():
    config = rg_config()
    first = source(config)
    # The entries are reasoning-gym's own composite dataset's, with the run's seed.
    expected = CompositeDataset(CompositeConfig(size=24, seed=0, datasets=[
        DatasetSpec(name, spec["weight"], spec.get("config", {})) for name, spec in MIX.items()]))
    # Each labelled with its dataset's settings, which the verifier builds the dataset with to score it.
    assert [p.label for p in first.problems] == [
        {**expected[i], "config": MIX[expected[i]["metadata"]["source_dataset"]].get("config", {})} for i in range(24)]
    assert {p.label["metadata"]["source_dataset"] for p in first.problems} == set(MIX)
    batches = [first.next_batch() for _ in range(7)]  # 35 prompts: across an epoch boundary (24)
    assert [p.label for p in batches[0]] != [p.label for p in first.problems[:5]]  # shuffled
    again = source(config)
    assert [again.next_batch() for _ in range(7)] == batches  # deterministic
    resumed = source(config)
    resumed.load_state(json.loads(json.dumps(_after(source(config), 3).state())))
    assert [resumed.next_batch() for _ in range(4)] == batches[3:]  # resumable from the saved cursor
    other = source(config, seed=1)
    assert [p.label for p in other.problems] != [p.label for p in first.problems]
    # data.reasoning_gym.seed, when set, replaces the run's seed for the entries (not for the order).
    pinned = rg_config(reasoning_gym={"datasets": MIX, "size": 24, "seed": 0})
    assert [p.label for p in source(pinned, seed=1).problems] == [p.label for p in first.problems]
    assert source(config).metrics() == {"data/epoch": 0.0, "data/filtered_prompts": 0.0}


def _after(dataset: PromptDataset, batches: int) -> PromptDataset:
    for _ in range(batches):
        dataset.next_batch()
    return dataset


def test_prompts_carry_reasoning_gyms_instruction_as_a_prefix_or_a_system_message():
    plain = source(rg_config(shuffle=False))
    question = plain.problems[0].label["question"]
    assert plain.problems[0].prompt == SYSTEM_PROMPTS["default"].rstrip("\n") + "\n\n" + question
    assert "<answer>" in SYSTEM_PROMPTS["default"]

    chat_tokenizer = byte_tokenizer()
    chat_tokenizer.chat_template = READABLE_TEMPLATE
    chat = source(rg_config(shuffle=False, chat_template=True), tokenizer=chat_tokenizer)
    assert chat.problems[0].prompt == f"<system>{SYSTEM_PROMPTS['default']}\n<user>{question}\n<assistant>"

    # data.system_prompt replaces the instruction; an empty one leaves the question alone (plain).
    own = source(rg_config(shuffle=False, system_prompt="Answer in <answer></answer>."))
    assert own.problems[0].prompt == f"Answer in <answer></answer>.\n\n{question}"
    bare = source(rg_config(shuffle=False, system_prompt=""))
    assert bare.problems[0].prompt == question
    own_chat = source(rg_config(shuffle=False, chat_template=True, system_prompt="Be brief."), tokenizer=chat_tokenizer)
    assert own_chat.problems[0].prompt == f"<system>Be brief.\n<user>{question}\n<assistant>"
    # The engines get the token ids of exactly that text.
    assert chat_tokenizer.decode(chat.problems[0].prompt_ids.tolist()) == chat.problems[0].prompt


# --- labels through files -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet", "rows_dir"])
def test_twelve_mixed_labels_come_back_whole_from_every_format(tmp_path, name):
    entries = mixed_entries()
    path = tmp_path / name
    write_prompts(path, [{"prompt": f"{i}+{i}=", "label": entry} for i, entry in enumerate(entries)])
    read = PromptDataset(DataConfig(task="dataset", path=str(path), shuffle=False, label_format="json"), 0, 2,
                         byte_tokenizer(), 1000)
    labels = [p.label for p in read.problems]
    assert labels == [as_json(entry) for entry in entries]  # 12 of 12, JSON's own values (tuples read as lists)
    assert [p.prompt for p in read.problems] == [f"{i}+{i}=" for i in range(12)]
    # Each dataset scores a correct answer the same on the label read back as on the entry it generated.
    for entry, label in zip(entries, labels):
        score = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
        assert score(correct_answer(entry), label) == score(correct_answer(entry), entry) == 1.0
    if name != "rows.jsonl":  # without label_format=json the columnar label is the JSON text itself
        as_text = PromptDataset(DataConfig(task="dataset", path=str(path), shuffle=False), 0, 2, byte_tokenizer(), 1000)
        assert [json.loads(p.label) for p in as_text.problems] == labels


@pytest.mark.parametrize("name", ["rg.jsonl", "rg.parquet", "rg_dir"])
def test_an_export_trains_like_the_task_itself(tmp_path, name):
    config = rg_config(shuffle=False)
    assert export(config, 0, tmp_path / name) == 24
    exported = PromptDataset(DataConfig(task="dataset", path=str(tmp_path / name), shuffle=False,
                                        label_format="json"), 0, 5, byte_tokenizer(), 4096)
    task = source(config)
    assert [p.prompt for p in exported.problems] == [p.prompt for p in task.problems]
    assert [p.label for p in exported.problems] == [as_json(p.label) for p in task.problems]


def test_an_exported_chat_prompt_is_the_messages(tmp_path):
    assert export(rg_config(chat_template=True), 0, tmp_path / "chat.jsonl") == 24
    row = json.loads((tmp_path / "chat.jsonl").read_text().splitlines()[0])
    assert row["prompt"] == [{"role": "system", "content": SYSTEM_PROMPTS["default"]},
                             {"role": "user", "content": row["label"]["question"]}]


def test_a_dataset_whose_scorer_needs_tuples_is_not_exported(tmp_path, capsys):
    # arc_agi compares the answer board with its metadata's tuples: after JSON (lists) a correct answer scores 0.05.
    config = rg_config(reasoning_gym={"datasets": {"arc_agi": {}}, "size": 2})
    with pytest.raises(DataError, match=r"reasoning-gym dataset 'arc_agi' does not survive JSON: .* gives entry 0's "
                                        r"own answer 1.0 but 0.05 .*data.task=reasoning_gym"):
        export(config, 0, tmp_path / "arc.jsonl")
    assert not (tmp_path / "arc.jsonl").exists()
    # The task itself keeps the entries as generated, so the same answer scores 1.0 there.
    entry = source(config).problems[0].label
    assert load_verifier("reasoning_gym")(f"<answer>{entry['answer']}</answer>", entry) == 1.0
    # The export command: one line per outcome.
    assert main([str(tmp_path / "ok.jsonl"), "data.reasoning_gym.datasets.spell_backward.weight=1",
                 "data.reasoning_gym.size=3"]) == 0
    assert len((tmp_path / "ok.jsonl").read_text().splitlines()) == 3
    assert main([str(tmp_path / "x.jsonl"), "data.reasoning_gym.datasets.spell_backwards.weight=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean spell_backward" in err


# --- the verifier -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["leg_counting", "spell_backward", "word_sorting", "knights_knaves",
                                  "prime_factorization"])
def test_the_verifier_scores_with_the_entrys_own_score_answer(name):
    verifier = load_verifier("reasoning_gym")
    own = reasoning_gym.get_score_answer_fn(name)
    for entry in [{**reasoning_gym.create_dataset(name, size=2, seed=5)[i], "config": {"size": 2, "seed": 5}}
                  for i in range(2)]:
        answer = entry["answer"]
        assert verifier(f"Let me think.\n<answer>\n{answer}\n</answer>", entry) == 1.0  # right, in tags
        assert verifier(f"<answer>0</answer> then <answer>{answer}</answer>", entry) == 1.0  # the last pair counts
        assert verifier(answer, entry) == 0.0  # right but untagged: no answer
        assert verifier("<answer>17</answer>", entry) == own("17", entry) < 1.0  # wrong
        assert verifier(f"<answer>{answer}, {answer}</answer>", entry) == _score(own, f"{answer}, {answer}", entry)
        assert load_verifier("reasoning_gym", {"extract": "none"})(f" {answer}\n", entry) == 1.0
        assert load_verifier("reasoning_gym", {"tag": "final"})(f"<final>{answer}</final>", entry) == 1.0
    # prime_factorization's scorer raises on text it cannot parse: that answer is wrong (0.0), not a crash.
    assert verifier("<answer>many</answer>", entry) == 0.0


def _score(own, answer: str, entry: dict) -> float:
    """reasoning-gym's own score, or 0.0 where its scorer cannot read the answer (it raises)."""
    try:
        return own(answer, entry)
    except ValueError:
        return 0.0


# decimal_arithmetic's scorer accepts an answer within 10**-max_num_decimal_places of the entry's (default 3).
SIX_PLACES = {"decimal_arithmetic": {"weight": 1, "config": {"min_num_decimal_places": 6, "max_num_decimal_places": 6}}}


def _near_misses(entry: dict) -> list[str]:
    """The entry's answer, and answers off by 5e-7 (right to 6 places), 5e-4 (right to 3 only) and 0.5."""
    from decimal import Decimal

    return [entry["answer"], *(str(Decimal(entry["answer"]) + Decimal(off)) for off in ("5e-7", "5e-4", "0.5"))]


@pytest.mark.parametrize("exported", [False, True], ids=["task", "exported"])
def test_the_verifier_scores_with_the_runs_dataset_config(tmp_path, exported):
    config = rg_config(reasoning_gym={"datasets": SIX_PLACES, "size": 4})
    composite, entries = generate(config, 0)  # reasoning-gym's own datasets, configured as the run's
    if exported:
        export(config, 0, tmp_path / "rg.jsonl")
        labels = [p.label for p in PromptDataset(DataConfig(task="dataset", path=str(tmp_path / "rg.jsonl"),
                                                            shuffle=False, label_format="json"), 0, 2,
                                                 byte_tokenizer(), 4096).problems]
    else:
        labels = [p.label for p in source(config).problems]
    assert [label["config"] for label in labels] == [SIX_PLACES["decimal_arithmetic"]["config"]] * 4
    verifier = load_verifier("reasoning_gym")
    for entry, label in zip(entries, labels):
        scores = [verifier(f"<answer>{answer}</answer>", label) for answer in _near_misses(entry)]
        assert scores == [composite.score_answer(answer, entry) for answer in _near_misses(entry)]
        assert scores == [1.0, 1.0, 0.0, 0.0]  # the default config (1e-3) would give 5e-4 off 1.0


def test_a_label_without_its_config_is_refused_where_the_scorer_reads_it():
    verifier = load_verifier("reasoning_gym")
    bare = reasoning_gym.create_dataset("decimal_arithmetic", size=1, seed=0, max_num_decimal_places=6)[0]
    with pytest.raises(ValueError, match=r"^reasoning_gym: the label of a decimal_arithmetic entry does not record "
                                         r"its dataset's config, which its scorer reads; .*add \"config\"") as err:
        verifier(f"<answer>{bare['answer']}</answer>", bare)
    assert "\n" not in str(err.value)
    # Recorded, the entry scores as its dataset does; {} is reasoning-gym's defaults (1e-3 here).
    off = _near_misses(bare)[2]
    assert verifier(f"<answer>{off}</answer>", {**bare, "config": {"max_num_decimal_places": 6}}) == 0.0
    assert verifier(f"<answer>{off}</answer>", {**bare, "config": {}}) == 1.0
    # A scorer that reads nothing of its dataset (leg_counting's) needs no config.
    legs = reasoning_gym.create_dataset("leg_counting", size=1, seed=0)[0]
    assert verifier(f"<answer>{legs['answer']}</answer>", legs) == 1.0
    for settings, message in [({"max_num_decimal_places": 11}, "precision must be 2 or more higher"),
                              ({"places": 6}, "'places'"), ([6], "is not an object")]:
        with pytest.raises(ValueError, match=r"^reasoning_gym: the label's config for decimal_arithmetic .*"
                                             + message):
            verifier("<answer>1</answer>", {**bare, "config": settings})


def test_a_label_that_is_not_an_entry_is_a_clear_value_error():
    verifier = load_verifier("reasoning_gym")
    with pytest.raises(ValueError, match=r"^reasoning_gym: the label \"42\" is not a reasoning-gym entry .*question, "
                                         r"answer and metadata.source_dataset"):
        verifier("<answer>42</answer>", "42")
    entry = reasoning_gym.create_dataset("spell_backward", size=1, seed=0)[0]
    with pytest.raises(ValueError, match="JSON text of a reasoning-gym entry.*data.label_format=json"):
        verifier("<answer>x</answer>", json.dumps(entry))
    renamed = {**entry, "metadata": {**entry["metadata"], "source_dataset": "no_such_dataset"}}
    with pytest.raises(ValueError, match="'no_such_dataset' is not a dataset of the installed reasoning-gym"):
        verifier("<answer>x</answer>", renamed)
    broken = {"question": "Factor 12.", "answer": "twelve", "metadata": {"source_dataset": "prime_factorization"},
              "config": {}}
    with pytest.raises(ValueError, match="prime_factorization scorer fails on the label's own answer"):
        verifier("<answer>many</answer>", broken)
    for params, message in [({"extract": "json"}, "extract must be 'tag'"), ({"tag": "<answer>"}, "not a tag name"),
                            ({"tags": ["answer"]}, "does not accept parameter 'tags'")]:
        with pytest.raises(ValueError, match=message):
            load_verifier("reasoning_gym", params)


def test_the_reasoning_gym_task_is_scored_by_its_verifier_unless_sources_are_given():
    task = ["data.task=reasoning_gym", "data.reasoning_gym.datasets.leg_counting.weight=1"]
    assert load_config(None, task).reward.sources == {"correct": RuleSource(verifier="reasoning_gym")}
    given = load_config(None, [*task, "reward.sources.fmt.verifier=format", "reward.sources.fmt.params.tags=[answer]"])
    assert list(given.reward.sources) == ["fmt"]
    assert load_config(None).reward.sources == {"correct": RuleSource(verifier="exact_match")}


@pytest.mark.parametrize("overrides, message", [
    (["data.task=reasoning_gym"], "data.task=reasoning_gym needs data.reasoning_gym.datasets"),
    (["data.reasoning_gym.datasets.leg_counting.weight=1"], "data.reasoning_gym is read only with "
                                                            "data.task=reasoning_gym"),
    (["data.task=reasoning_gym", "data.reasoning_gym.datasets.Leg.weight=1"], "'Leg' is not a reasoning-gym dataset"),
    (["data.task=reasoning_gym", "data.reasoning_gym.datasets.leg_counting.weight=0"], "greater than 0"),
    (["data.task=reasoning_gym", "data.reasoning_gym.datasets.leg_counting.wieght=1"],
     "unknown config key 'data.reasoning_gym.datasets.leg_counting.wieght'; did you mean "
     "'data.reasoning_gym.datasets.leg_counting.weight'\\? allowed here: weight, config"),
    (["data.label_format=json"], "data.label_format applies to data.task=dataset"),
])
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


# --- one-line errors before anything starts -----------------------------------------------------------------------


@pytest.mark.parametrize("datasets, message", [
    ({"leg_countin": {}}, r"^data.reasoning_gym.datasets: reasoning-gym has no dataset 'leg_countin'; did you mean "
                          r"leg_counting"),
    ({"zzzz": {}}, r"has no dataset 'zzzz'; it has \d+, e.g. "),
    ({"leg_counting": {"config": {"min_animal": 1}}},
     r"^data.reasoning_gym.datasets.leg_counting.config: leg_counting has no setting 'min_animal'; its settings: "),
    ({"basic_arithmetic": {"config": {"min_terms": 0}}}, r"basic_arithmetic.config: min_terms must be positive$"),
])
def test_unknown_datasets_and_settings_are_one_line_data_errors(datasets, message):
    config = DataConfig(task="reasoning_gym", reasoning_gym={"datasets": datasets})
    with pytest.raises(DataError, match=message) as err:
        make_prompt_source(config, 0, 4, None, 100)
    assert "\n" not in str(err.value)


def test_a_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now raises ImportError
    hint = (r"reasoning-gym is not installed \(.*\); install it with pip install -e '\.\[reasoning-gym\]' in "
            r"relay's checkout \(or pip install reasoning-gym==0\.1\.25\)$")
    with pytest.raises(DataError, match=r"^data.task=reasoning_gym: " + hint) as err:
        make_prompt_source(rg_config(), 0, 4, None, 100)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^" + hint):
        load_verifier("reasoning_gym")  # when the run loads its reward sources, before any scoring


def test_prompts_the_demo_tokenizer_cannot_hold_are_refused_or_filtered():
    # The demo models' tokenizer has digits and + - * = only: reasoning-gym's English is refused, naming the entry.
    with pytest.raises(DataError, match=r"^data.reasoning_gym entry 0 \((leg_counting|spell_backward|basic_arithmetic)"
                                        r"\): the model tokenizer cannot hold the prompt: its token ids decode to "
                                        r"other text from character 0 \('G'\) on; .*data.untokenizable=filter"):
        make_prompt_source(rg_config(), 0, 4, None, 10_000)
    with pytest.raises(DataError, match="cannot hold any of the 24 prompts"):
        make_prompt_source(rg_config(untokenizable="filter"), 0, 4, None, 10_000)


def test_relay_imports_reasoning_gym_only_on_use():
    import subprocess

    code = ("import sys, cluster.config, cluster.run.data, rewards.registry, rewards.verifiers; "
            "print('reasoning_gym' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr[-2000:]
