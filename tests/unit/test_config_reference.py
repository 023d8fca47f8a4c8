"""docs/configuration.md holds every key of the run config with its bounds: its generated section is what
`cluster.config_reference` makes of the models today, and every key pydantic's own JSON schema of `RunConfig` finds
(walked here independently of the generator, `X | None` sections and each reward source's `type` included) has a row
whose bounds are the schema's."""

from __future__ import annotations

import re
from pathlib import Path

from cluster.config import RunConfig
from cluster.config_reference import BEGIN, END, render_page

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def schema_keys() -> dict[str, list[dict]]:
    """Every documented key -> the JSON schemas of its value (one per section it appears in), from
    `RunConfig.model_json_schema()`. A plain section is no row of its own; a model reached a second time (`eval.data`
    takes the keys of `data`) is one row, not its keys again."""
    schema = RunConfig.model_json_schema()
    defs, keys, walked = schema["$defs"], {}, {"RunConfig"}

    def refs(node: dict) -> list[tuple[str, bool]]:
        """The models a value holds (by `$ref`), and whether they sit under names (`additionalProperties`)."""
        found = [(node["$ref"].rsplit("/", 1)[1], False)] if "$ref" in node else []
        for option in node.get("anyOf", []) + node.get("oneOf", []):
            found += refs(option)
        if isinstance(node.get("additionalProperties"), dict):
            found += [(ref, True) for ref, _ in refs(node["additionalProperties"])]
        return found

    def walk(model: dict, prefix: str) -> None:
        for name, prop in model["properties"].items():
            key = f"{prefix}{name}"
            if "$ref" not in prop:  # a plain section has no row of its own
                keys.setdefault(key, []).append(prop)
            for ref, named in refs(prop):
                if ref not in walked:
                    walked.add(ref)
                    walk(defs[ref], f"{key}.<name>." if named else f"{key}.")

    walk(schema, "")
    return keys


def expected_bounds(prop: dict) -> list[str]:
    """The texts a key's bounds cell must hold: its interval (`[0, 1]`, `(0, 600]`, `>= 1`), each allowed name."""
    values = [o for o in prop.get("anyOf", [prop]) if o.get("type") != "null"]
    texts = []
    for value in values:
        low = ("[", value["minimum"]) if "minimum" in value else ("(", value.get("exclusiveMinimum"))
        high = ("]", value["maximum"]) if "maximum" in value else (")", value.get("exclusiveMaximum"))
        if low[1] is not None and high[1] is not None:
            texts.append(f"{low[0]}{number(low[1])}, {number(high[1])}{high[0]}")
        elif low[1] is not None:
            texts.append(f"{'>=' if low[0] == '[' else '>'} {number(low[1])}")
        elif high[1] is not None:
            texts.append(f"{'<=' if high[0] == ']' else '<'} {number(high[1])}")
        texts += [f"`{choice}`" for choice in value.get("enum", [])]
        texts += [f"`{value['const']}`"] if "const" in value else []
        texts += [f"length >= {value['minLength']}"] if "minLength" in value else []
    return texts


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def page_rows(page: str) -> dict[str, list[list[str]]]:
    """The page's table rows by key: key -> each row's cells (type, default, bounds, meaning)."""
    rows: dict[str, list[list[str]]] = {}
    for line in page.splitlines():
        match = re.match(r"^\| `([^`]+)` \|", line)
        if match:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[2:-1]]
            rows.setdefault(match.group(1), []).append(cells)
    return rows


def undocumented(page: str) -> list[str]:
    """Keys of the schema missing from `page`, or whose every row lacks one of the schema's bounds."""
    rows, problems = page_rows(page), []
    for key, props in schema_keys().items():
        if key not in rows:
            problems.append(f"{key}: no row")
            continue
        for prop in props:
            wanted = expected_bounds(prop)
            if not any(all(text in (cells[2] if len(cells) > 3 else "") for text in wanted) for cells in rows[key]):
                problems.append(f"{key}: no row with the bounds {wanted}")
    return problems


def test_the_page_names_every_key_with_its_bounds():
    keys = schema_keys()
    # The `X | None` keys the first generator skipped, and a discriminated source's own keys, are among them.
    assert {"reward.sources.<name>.train.lr", "reward.sources.<name>.train.label_source", "eval.data",
            "reward.sources.<name>.urls", "data.reasoning_gym.datasets.<name>.weight"} <= set(keys)
    assert len(keys) > 200
    assert undocumented(PAGE.read_text()) == []


def test_a_missing_key_or_bound_is_caught():
    page = PAGE.read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `reward.sources.<name>.train.lr` |"))
    assert undocumented(page.replace(row + "\n", "")) == ["reward.sources.<name>.train.lr: no row"]
    assert row.count("(0, 1]") == 1
    assert undocumented(page.replace(row, row.replace("(0, 1]", "(0, 2]"))) == [
        "reward.sources.<name>.train.lr: no row with the bounds ['(0, 1]']"]


def test_the_generated_section_is_the_code_s():
    page = PAGE.read_text()
    assert page.count(BEGIN) == 1 and page.count(END) == 1
    assert render_page(page) == page, "regenerate it: python -m cluster.config_reference"
