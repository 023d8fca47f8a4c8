"""The bad-input corpus: every user-facing input (config keys and values, CLI arguments, dataset files, model
paths, verifier specs and URLs) is checked before any actor starts or anything is built. Each case must end with exit
code 2, one line on stderr that names what is wrong (and how to fix it), no traceback, and nothing written to the
run directory; with an empty cache, nothing is built into it either (the demo model is built only for a valid run).

Runs `cluster.cli.main` in-process (the same code path as the `relay` binary, whose own exit codes
tests/e2e/test_cli.py checks) so that the corpus stays fast."""

from __future__ import annotations

import shutil

import pytest

from cluster.cli.commands import main

# (arguments after `relay`, text the one-line error must contain). `{tmp}` is the test's temporary directory, where
# the fixture below writes the bad files.
CORPUS = [
    # config keys and values
    (["train", "learner.lrr=1"], "unknown config key 'learner.lrr'; did you mean 'learner.lr'? allowed here:"),
    (["train", "nope=1"], "unknown config key 'nope'"),
    (["train", "learner.lr=abc"], "learner.lr: Input should be a valid number"),
    (["train", "rollout.num_workers=0"], "rollout.num_workers: Input should be greater than or equal to 1"),
    (["train", "learner.advantage=ppo"],
     "learner.advantage: Input should be 'grpo', 'rloo', 'reinforce_pp', 'gae', 'reinforce' or 'distill'"),
    (["train", "learner.advantage=gae"], "set critic.enabled=true"),
    (["train", "learner.kl_reward_coef=0.1"], "set one of them to 0"),
    (["train", "learner.num_minibatches=3"], "must divide the batch"),
    (["train", "reward.overlong_buffer=8"], "must be below rollout.max_new_tokens"),
    (["train", "learner.rollout_correction=icepop", "learner.rollout_correction_low=2",
      "learner.rollout_correction_high=1"], "rollout_correction_low (2) must be below learner.rollout_correction_high"),
    (["train", "learner.rollout_correction=seq_mask_tis", "learner.rollout_correction_low=1.01"],
     "must hold 1 between them"),
    (["train", "learner.rollout_correction=icepop", "learner.rollout_correction_level=sequence"],
     "rollout_correction=icepop defines its own level"),
    (["train", "learner.policy_loss=cispo", "learner.clip_c=3"], "not defined for policy_loss=cispo"),
    # CLI arguments and config files
    (["train", "max_steps=3", "learnerlr"], "override 'learnerlr' is not of the form dotted.key=value"),
    (["train", "max_steps=3", "--quiet", "learner.lrr=1"], "unknown config key 'learner.lrr'"),  # options anywhere
    (["train", "learner..lr=1"], "is not of the form dotted.key=value"),
    (["train", "{tmp}/missing.yaml"], "cannot read config file"),
    (["train", "{tmp}/broken.yaml"], "is not valid YAML"),
    (["train", "{tmp}/list.yaml"], "must hold a mapping of keys, not list"),
    (["train", "run_dir={tmp}/taken"], "already holds a run; pass a new run_dir=PATH"),
    # model paths
    (["train", "model.path={tmp}/nowhere"], "model.path '{tmp}/nowhere' is not a Hugging Face model directory"),
    (["train", "model.path={tmp}/list.yaml"], "is not a Hugging Face model directory"),
    # dataset files
    (["train", "data.task=dataset"], "data.task=dataset needs data.path"),
    (["train", "data.task=dataset", "data.path={tmp}/absent.jsonl"], "absent.jsonl"),
    (["train", "data.task=dataset", "data.path={tmp}/bad_json.jsonl"], "line 2"),
    (["train", "data.task=dataset", "data.path={tmp}/no_field.jsonl"], "prompt"),
    (["train", "data.task=dataset", "data.path={tmp}/data.csv"], "data.csv"),
    # reward sources: verifiers, reward models, URLs
    (["train", "reward.sources.c.verifier=nope"], "reward.sources.c: "),
    (["train", "reward.sources.c.verifier=no_such_module:score"], "no_such_module"),
    (["train", "reward.sources.c.verifier=format", "reward.sources.c.params.colour=1"], "colour"),
    (["train", "reward.sources.c.type=remote", "reward.sources.c.urls=[ftp://x]"], "is not of the form http(s)://"),
    (["train", "reward.sources.c.type=remote", "reward.sources.c.urls=[http://127.0.0.1:9]",
      "reward.sources.c.token_env=RELAY_TEST_UNSET_TOKEN"], "RELAY_TEST_UNSET_TOKEN"),
    (["train", "reward.sources.c.type=remote", "reward.sources.c.urls=[http://127.0.0.1:9]",
      "reward.sources.c.on_failure=default"], "on_failure=default needs default_reward"),
    (["train", "reward.sources.rm.type=model", "reward.sources.rm.path={tmp}/nowhere"], "reward.sources.rm.path"),
    (["train", "reward.sources.x.type=judge"], "reward.sources.x.type: must be one of rule, remote, model"),
    (["train", "reward.sources.Bad.verifier=exact_match"], "source name 'Bad' must be lower-case"),
    (["train", "reward.sources.mean.verifier=exact_match"], "would hide the metric reward/mean"),
    # evaluation: its prompts, and `relay eval`
    (["train", "eval.every=5"], "data.held_out is 0: set data.held_out"),
    (["train", "eval.every=5", "data.held_out=0.1", "eval.sources=[judge]"], "eval.sources names 'judge'"),
    (["train", "eval.every=5", "eval.data.task=arithmetic"], "evaluation prompts are training prompts too"),
    (["eval", "checkpoint={tmp}/nowhere"], "checkpoint {tmp}/nowhere does not exist"),
    (["eval", "eval.data.task=arithmetic"], "evaluation prompts are training prompts too"),
    # LoRA: targets (checked on the model's config: the demo's before it is built), combinations; `relay export`
    (["train", "learner.lora.rank=8", "learner.lora.target_modules=[q_proj,qproj]"],
     "'qproj' matches no linear layer of the policy's decoder blocks"),
    (["train", "learner.lora.rank=8", "learner.lora.target_modules=[lm_head]"], "'lm_head' matches no linear layer"),
    (["train", "learner.lora.rank=8", "sync.transport=collective"], "learner.lora with sync.transport=collective"),
    (["train", "learner.lora.rank=8", "reference.refresh_every=2"], "learner.lora with reference.refresh_every"),
    (["train", "learner.lora.alpha=16"], "apply with learner.lora.rank > 0"),
    (["train", "learner.lora.rank=600"], "learner.lora.rank: Input should be less than or equal to 512"),
    (["export", "{tmp}/nowhere", "--out", "{tmp}/exported"], "checkpoint {tmp}/nowhere does not exist"),
    # on-policy distillation: its teacher (with the policy's tokenizer) and its keys
    (["train", "learner.distill_coef=1", "teacher.path={tmp}/other_tokenizer"],
     "teacher.path '{tmp}/other_tokenizer' has another tokenizer than the policy's (2 of 19 tokens have other ids, "
     "e.g. '[' is absent in the policy's and 17 in the teacher's"),
    (["train", "learner.distill_coef=1", "teacher.path={tmp}/nowhere"], "is not a Hugging Face model directory"),
    (["train", "learner.distill_coef=1"], "learner.distill_coef > 0 needs a teacher: set teacher.path"),
    (["train", "teacher.path=demo"], "teacher.path is set but learner.distill_coef is 0"),
    (["train", "learner.advantage=distill", "teacher.path=demo"], "learner.advantage=distill trains on the teacher"),
    # Prometheus metrics (a taken port: tests/unit/test_prometheus_names.py, which holds one open)
    (["train", "logging.prometheus_port=70000"],
     "logging.prometheus_port: Input should be less than or equal to 65535"),
    (["train", "logging.prometheus_port=9464", "logging.prometheus_host=192.0.2.1"],  # TEST-NET-1: no machine's own
     "logging.prometheus_host=192.0.2.1 logging.prometheus_port=9464: cannot serve metrics there"),
    # other commands
    (["verifier", "serve", "--verifier", "nope"], "nope"),
    (["plot", "{tmp}/nowhere"], "nowhere"),
]


