"""Numbers the docs quote come from the column of the benchmark table they name (docs/benchmarks.md, produced by the
committed bench/ scripts), like for like."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANGE = re.compile(r"(\d+(?:\.\d+)?)x-(\d+(?:\.\d+)?)x")


def table_after(text: str, heading: str, first_column: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table under `heading` whose header starts with `first_column`."""
    section = text.split(heading, 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_column} |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) != len(header):
            break
        rows.append(dict(zip(header, cells)))
    return rows


def quoted_range(rows: list[dict[str, str]], transport: str, column: str) -> str:
    values = [float(row[column].rstrip("x")) for row in rows if row["transport"] == transport]
    assert values, f"no {transport!r} rows in the weight-sync table"
    return f"{min(values):.1f}x-{max(values):.1f}x"


def test_operations_quotes_the_weight_sync_tables_transfer_column_for_both_object_store_paths():
    rows = table_after((ROOT / "docs" / "benchmarks.md").read_text(), "## Weight sync", "model")
    expected = {quoted_range(rows, "object_store", "transfer / memcpy"),
                quoted_range(rows, "object_store, no shm", "transfer / memcpy")}
    operations = (ROOT / "docs" / "operations.md").read_text()
    section = operations.split("## Weight sync", 1)[1].split("\n## ", 1)[0]
    quoted = {f"{a}x-{b}x" for a, b in RANGE.findall(section)}
    assert quoted == expected, f"docs/operations.md quotes {sorted(quoted)}, the table's transfer column {expected}"


def one_digit(value: float) -> str:
    """1.29e-04 -> '1e-4': the precision the prose quotes."""
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def test_operations_states_the_probe_limits_the_probe_limits_table_measured():
    rows = table_after((ROOT / "docs" / "benchmarks.md").read_text(), "## The sync probe's limits", "dtype")
    f32 = [r for r in rows if r["dtype"] == "float32"]
    mixed = {float(r["lr"]): r for r in rows if (r["dtype"], r["master"]) == ("bfloat16", "float32")}
    bf16_small = [r for lr, r in mixed.items() if lr <= 5e-6]
    assert f32 and bf16_small
    by_gap = "gap caught every stale engine, no false alarm"
    assert all(r[by_gap] == "yes" for r in f32)  # "the gap alone catches"
    assert all(r[by_gap] == "NO" for r in bf16_small)  # "the gap misses a stale engine there"
    one_step = "repeat rule: one-step-stale engines caught"
    caught, steps = mixed[1e-6][one_step].split("/")
    every, at_5e6 = mixed[5e-6][one_step].split("/")
    assert every == at_5e6  # "every one at 5e-6"
    assert mixed[1e-6]["repeat rule: never-loading engine caught at step"] == "1"  # "at the first step"
    assert sum(int(r["repeat rule: false alarms"]) for r in rows) == 0  # "no false alarm"
    loads = sum(int(r[one_step].split("/")[1]) for r in rows)
    operations = (ROOT / "docs" / "operations.md").read_text()
    claim = " ".join(operations.split("**Its limits**", 1)[1].split("\n\n", 1)[0].split())
    stale_at_1e6 = next(float(r["stale gap (min)"]) for r in f32 if float(r["lr"]) == 1e-6)
    quotes = {
        "float32 noise": f"noise ~{one_digit(max(float(r['fresh gap (max)']) for r in f32))}",
        "float32 step at lr 1e-6": f"moved the probe by {one_digit(stale_at_1e6)} at lr 1e-6",
        "bfloat16 noise": f"differ by up to ~{one_digit(max(float(r['fresh gap (max)']) for r in bf16_small))}",
        "bfloat16 steps": (f"moved the logprobs by {one_digit(min(float(r['stale gap (min)']) for r in bf16_small))} "
                           f"to {one_digit(max(float(r['stale gap (min)']) for r in bf16_small))}"),
        "repeat rule at lr 1e-6": f"caught {caught} of {steps} one-step-stale engines at lr 1e-6",
        "correct loads": f"no false alarm in {loads} correct loads",
    }
    for what, quote in quotes.items():
        assert quote in claim, f"docs/operations.md's probe limits should quote {what} as '{quote}'"


def test_the_asynchronous_thread_claims_quote_the_threads_tables_step_column():
    rows = table_after((ROOT / "docs" / "benchmarks.md").read_text(), "### The sync probe inside its request",
                       "setting")
    steps = {row["setting"]: [float(x) for x in row["s/step"].split(" / ")] for row in rows}
    on_policy = steps["on-policy (the defaults)"]

    def ratio(setting: str) -> str:
        ratios = [run / base for run, base in zip(steps[setting], on_policy)]  # alternated: run i against run i
        return f"{min(ratios):.2f}-{max(ratios):.2f}x"

    two = ratio("`rollout.max_staleness=1` (learner 1, reference 1, two engines of 1 thread)")
    one = ratio("`rollout.max_staleness=1 rollout.num_workers=1`")
    flat = {name: " ".join((ROOT / name).read_text().split()) for name in ("README.md", "docs/operations.md")}
    assert f"in {two} the on-policy time" in flat["README.md"]
    assert f"takes {two} the on-policy step time, and with one worker {one}" in flat["docs/operations.md"]
