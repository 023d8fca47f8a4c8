"""Weight sync: seconds and GB/s of each transport, learner -> 1, 2 and 4 real vLLM engines, beside memcpy.

Usage: python bench/weight_sync.py [--sizes 25M 100M] [--workers 1 2 4] [--repeats 9] [dotted.key=value ...]
For each model size (a random-init Qwen2 with the character tokenizer, built locally once into RELAY_CACHE_DIR) and
worker count, starts a learner and that many rollout workers (real vLLM engines in Ray actors) with the run's own
placement code, then loads the learner's weights into every worker through each transport's `load` (what a run's sync
calls) `--repeats` times after one warm-up load; for `collective` the warm-up load also forms the group (reported
apart). Before every load the learner's weights get a new random delta (a step's worth of change, untimed), so a
transport that delivered nothing cannot pass: the probe, run after every load, must find every engine serving the
perturbed weights, and the same probe run just before the load must find them serving the previous ones (the "stale
gap", proof that the check could fail). Transports: `object_store` as a run
has it by default (here every worker is on the learner's node, so they read its shared-memory buffer), the same with
`sync.shared_memory=false` (through Ray's object store, as workers on other nodes do), and `collective` (gloo).
Columns, medians over the repeats:
- load: end to end (export or pack, transfer, the engines' load);
- engine load: inside each engine, the fingerprint of what it received, vLLM's reload path (which copies out of the
  shared buffer or the object store) + the prefix-cache reset; the slowest worker's (the engines load at once, and
  the load ends with the last);
- transfer: load - engine load, what the transport itself costs (the part of the load outside the engines);
- GB/s: model bytes / seconds (every worker gets the whole model in that time);
- memcpy: one thread copying the model's bytes once (`Tensor.copy_`), the physical reference;
- first load: the warm-up load (for `collective`, with the group's formation);
- learner send: `collective` only, the learner's pack + broadcast of every bucket;
- stale gap: the smallest probe gap before a load (engines on the previous weights), which must exceed
  `sync.probe_tolerance`; probe max diff: the largest after a load, which must not;
- fingerprint: inside each engine's load (part of engine load), the fingerprints of every tensor it received
  (`sync.fingerprint`; the slowest worker's), which the run compares with the learner's after every load: checked
  here too, so a load that lost or changed a tensor stops the bench.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

from actors.rollout import RolloutWorker  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker class below travels by value

# name -> Qwen2 shape (head_dim 64; vLLM's CPU attention needs >= 32)
SIZES = {
    "25M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536},
    "100M": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 8, "intermediate_size": 3072},
}
PERTURBATION = 1e-3  # std of the random delta added to every weight before each load
# label -> (sync.transport, overrides): the default, the object store alone, the collective
TRANSPORTS = {"object_store": ("object_store", []),
              "object_store, no shm": ("object_store", ["sync.shared_memory=false"]),
              "collective": ("collective", [])}


class TimedWorker(RolloutWorker):
    """Hands out the timings of the worker's last load (`last_load`: the fingerprint's and the engine's reload)."""

    def load_timings(self) -> dict[str, float]:
        return self.last_load


def model_dir(size: str) -> Path:
    from cluster.demo.model import make_random_model_dir

    path = Path(os.environ.get("RELAY_CACHE_DIR", Path.home() / ".cache" / "relay")) / "bench" / f"qwen2-{size}"
    if not path.exists():
        make_random_model_dir(path, seed=0, max_position_embeddings=128, **SIZES[size])
    return path


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch of the destination pages
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def perturb(learner, seed: int, scale: float = PERTURBATION) -> None:
    """Add a seeded random delta of std `scale` to every weight of the learner (runs inside the learner's actor)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in learner.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale)
    learner._gathered = learner.dp.gather_weights(learner.model)  # what the export reads (fsdp2: rank 0's copy)


def measure(pool, name: str, repeats: int) -> dict[str, float]:
    """Warm-up load, then `repeats` timed loads of every worker through transport `name`, each of newly perturbed
    weights and checked by the probe: stale (before the load) and loaded (after it)."""
    from sync.transport import make_transport

    transport = make_transport(pool.config.sync, pool.fleet.learner, pool.config.timeouts.sync)
    workers = dict(enumerate(pool.fleet.rollout))
    loads, engine, broadcast, stale, loaded, fingerprint = [], [], [], [], [], []
    first = 0.0
    try:
        for attempt in range(repeats + 1):
            ray.get(pool.fleet.learner.__ray_call__.remote(perturb, seed=pool.weights_version))
            pool.weights.begin_sync(pool.weights_version + 1)
            if attempt:
                stale.append(probe_gap(pool))
            started = time.perf_counter()
            done, failed = transport.load(workers, pool.weights_version)
            elapsed = time.perf_counter() - started
            if failed:
                raise RuntimeError(f"{name}: load failed: {failed}")
            for i, report in done.items():  # raises SyncError unless version and fingerprints are the learner's
                pool.weights.check_loaded(workers[i], report, pool.weights_version)
            loaded.append(pool.weights.verify(pool.fleet.rollout))  # SyncError above the tolerance (the first sets it)
            if attempt == 0:
                first = elapsed
                continue
            loads.append(elapsed)
            timings = ray.get([w.load_timings.remote() for w in pool.fleet.rollout_workers])
            engine.append(max(t["reload_s"] + t["fingerprint_s"] for t in timings))
            fingerprint.append(max(t["fingerprint_s"] for t in timings))
            if name == "collective":
                broadcast.append(transport.last_broadcast["seconds"])
    finally:
        transport.close()
    if min(stale) <= pool.weights.tolerance:
        raise RuntimeError(f"{name}: the perturbation moved the probe by only {min(stale):.2g} <= the probe "
                           f"tolerance {pool.weights.tolerance:g}: this check could not catch a load that did nothing")
    load, engine_load = statistics.median(loads), statistics.median(engine)
    return {"load": load, "engine": engine_load, "transfer": max(load - engine_load, 0.0), "first": first,
            "broadcast": statistics.median(broadcast) if broadcast else float("nan"), "probe": max(loaded),
            "stale": min(stale), "fingerprint": statistics.median(fingerprint)}


def probe_gap(pool) -> float:
    """The probe's smallest engine-vs-learner gap over the workers (before a load: every one must be stale)."""
    return min(gap for gap, _ in pool.weights.probe_gaps(pool.fleet.rollout))