@pytest.fixture
def bad_files(tmp_path, monkeypatch):
    monkeypatch.delenv("RELAY_TEST_UNSET_TOKEN", raising=False)
    (tmp_path / "broken.yaml").write_text("learner: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "bad_json.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", \n')
    (tmp_path / "no_field.jsonl").write_text('{"question": "1+1=", "label": "2"}\n')
    (tmp_path / "data.csv").write_text("prompt,label\n1+1=,2\n")
    from cluster.demo.cache import shipped_demo_model

    shutil.copytree(shipped_demo_model("calc"), tmp_path / "other_tokenizer")  # the calc task's characters
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.yaml").write_text("max_steps: 1\n")
    return tmp_path


@pytest.mark.parametrize("cache", ["shared", "empty"])
@pytest.mark.parametrize("args, message", CORPUS, ids=[" ".join(a)[:60] for a, _ in CORPUS])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(bad_files, capsys, monkeypatch, tmp_path_factory, cache,
                                                        args, message):
    if cache == "empty":  # a fresh machine: the demo model is not built yet, and a bad input must not build it
        empty = tmp_path_factory.mktemp("empty-cache")
        monkeypatch.setenv("RELAY_CACHE_DIR", str(empty))
    tmp = str(bad_files)
    args = [a.replace("{tmp}", tmp) for a in args]
    if args[0] == "train" and not any(a.startswith("run_dir=") for a in args):
        args.append(f"run_dir={tmp}/run")
    before = sorted(p.relative_to(bad_files) for p in bad_files.rglob("*"))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("relay: "), err
    assert message.replace("{tmp}", tmp) in err and "Traceback" not in err
    assert sorted(p.relative_to(bad_files) for p in bad_files.rglob("*")) == before  # nothing written anywhere
    if cache == "empty":
        assert not any(empty.iterdir())  # nothing built
