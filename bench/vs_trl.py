"""Side by side: Hugging Face TRL's `GRPOTrainer` and `relay train` on the same work, one after the other.

Usage: .venv/bin/python bench/vs_trl.py [--configs demo 25M] [--steps N] [--trl-threads 2] [dotted.key=value ...]
Needs relay's virtualenv (it reads relay's config defaults and builds the models). TRL is not a relay dependency: on
first use this script makes its own virtualenv, `.cache/vs_trl/venv`, with `trl==1.16.0` and the torch, transformers
and tokenizers versions relay's environment has (read with importlib.metadata), and reuses it while they match. The
TRL side runs in that venv as `python bench/vs_trl.py --trl-runner SPEC.json`; that code path imports only
torch, transformers, trl, datasets and the standard library (the venv has neither ray nor vllm nor relay).

Work (`--configs`), 32 prompts x G=8 completions per step, one optimizer step per batch:
- `demo` (80 steps): relay's built-in demo: its ~300K-parameter Qwen2 (`ensure_demo_model`), `a+b=` prompts,
  8 new tokens, exact-match reward. `relay train` gets no config file, only `max_steps` and `run_dir`.
- `25M` (6 steps, 13-25 s each on 2 idle cores): a random-init Qwen2 of relay's 25M shape (hidden 512, 8 layers,
  8 heads, 4 KV heads, intermediate 1536; `.cache/vs_trl/model-25M`, 128 positions), the same prompts, up to 64 new
  tokens; relay gets `model.path`, `rollout.max_new_tokens=64`, `rollout.max_model_len=128` and a
  `rollout.kv_cache_bytes` that holds a worker's whole share of the batch (the 64 MiB default fits the demo, not this).
Overrides after the options go to every relay run; the TRL side reads the same resolved config, and a key it cannot
mirror (another advantage, loss, dataset, reward...) stops the script before anything runs.

Same work on both sides, read from relay's resolved config (learner/config.py, actors/config.py, cluster/config.py):
- model and tokenizer: the same directory; float32 (`model.dtype`; TRL `bf16=False`, `use_cpu=True`);
- prompts: exactly the sequence relay draws (`ArithmeticPrompts`, seed `seed`, 32 per step), dumped to a JSON file and
  fed unshuffled (`shuffle_dataset=False`), so step k trains on the same 32 prompts on both sides;
- reward: exact match of the decoded completion (before `<eos>`, special tokens skipped) with the label: relay's
  `rewards.verifiers.exact_match`, re-implemented in the runner (two lines);
- sampling: `group_size` = `num_generations` (8), `max_new_tokens` = `max_completion_length`, temperature 1.0,
  top_p 1.0, no top-k; the learner's logprobs at the same temperature on both sides;
- advantage: GRPO, (r - group mean) / (Bessel-corrected group std + eps) (`scale_rewards="group"`);
- loss: PPO clipped ratio, clip `learner.clip_low`/`clip_high` = `epsilon`/`epsilon_high` (0.2); token-mean
  aggregation over the whole batch = `loss_type="dapo"`; KL in the loss, k3, coefficient `learner.kl_coef` = `beta`
  (0.01), against a frozen reference; no entropy bonus; one epoch, one minibatch (`num_iterations=1`), so both
  take the pre-update logprobs from the training forward itself, detached (ratio 1; relay's `single_update`);
- micro-batches: `per_device_train_batch_size` x gradient accumulation = 256, one optimizer step per batch; the
  per-device batch is the largest divisor of 256 within relay's `learner.micro_batch_size` and, at the batch's
  longest possible sequence, within `learner.max_tokens_per_micro_batch` (`trl_micro_batch`); TRL's reference
  forward uses the same batch (relay's has its own `reference.*` limits, the same by default);
- optimizer: AdamW with `learner.lr`, `betas`, `weight_decay` (eps 1e-8 both), clip at `max_grad_norm`, and relay's
  own warm-up `LambdaLR(min(1, (n + 1) / warmup_steps))` passed to TRL as `optimizers=` (TRL's built-in linear warm-up
  would start at lr 0, one step behind relay's);
- threads: TRL uses `--trl-threads` torch threads in one process (2 by default: relay's unset `learner.num_threads`
  for the 25M; for the demo's 0.3M policy relay's learner takes 1), data loading in-process;
- no dropout (Qwen2 has none; TRL `disable_dropout=True`); no logging or saving on the TRL side (`report_to="none"`,
  `save_strategy="no"`, `logging_strategy="no"`); TRL's gradient checkpointing (on by default) off, as relay does
  not recompute activations (`--trl-gradient-checkpointing` turns it back on: TRL's defaults, slower).
The runner checks that every TRL step got relay's prompts for that step and relay's learning rate, and stops if not.
Not the same, by design or because one side cannot express it:
- sampling: relay's vLLM engines (2 rollout workers x 1 thread, paged KV cache) draw with per-prompt seeds; TRL runs
  transformers `generate` (its default path, no vLLM) on all 256 sequences at once with torch's RNG: the same prompts,
  different samples, so the reward curves agree in distribution only;
- micro-batch shapes: relay sorts a batch's rows by length, cuts them into passes by its token budget and runs each
  pass's rows packed (their real tokens only, attention per row; `learner.pack_sequences`), each group's prompt once
  (`learner.share_prompts`); TRL pads the whole batch to its longest and cuts it in equal passes (see
  `trl_micro_batch`);
- relay's `sync` phase (weights to the engines, probe check) has no TRL counterpart (TRL samples from the trained
  model itself); relay's reference is a separate actor, TRL's a second model in the same process;
- the advantage's eps: relay 1e-6, TRL 1e-4 (hard-coded); with 0/1 rewards a non-constant group of 8 has std >= 0.35;
- step boundaries: relay's `time/step` is the driver's step; TRL's is from one `on_step_end` to the next (the data
  loader's fetch of the next 32 prompts included), step 1 from its `on_step_begin`;
- relay runs a driver, 2 rollout workers, a reference worker, a learner and Ray's own processes on the same cores.
Columns: median s/step and median phase seconds skip step 1 (one-off costs). TRL's phases wrap methods of the trainer:
generate = `_generate` (tokenize, `generate`, decode), score = `_calculate_rewards`, reference =
`_get_per_token_logps_and_entropies` on the reference model, rest = the step minus those (loss forward, backward,
optimizer, advantages, data loading). Reward: the mean reward of the step's 256 completions; "first >= 0.9" is the
first step whose 10-step running mean reaches 0.9. Wall clock: each side's process, start to end (Ray, engines, model
loading and imports included). The mean s/step (step 1 skipped) beside the median shows slow outliers. "Cores busy
elsewhere": what processes outside this bench used while each side ran (`OtherLoad`); above ~0.1 the timings are
noisy (TRL's 2 OpenMP threads spin-wait for a descheduled peer: a demo step went from 0.17 s to 10 s here beside one
busy process). The runs stay in `.cache/vs_trl/runs/` (relay's checkpoints are deleted: a benchmark run is never
resumed). On 2 idle cores the defaults take ~6 minutes (demo ~1.5, 25M ~4.5), plus ~3 minutes once for the venv.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CACHE = ROOT / ".cache" / "vs_trl"
VENV = CACHE / "venv"
TRL_VERSION = "1.16.0"
TRL_WHEELS = Path("/tmp/trl_dl")  # a local copy of the trl wheel, used as an extra pip source when present
PINNED = ["torch", "transformers", "tokenizers"]  # installed in TRL's venv at relay's versions
SHAPE_25M = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536}
POSITIONS_25M = 128  # the longest prompt ("99+99=", 6 tokens) + 64 new tokens, rounded up
DEFAULT_STEPS = {"demo": 80, "25M": 6}
RELAY_PHASES = ["generate", "score", "reference", "train", "sync"]
TRL_PHASES = ["generate", "score", "reference"]  # timed in the runner; the step's remainder is "rest"
WINDOW = 10  # steps per reward-curve point and per running mean
TARGET = 0.9  # the running-mean reward the "first >= 0.9" column looks for


# --- the relay side (relay's virtualenv) --------------------------------------------------------------------------


def set_cache_env() -> None:
    """Relay's model cache and vLLM's compile cache inside the checkout (git ignores `.cache/`), unless set."""
    os.environ.setdefault("RELAY_CACHE_DIR", str(ROOT / ".cache" / "relay"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))


def machine() -> str:
    """The line every bench prints: architecture, cores, Python."""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def machine_jiffies() -> tuple[int, int]:
    """Busy and total CPU time of the machine so far, in clock ticks summed over cores (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # idle and iowait are not busy


def tree_jiffies(root: int) -> dict[int, tuple[int, int]]:
    """Process `root` and each of its living descendants, by pid: (parent pid, the CPU ticks of the process itself,
    its threads' included: user + system), from /proc. Reaped children's time (cutime, cstime) is left out: Ray's
    processes are not always reaped by the parent that started them, so it cannot be matched to what was seen."""
    parent, cpu = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:  # the process ended meanwhile
            continue
        parent[int(entry.name)], cpu[int(entry.name)] = int(fields[1]), int(fields[11]) + int(fields[12])
    tree, grown = {root}, True
    while grown:
        found = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree, grown = tree | found, bool(found)
    return {pid: (parent[pid], cpu[pid]) for pid in tree}


class OtherLoad:
    """Cores that processes outside this bench's process tree keep busy while it is entered: the machine's busy time
    minus this process's and its descendants', sampled every `period` seconds in a thread (nan without /proc).
    TRL's OpenMP threads spin-wait for a descheduled peer, so a core busy elsewhere can slow its steps many-fold."""

    def __init__(self, period: float = 1.0) -> None:
        self.period = period
        self.others = self.total = 0  # ticks, summed over cores
        self.failed = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def __enter__(self) -> OtherLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def cores(self) -> float:
        if self.failed or not self.total:
            return float("nan")
        return max(0, self.others) / self.total * (os.cpu_count() or 1)

    def sample(self) -> None:
        try:
            (busy, total), tree = machine_jiffies(), tree_jiffies(os.getpid())
            while not self.done.wait(self.period):
                (busy_now, total_now), tree_now = machine_jiffies(), tree_jiffies(os.getpid())
                # A process started since counts whole; one that ended since loses its last period's ticks to
                # "others" (at most `period` of it, against a whole lifetime when reaped time was matched).
                ours = sum(ticks - tree.get(pid, (0, 0))[1] for pid, (_, ticks) in tree_now.items())
                self.others += busy_now - busy - ours
                self.total += total_now - total
                (busy, total), tree = (busy_now, total_now), tree_now
        except OSError:  # no /proc (not Linux)
            self.failed = True


def installed_versions(python: Path, names: list[str]) -> dict[str, str | None]:
    """Versions of `names` in the environment of `python` (None where missing), read with importlib.metadata."""
    code = ("import importlib.metadata as m, json, sys\n"
            "def v(n):\n    try:\n        return m.version(n)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({n: v(n) for n in sys.argv[1:]}))")
    out = subprocess.run([str(python), "-c", code, *names], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def ensure_trl_venv() -> Path:
    """The TRL venv's python, made or updated so it holds trl==1.16.0 and relay's torch/transformers/tokenizers."""
    import importlib.metadata

    wanted = {"trl": TRL_VERSION, **{name: importlib.metadata.version(name) for name in PINNED}}
    python = VENV / "bin" / "python"
    if python.exists() and installed_versions(python, list(wanted)) == wanted:
        return python
    if not python.exists():
        interpreter = shutil.which("python3.11") or sys.executable
        print(f"vs_trl: creating {VENV} with {interpreter} (once)", file=sys.stderr, flush=True)
        subprocess.run([interpreter, "-m", "venv", str(VENV)], check=True)
    print(f"vs_trl: installing {', '.join(f'{n}=={v}' for n, v in wanted.items())} into {VENV}", file=sys.stderr,
          flush=True)
    extra = ["--find-links", str(TRL_WHEELS)] if TRL_WHEELS.is_dir() else []
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *extra,
                    *[f"{n}=={v}" for n, v in wanted.items()]], check=True)
    found = installed_versions(python, list(wanted))
    if found != wanted:
        raise SystemExit(f"vs_trl: {VENV} holds {found}, not {wanted}; delete {VENV} and run again")
    return python


