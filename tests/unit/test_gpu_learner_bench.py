"""bench/gpu_learner.py at its tiny size on the CPU: sane numbers, both checks passed, and neither Ray nor vLLM
imported (the GPU machines it is for have neither); its checks fail when what they compare differs."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# What relay's modules that the bench loads may import: the standard library, the bench's own packages (torch,
# numpy, transformers, peft, pydantic), three that transformers itself requires (safetensors, huggingface_hub, yaml),
# relay's config packages cluster/plan.py reads (technique a's budget) and NVML where installed (plan's GPU size).
ALLOWED = {"torch", "numpy", "transformers", "peft", "pydantic", "safetensors", "huggingface_hub", "yaml", "pynvml",
           "learner", "sync", "bench", "cluster", "rewards", "actors"}
# Runs `body` in a fresh interpreter, then prints the top-level names of every module imported and the files of the
# relay modules among them, as JSON on the last line.
PROBE = """
import json, sys
sys.path.insert(0, {root!r})
{body}
packages = ("learner", "sync", "bench", "cluster", "rewards", "actors")
relay = sorted(m.__file__ for name, m in list(sys.modules.items())
               if name.split(".")[0] in packages and getattr(m, "__file__", None))
print(json.dumps({{"modules": sorted({{name.split(".")[0] for name in sys.modules}}), "relay": relay}}))
"""


def probe(body: str) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), body=body)], capture_output=True,
                          text=True, check=False, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(done.stdout.strip().splitlines()[-1])


def imported_names(path: str) -> set[str]:
    """Top-level names of every import in the file, also those inside functions."""
    names = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            names.add(node.module.split(".")[0])
    return names


def test_tiny_run_on_the_cpu_reports_sane_numbers_passes_its_checks_and_imports_neither_ray_nor_vllm(tmp_path):
    out = tmp_path / "results.json"
    body = (f"from bench import gpu_learner\n"
            f"assert gpu_learner.main(['--size', 'tiny', '--device', 'cpu', '--steps', '1', '--out', {str(out)!r}]) "
            f"== 0")
    done, imported = probe(body)
    assert "ray" not in imported["modules"] and "vllm" not in imported["modules"]
    outside = {f"{Path(f).relative_to(ROOT)}: {name}" for f in imported["relay"] for name in imported_names(f)
               if name not in ALLOWED and name not in sys.stdlib_module_names}
    assert not outside, sorted(outside)
    assert any(f.endswith("learner/learner.py") for f in imported["relay"])  # the real learner ran

    results = json.loads(out.read_text())
    variants = {row["variant"]: row for row in results["variants"]}
    from bench.gpu_learner import SIZES, VARIANTS, draw_batch

    assert list(variants) == [variant.name for variant in VARIANTS.values()]  # one per technique, all, the others

    tiny = SIZES["tiny"]
    timed = draw_batch(tiny, 1)  # seed 0 is the warm-up step's batch
    tokens = sum(map(len, timed.prompt_ids)) + sum(map(len, timed.response_ids))
    for row in variants.values():
        assert row["steps"] == 1 and row["tokens_per_step"] == tokens
        assert row["tokens_per_s"] > 0 and row["seconds_per_step"] > 0 and row["tflops_per_s"] > 0
        assert row["mfu"] is None and 0 < row["peak_memory_gib"] < 64  # no known peak on a CPU
        assert row["kernels"] is None and row["idle_share"] is None  # no device kernels on a CPU
        assert row["vs_plain_loop"] > 0
    assert results["plain_loop"]["seconds_per_step"] > 0
    # technique a: relay plan's budget, larger than the size's own; b-f: their fast path and nothing else
    plan = variants[VARIANTS["a"].name]
    assert plan["budget"] > tiny.budget and plan["fast_paths"] == {}
    assert variants[VARIANTS["b"].name]["fast_paths"] == {"head_chunk_tokens": "size"}
    assert variants[VARIANTS["c"].name]["fast_paths"] == {"compile_bucket_tokens": "size"}
    assert variants[VARIANTS["e"].name]["fast_paths"] == {"varlen_attention": True}
    assert variants[VARIANTS["all"].name]["budget"] >= plan["budget"]
    full, lora = variants[VARIANTS["plain"].name], variants[VARIANTS["lora"].name]
    assert full["adapter_parameters"] == 0 and full["trained_parameters"] == full["base_parameters"] > 400_000
    assert 0 < lora["trained_parameters"] == lora["adapter_parameters"] < full["trained_parameters"] / 5
    assert lora["base_parameters"] == full["base_parameters"]
    checks = {check["name"]: check for check in results["checks"]}
    assert checks["fingerprints"]["passed"] and checks["fingerprints"]["tensors"] > 20
    assert checks["packing"]["passed"] and checks["packing"]["rows"] == tiny.check_prompts * tiny.group
    assert checks["packing"]["float32"]["max_abs_diff"] <= 1e-4  # on the CPU the two passes agree to float32's noise
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 1 + len(VARIANTS) and "n/a" in table[2]  # header, the plain loop, the variants
    assert done.stdout.count(": PASS") == 2 and "CHECK FAILED" not in done.stderr


def test_the_import_probe_sees_ray_when_a_module_imports_it():
    _, imported = probe("import sync.calls")  # the actor calls with a deadline: Ray's
    assert "ray" in imported["modules"]


def test_flops_count_the_frozen_base_at_four_and_the_trained_parameters_at_six_per_token():
    from bench.gpu_learner import step_flops

    assert step_flops({"base": 100, "adapter": 0, "trained": 100}, 10) == 6 * 100 * 10
    assert step_flops({"base": 100, "adapter": 5, "trained": 5}, 10) == 4 * 100 * 10 + 6 * 5 * 10


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("NVIDIA H100 NVL", None), ("NVIDIA L4", None)])
def test_known_gpus_get_their_dense_bfloat16_peak_and_others_none(name, peak):
    from bench.gpu_learner import peak_tflops

    assert peak_tflops(name) == peak


def test_the_packing_check_fails_when_packed_logprobs_differ_and_says_by_how_much(tmp_path, monkeypatch):
    from bench import gpu_learner
    from learner.learner import Learner

    tiny = gpu_learner.SIZES["tiny"]
    gpu_learner.build_model_dir(tiny, tmp_path, torch.device("cpu"))
    learner = Learner(str(tmp_path), gpu_learner.learner_config(tiny, True, lora=False), dtype="bfloat16")
    batch = gpu_learner.draw_batch(tiny, 0)
    real = gpu_learner.batched_logprobs

    def off_by_a_fifth(model, padded, batching):  # packed passes 0.2 off at one response token
        logprobs = real(model, padded, batching)
        if batching.pack:
            row, column = padded.response_mask.nonzero()[-1].tolist()
            logprobs[row, column] += 0.2
        return logprobs

    monkeypatch.setattr(gpu_learner, "batched_logprobs", off_by_a_fifth)
    check = gpu_learner.check_packing(learner, batch, tiny)
    assert not check["passed"] and not check["bfloat16"]["passed"] and not check["float32"]["passed"]
    assert check["float32"]["max_abs_diff"] == pytest.approx(0.2, abs=1e-4)
    [line] = gpu_learner.failures([check, {"name": "fingerprints", "passed": True}])
    assert "packed and padded" in line and "tolerance 0.125" in line and "float32 0.2 (tolerance 0.001)" in line


def test_profile_script_profiles_a_step_of_a_variant_and_times_the_plain_loop(tmp_path):
    # bench/gpu_profile.py at its tiny size: the profiled relay step's table names the log-softmax the learner scores
    # with, and the plain loop times its steps (relay's variants are timed as gpu_learner's are; not repeated here).
    from bench import gpu_profile

    size = gpu_profile.SIZES["tiny"]
    batches = [gpu_profile.draw_batch(size, seed) for seed in range(2)]
    model_dir = tmp_path / "model"
    gpu_profile.build_model_dir(size, model_dir, torch.device("cpu"))
    assert gpu_profile.plain_seconds(model_dir, size, batches) > 0
    with torch._dynamo.config.patch(disable=False):  # a CPU vLLM engine of another test turns it off process-wide
        text = gpu_profile.profile_step(model_dir, size, batches, tmp_path, "all")
    assert text.startswith("variant a+b+c+d+e+f (passes of ") and "aten::logsumexp" in text
    assert (tmp_path / "profile-all.txt").read_text() == text
    assert (tmp_path / "trace-all.json.gz").stat().st_size > 0


def test_the_device_s_busy_time_is_the_union_of_its_kernels_intervals():
    from bench.gpu_learner import busy_seconds

    # [0, 2] and [1, 3] overlap (two streams): 3 s busy; [5, 6] 1 more; [5.5, 5.7] inside it adds nothing
    assert busy_seconds([(5, 6), (0, 2), (1, 3), (5.5, 5.7)]) == 4
    assert busy_seconds([]) == 0