def run_size(size: str, workers: list[int], repeats: int, overrides: list[str]) -> list[dict]:
    from cluster.config import load_config
    from cluster.fleet.placement import start_fleet, stop_fleet
    from cluster.fleet.rollout_pool import RolloutPool
    from sync.calls import RunError

    path = model_dir(size)
    nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))  # float32 weights (+ a small header)
    memcpy = memcpy_seconds(nbytes)
    rows = []
    for n in workers:
        common = [f"model.path={path}", f"rollout.num_workers={n}", "learner.kl_coef=0", "learner.kl_reward_coef=0",
                  "timeouts.sync=600", "rollout.max_model_len=64", *overrides]
        config = load_config(None, common)
        row = {"size": size, "bytes": nbytes, "workers": n, "memcpy": memcpy}
        fleet = None
        try:
            fleet = start_fleet(config, str(path), TimedWorker)
            for label, (name, extra) in TRANSPORTS.items():
                pool = RolloutPool(load_config(None, [*common, f"sync.transport={name}", *extra]), fleet)
                rows.append({**row, "transport": label, **measure(pool, name, repeats)})
                print(f"  {size} x{n} {label}: {rows[-1]['load']:.3f} s", file=sys.stderr, flush=True)
        except (RunError, RuntimeError) as err:
            rows.append({**row, "transport": "-", "error": str(err).splitlines()[0][:160]})
        finally:
            if fleet is not None:
                stop_fleet(fleet)
    return rows


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) / 2**20 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), float("nan"))
    import torch
    import vllm

    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, load average {os.getloadavg()[0]:.1f} at start; "
            f"Python {platform.python_version()}, torch {torch.__version__}, vLLM {vllm.__version__}, Ray "
            f"{ray.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    header = machine()
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="relay-vllm-cache-"))
    # Logical CPUs: 4 workers x 0.5 + the learner must fit, whatever the core count (they take turns here).
    ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    try:
        rows = [row for size in args.sizes for row in run_size(size, args.workers, args.repeats, args.overrides)]
    finally:
        ray.shutdown()
    print(f"machine: {header}; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"median of {args.repeats} loads after a warm-up; GB/s = model bytes / seconds; collective: gloo")
    print("| model | MB | workers | transport | load s | load GB/s | engine load s | transfer s | transfer GB/s | "
          "load / memcpy | transfer / memcpy | memcpy s | first load s | learner send s | stale gap | "
          "probe max diff | fingerprint s | fingerprint GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mb = r["bytes"] / 1e6
        if "error" in r:
            print(f"| {r['size']} | {mb:.0f} | {r['workers']} | did not run: {r['error']} |||||||||||||||")
            continue
        gbs = r["bytes"] / 1e9
        print(f"| {r['size']} | {mb:.0f} | {r['workers']} | {r['transport']} | {r['load']:.3f} | "
              f"{gbs / r['load']:.2f} | {r['engine']:.3f} | {r['transfer']:.3f} | "
              f"{gbs / r['transfer'] if r['transfer'] else float('inf'):.2f} | {r['load'] / r['memcpy']:.1f}x | "
              f"{r['transfer'] / r['memcpy']:.1f}x | {r['memcpy']:.3f} | {r['first']:.3f} | "
              f"{'' if r['broadcast'] != r['broadcast'] else format(r['broadcast'], '.3f')} | {r['stale']:.1e} | "
              f"{r['probe']:.1e} | {r['fingerprint']:.3f} | {gbs / r['fingerprint']:.2f} |")


if __name__ == "__main__":
    main()