def model_25m_dir() -> Path:
    """A random-init Qwen2 of relay's 25M shape with the demo's character tokenizer, built once."""
    from cluster.demo.model import make_random_model_dir

    path = CACHE / "model-25M"
    if not path.exists():
        make_random_model_dir(path, seed=0, max_position_embeddings=POSITIONS_25M, **SHAPE_25M)
    return path


def kv_cache_bytes_25m(prompts: int, group_size: int, workers: int, max_model_len: int) -> int:
    """KV-cache bytes that hold one worker's share of a step at full length (float32, 32-token blocks), +25%."""
    head_dim = SHAPE_25M["hidden_size"] // SHAPE_25M["num_heads"]
    per_token = 2 * SHAPE_25M["num_layers"] * SHAPE_25M["num_kv_heads"] * head_dim * 4  # K and V, float32
    sequences = -(-prompts * group_size // workers)
    return int(sequences * max_model_len * per_token * 1.25)


def relay_overrides(work: str, steps: int, extra: list[str]) -> tuple[Path, list[str]]:
    """The model directory and the `relay train` overrides of one configuration (run_dir excluded)."""
    from cluster.config import load_config
    from cluster.demo.cache import ensure_demo_model

    base = [f"max_steps={steps}", *extra]
    if work == "demo":
        return ensure_demo_model(log=lambda line: print(f"vs_trl: {line}", file=sys.stderr)), base
    base_config = load_config(None, base)
    kv_bytes = kv_cache_bytes_25m(base_config.data.prompts_per_step, base_config.rollout.group_size,
                                  base_config.rollout.num_workers, POSITIONS_25M)
    path = model_25m_dir()
    return path, [f"model.path={path}", "rollout.max_new_tokens=64", f"rollout.max_model_len={POSITIONS_25M}",
                  f"rollout.kv_cache_bytes={kv_bytes}", *base]


def check_mirrorable(config: Any) -> None:
    """Stop (one line) if the relay config sets something the TRL runner does not reproduce."""
    lc, ro, rc = config.learner, config.rollout, config.reward
    sources = {name: (s.type, getattr(s, "verifier", None), getattr(s, "params", None), s.weight)
               for name, s in rc.sources.items()}
    required = [
        ("data.task", config.data.task, "arithmetic"), ("model.dtype", config.model.dtype, "float32"),
        ("reward.sources", list(sources.values()), [("rule", "exact_match", {}, 1.0)]),
        ("reward.overlong_buffer", rc.overlong_buffer, 0), ("rollout.dynamic_sampling", ro.dynamic_sampling, False),
        ("learner.advantage", lc.advantage, "grpo"), ("learner.group_scale", lc.group_scale, "std"),
        ("learner.policy_loss", lc.policy_loss, "ppo"), ("learner.loss_agg", lc.loss_agg, "token-mean"),
        ("learner.clip_c", lc.clip_c, None), ("learner.kl_estimator", lc.kl_estimator, "k3"),
        ("learner.kl_reward_coef", lc.kl_reward_coef, 0.0), ("learner.entropy_coef", lc.entropy_coef, 0.0),
        ("learner.ppo_epochs", lc.ppo_epochs, 1), ("learner.num_minibatches", lc.num_minibatches, 1),
        ("learner.rollout_correction", lc.rollout_correction, "none"), ("learner.num_ranks", lc.num_ranks, 1),
        ("learner.master_dtype", lc.master_dtype, "float32"),
        ("rollout.group_size >= 2 (TRL needs it)", ro.group_size >= 2, True),
    ]
    for key, value, needed in required:
        if value != needed:
            raise SystemExit(f"vs_trl: {key}={value!r} has no TRL counterpart in this bench; use {needed!r}")


def draw_prompts(config: Any, steps: int) -> list[dict[str, str]]:
    """The prompts relay's run draws, step after step, as [{prompt, label}] (steps x prompts_per_step rows)."""
    from cluster.run.data import ArithmeticPrompts

    source = ArithmeticPrompts(config.data, config.seed, config.data.prompts_per_step)
    return [{"prompt": p.prompt, "label": str(p.label)} for _ in range(steps) for p in source.next_batch()]


def trl_micro_batch(section: Any, batch: int, width: int) -> int:
    """TRL's per-device batch for relay's micro-batch limits of `section` (the learner's): the largest divisor of the
    batch within `micro_batch_size` and whose passes, `width` tokens wide, stay within `max_tokens_per_micro_batch`
    (each unset: no limit). TRL pads the whole batch to its longest sequence, so `width` is the longest prompt +
    `max_new_tokens`; relay pads each pass to its own longest, so its passes hold more sequences when most are short."""
    cap = section.micro_batch_size or batch
    tokens = getattr(section, "max_tokens_per_micro_batch", None)
    if tokens:
        cap = min(cap, max(1, tokens // width))
    return max(size for size in range(1, batch + 1) if batch % size == 0 and size <= cap)


def trl_spec(config: Any, model_dir: Path, steps: int, threads: int, out: Path,
             micro_batch: int | None = None, checkpointing: bool = False) -> dict[str, Any]:
    """Everything the TRL runner needs, from relay's resolved config; writes the prompts file into `out`.
    `micro_batch`: TRL's per-device batch (a divisor of the batch), else `trl_micro_batch`'s; `checkpointing`: TRL's
    gradient checkpointing (its default; off here unless asked, as relay keeps activations)."""
    from transformers import AutoTokenizer

    lc, ro = config.learner, config.rollout
    prompts = draw_prompts(config, steps)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    width = max(len(ids) for ids in tokenizer([p["prompt"] for p in prompts])["input_ids"]) + ro.max_new_tokens
    batch = config.data.prompts_per_step * ro.group_size
    micro = micro_batch or trl_micro_batch(lc, batch, width)
    if batch % micro:
        raise SystemExit(f"--trl-micro-batch {micro} does not divide the batch of {batch} completions")
    prompts_file = out / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    return {
        "model_dir": str(model_dir), "prompts_file": str(prompts_file), "output_dir": str(out / "trainer"),
        "result_file": str(out / "result.json"), "steps": steps, "threads": threads, "seed": config.seed,
        "lr": lc.lr, "warmup_steps": lc.warmup_steps, "betas": list(lc.betas), "weight_decay": lc.weight_decay,
        "max_grad_norm": lc.max_grad_norm, "beta": lc.kl_coef, "epsilon": lc.clip_low, "epsilon_high": lc.clip_high,
        "temperature": ro.temperature, "top_p": ro.top_p, "num_generations": ro.group_size,
        "max_completion_length": ro.max_new_tokens, "micro_batch_size": micro, "grad_accum": batch // micro,
        "gradient_checkpointing": checkpointing,
    }


def run_logged(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, side: str) -> tuple[float, float]:
    """Run `cmd` with its output in `log`; returns its wall seconds and the cores other processes kept busy
    meanwhile (`OtherLoad`), or stops with the log's tail if it failed."""
    started = time.perf_counter()
    with log.open("w") as out, OtherLoad() as others:
        code = subprocess.run(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - started
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise SystemExit(f"{tail}\nvs_trl: the {side} side exited with code {code}; its whole log: {log}")
    return seconds, others.cores()


def run_relay(overrides: list[str], run_dir: Path) -> tuple[list[dict], float, float]:
    """`relay train` in its own process; returns the run's metrics records, the process's wall seconds and the cores
    busy elsewhere meanwhile."""
    from cluster.run.metrics import read_records

    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # a local Ray instance of its own, as `relay train` starts by default
    cmd = [sys.executable, "-m", "cluster.cli", "train", "--quiet", *overrides, f"run_dir={run_dir}"]
    seconds, others = run_logged(cmd, env, ROOT, run_dir.parent / "relay.log", "relay")
    records = read_records(run_dir / "metrics.jsonl")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # hundreds of MB at 25M; never resumed
    return records, seconds, others


def run_trl(python: Path, spec: dict[str, Any], out: Path) -> tuple[list[dict], float, float]:
    """The TRL runner in the TRL venv; returns its per-step records, the process's wall seconds and the cores busy
    elsewhere meanwhile."""
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    threads = str(spec["threads"])
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [str(python), str(Path(__file__).resolve()), "--trl-runner", str(spec_file)]
    seconds, others = run_logged(cmd, env, out, out / "trl.log", "TRL")
    return json.loads(Path(spec["result_file"]).read_text())["records"], seconds, others


# --- summaries ----------------------------------------------------------------------------------------------------


def measured(records: list[dict]) -> list[dict]:
    """The steps the medians use: all but step 1 (one-off costs), or step 1 alone if it is the only one."""
    return records[1:] if len(records) > 1 else records


def median_of(records: list[dict], key: str) -> float:
    """Median of `key` over the measured steps (a missing or null value counts as 0)."""
    return statistics.median(r.get(key) or 0.0 for r in measured(records))


def rest_seconds(record: dict) -> float:
    """TRL's step minus its timed phases: the loss forward, backward, optimizer and bookkeeping."""
    return record["time/step"] - sum(record.get(f"time/{p}", 0.0) for p in TRL_PHASES)


def reward_summary(records: list[dict]) -> str:
    """'first step whose 10-step running mean >= 0.9 (or never), last-10 mean'."""
    rewards = [r["reward/mean"] for r in records]
    first = next((k + 1 for k in range(WINDOW - 1, len(rewards))
                  if statistics.fmean(rewards[k - WINDOW + 1:k + 1]) >= TARGET), None)
    last = statistics.fmean(rewards[-WINDOW:])
    return f"{'step ' + str(first) if first else 'never'}, {last:.3f}"


def reward_curve(relay: list[dict], trl: list[dict]) -> list[str]:
    """Markdown rows: mean reward of each window of 10 steps, both sides."""
    rows = ["| steps | relay reward | TRL reward |", "|---|---|---|"]
    for start in range(0, max(len(relay), len(trl)), WINDOW):
        cells = [f"{statistics.fmean(r['reward/mean'] for r in side[start:start + WINDOW]):.3f}"
                 if side[start:start + WINDOW] else "" for side in (relay, trl)]
        rows.append(f"| {start + 1}-{min(start + WINDOW, max(len(relay), len(trl)))} | {cells[0]} | {cells[1]} |")
    return rows


def table_row(work: str, relay: list[dict], trl: list[dict]) -> str:
    """One row of the main table."""
    relay_step, trl_step = median_of(relay, "time/step"), median_of(trl, "time/step")
    relay_phases = " / ".join(f"{median_of(relay, f'time/{p}'):.2f}" for p in RELAY_PHASES)
    trl_rest = statistics.median(rest_seconds(r) for r in measured(trl))
    trl_phases = " / ".join([*(f"{median_of(trl, f'time/{p}'):.2f}" for p in TRL_PHASES), f"{trl_rest:.2f}"])
    return (f"| {work} | {relay_step:.3f} | {trl_step:.3f} | {relay_step / trl_step:.2f} | {relay_phases} | "
            f"{trl_phases} | {reward_summary(relay)} | {reward_summary(trl)} |")


def run_work(work: str, steps: int, threads: int, extra: list[str], trl_python: Path,
             trl_micro: int | None = None, checkpointing: bool = False) -> dict[str, Any]:
    """Both sides of one configuration, relay first; returns their records, wall seconds and the cores other
    processes kept busy during each side."""
    from cluster.config import load_config

    model_dir, overrides = relay_overrides(work, steps, extra)
    config = load_config(None, overrides)
    check_mirrorable(config)
    out = CACHE / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{work}"
    (out / "trl").mkdir(parents=True)
    spec = trl_spec(config, model_dir, steps, threads, out / "trl", trl_micro, checkpointing)
    print(f"vs_trl: {work}: relay, {steps} steps (log: {out / 'relay.log'})", file=sys.stderr, flush=True)
    relay, relay_wall, relay_busy = run_relay(overrides, out / "relay")
    print(f"vs_trl: {work}: TRL, {steps} steps (log: {out / 'trl' / 'trl.log'})", file=sys.stderr, flush=True)
    trl, trl_wall, trl_busy = run_trl(trl_python, spec, out / "trl")
    return {"work": work, "relay": relay, "trl": trl, "wall": {"relay": relay_wall, "trl": trl_wall},
            "busy": {"relay": relay_busy, "trl": trl_busy}, "dir": out, "trl_micro": spec["micro_batch_size"],
            "trl_checkpointing": checkpointing}


def report(results: list[dict[str, Any]]) -> None:
    """Print the main table, the wall clocks and each configuration's reward curve."""
    print(f"machine: {machine()}; medians skip step 1; phases in seconds")
    print("| work | relay s/step (median) | TRL s/step (median) | relay / TRL | relay phases (generate / score / "
          "reference / train / sync) | TRL phases (generate / score / reference / rest) | relay reward (first >=0.9 "
          "10-step mean, last-10 mean) | TRL reward (same) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(table_row(r["work"], r["relay"], r["trl"]))
    print()
    print("| work | steps | relay wall s | TRL wall s | relay / TRL s/step (mean) | relay / TRL completion tokens "
          "(mean) | cores busy elsewhere during relay / TRL |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        sides = (r["relay"], r["trl"])
        tokens = [statistics.fmean(x["response_length/mean"] for x in side) for side in sides]
        means = [statistics.fmean(x["time/step"] for x in measured(side)) for side in sides]
        print(f"| {r['work']} | {len(r['relay'])} | {r['wall']['relay']:.1f} | {r['wall']['trl']:.1f} | "
              f"{means[0]:.3f} / {means[1]:.3f} | {tokens[0]:.2f} / {tokens[1]:.2f} | "
              f"{r['busy']['relay']:.2f} / {r['busy']['trl']:.2f} |")
    for r in results:
        print(f"\nreward, {r['work']} (runs in {r['dir']}; TRL per-device batch {r['trl_micro']}, gradient "
              f"checkpointing {'on' if r['trl_checkpointing'] else 'off'})")
        print("\n".join(reward_curve(r["relay"], r["trl"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=list(DEFAULT_STEPS), default=list(DEFAULT_STEPS))
    parser.add_argument("--steps", type=int, help="steps of every configuration (default: demo 80, 25M 6)")
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    parser.add_argument("--trl-micro-batch", type=int, help="TRL's per_device_train_batch_size (default: the largest "
                        "divisor of the batch within relay's micro-batch limits, `trl_micro_batch`)")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="TRL recomputes activations in backward (its default; off unless given)")
    parser.add_argument("--trl-runner", metavar="SPEC.json", help=argparse.SUPPRESS)  # the TRL venv's entry point
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for every relay run (and mirrored by TRL)")
    args = parser.parse_args()
    if args.trl_runner:
        trl_main(Path(args.trl_runner))
        return
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    set_cache_env()
    trl_python = ensure_trl_venv()
    results = [run_work(work, args.steps or DEFAULT_STEPS[work], args.trl_threads, args.overrides, trl_python,
                       args.trl_micro_batch, args.trl_gradient_checkpointing)
               for work in args.configs]
    report(results)


# --- the TRL side (the TRL venv: torch, transformers, trl, datasets and the standard library only) ------------------


class PhaseClock:
    """Seconds per phase and per optimizer step of a `GRPOTrainer`, recorded with relay's metric names."""

    def __init__(self, prompts: list[str], per_step: int, group_size: int) -> None:
        self.prompts = prompts  # every step's prompts in order, `per_step` a step: what the reward checks it got
        self.per_step = per_step
        self.group_size = group_size
        self.records: list[dict[str, float]] = []
        self.current: dict[str, float] = {}  # phases and values of the step under way
        self.last_end: float | None = None

    def timed(self, owner: Any, name: str, phase: str, when: Callable[..., bool] | None = None) -> None:
        """Replace `owner.name` by a wrapper adding its wall time to `phase` (only calls for which `when` holds)."""
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if when is not None and not when(*args, **kwargs):
                return original(*args, **kwargs)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                key = f"time/{phase}"
                self.current[key] = self.current.get(key, 0.0) + time.perf_counter() - started

        setattr(owner, name, wrapper)

    def begin_step(self) -> None:
        """Step 1 starts at its `on_step_begin`; later steps at the previous step's end."""
        if self.last_end is None:
            self.last_end = time.perf_counter()

    def end_step(self) -> None:
        """Record the step that just ended (its phases, reward and seconds) and start the next one's clock."""
        now = time.perf_counter()
        record = {f"time/{p}": 0.0 for p in TRL_PHASES} | self.current
        self.records.append({"step": len(self.records) + 1, **record, "time/step": now - self.last_end})
        self.current, self.last_end = {}, now

    def exact_match(self, prompts: list[str], completions: list[str], label: list[str],
                    completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        """The reward: 1.0 iff the completion is exactly the label (relay's `exact_match`); notes the step's mean.

        Stops the run if the step's prompts are not the ones relay drew for it (each `num_generations` times)."""
        step = len(self.records)
        expected = self.prompts[step * self.per_step:(step + 1) * self.per_step] * self.group_size
        if sorted(prompts) != sorted(expected):
            raise RuntimeError(f"TRL step {step + 1} got other prompts than relay's step {step + 1}")
        rewards = [1.0 if completion == str(answer) else 0.0 for completion, answer in zip(completions, label)]
        self.current["reward/mean"] = statistics.fmean(rewards)
        self.current["response_length/mean"] = statistics.fmean(len(ids) for ids in completion_ids)
        return rewards


def make_trl_trainer(spec: dict[str, Any], rows: list[dict[str, str]], clock: PhaseClock) -> Any:
    """A `GRPOTrainer` set up as relay's run (see the module docstring), its phases and steps timed by `clock`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.begin_step()
            clock.current["lr"] = kwargs["optimizer"].param_groups[0]["lr"]  # checked against relay's in trl_main

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.end_step()

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=tuple(spec["betas"]),
                                  weight_decay=spec["weight_decay"])
    warmup = spec["warmup_steps"]  # relay's `warmup_schedule`: step n (from 0) uses lr x (n + 1) / warmup
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0)
    args = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], seed=spec["seed"], use_cpu=True, bf16=False,
        fp16=False, gradient_checkpointing=spec["gradient_checkpointing"], disable_dropout=True, report_to="none",
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False,
        per_device_train_batch_size=spec["micro_batch_size"], gradient_accumulation_steps=spec["grad_accum"],
        num_generations=spec["num_generations"], max_completion_length=spec["max_completion_length"],
        temperature=spec["temperature"], top_p=spec["top_p"], top_k=0, num_iterations=1, loss_type="dapo",
        scale_rewards="group", beta=spec["beta"], epsilon=spec["epsilon"], epsilon_high=spec["epsilon_high"],
        learning_rate=spec["lr"], max_grad_norm=spec["max_grad_norm"], mask_truncated_completions=False,
    )
    dataset = Dataset.from_list(rows)
    trainer = GRPOTrainer(model=model, reward_funcs=[clock.exact_match], args=args, train_dataset=dataset,
                          processing_class=tokenizer, optimizers=(optimizer, schedule), callbacks=[StepTimer()])
    clock.timed(trainer, "_generate", "generate")
    clock.timed(trainer, "_calculate_rewards", "score")
    clock.timed(trainer, "_get_per_token_logps_and_entropies", "reference",
                when=lambda policy, *args, **kwargs: policy is trainer.ref_model)
    return trainer


def trl_main(spec_path: Path) -> None:
    """The runner: train as `spec_path` says, check it ran relay's steps and learning rates, then write
    {"records": [...]} to its result file."""
    import torch

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    rows = json.loads(Path(spec["prompts_file"]).read_text())
    clock = PhaseClock([row["prompt"] for row in rows], len(rows) // spec["steps"], spec["num_generations"])
    make_trl_trainer(spec, rows, clock).train()
    if len(clock.records) != spec["steps"]:
        raise RuntimeError(f"TRL ran {len(clock.records)} optimizer steps, expected {spec['steps']}")
    warmup = spec["warmup_steps"]
    for record in clock.records:  # relay's learner.warmup_steps: step n uses lr x n / warmup_steps
        expected = spec["lr"] * (min(1.0, record["step"] / warmup) if warmup else 1.0)
        if abs(record["lr"] - expected) > 1e-9 * spec["lr"]:
            raise RuntimeError(f"TRL step {record['step']} used lr {record['lr']}, relay's schedule {expected}")
    Path(spec["result_file"]).write_text(json.dumps({"records": clock.records}))


if __name__ == "__main__":
    main()
