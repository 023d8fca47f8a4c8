"""What the docs say about the code's structure holds: `ray.remote` is applied only where docs/architecture.md says,
and every file of this repository that a comment, docstring or doc cites exists (no citations of files outside it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "actors", "learner", "rewards", "sync")
# Where plain worker classes become Ray actors, as docs/architecture.md lists them.
RAY_REMOTE_FILES = {"cluster/fleet/placement.py", "cluster/fleet/learner_group.py", "cluster/fleet/control.py"}
EXTERNAL = {"docs/reference/api.md"}  # KubeRay's API reference, cited as such by tests/unit/test_deploy.py
CITED = re.compile(r"(?<![\w/.-])((?:shared|docs|cluster|actors|learner|rewards|sync|bench|configs|deploy|tests)/"
                   r"[\w./-]*\w\.(?:md|py|yaml|sh))")


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_ray_remote_is_applied_only_in_the_files_the_architecture_names():
    applying = {str(p.relative_to(ROOT)) for p in sources()
                if re.search(r"^(?!\s*#).*\bray\.remote\(", p.read_text(), flags=re.MULTILINE)}
    assert applying == RAY_REMOTE_FILES
    assert not [p for p in sources() if "@ray.remote" in p.read_text()]  # no actor class is decorated
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for path in RAY_REMOTE_FILES:
        assert f"`{path}`" in architecture, f"docs/architecture.md does not name {path} as applying ray.remote"


def test_every_cited_file_is_in_the_repository():
    texts = [*sources(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "docs").glob("*.md"),
             ROOT / "README.md", *(p for p in (ROOT / "deploy").rglob("*") if p.is_file()),
             *(ROOT / "configs").glob("*.yaml")]
    cited = {(path, name) for path in texts for name in CITED.findall(path.read_text())}
    missing = sorted(f"{path.relative_to(ROOT)}: {name}" for path, name in cited
                     if not (ROOT / name).exists() and name not in EXTERNAL and not _placeholder(name))
    assert not missing, missing


def _placeholder(cited: str) -> bool:
    """`configs/NAME.yaml`: a name the reader fills in."""
    return any(part.split(".")[0].isupper() for part in cited.split("/"))


def test_the_architecture_names_every_module():
    """docs/architecture.md's table of who owns what matches the tree: every module of the packages is in it, and
    every module it names exists (`test_every_cited_file_is_in_the_repository`)."""
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in sources()
               if p.name not in ("__init__.py", "__main__.py") and f"`{p.relative_to(ROOT)}`" not in architecture]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_a_submitted_job_uploads_every_package_relay_installs():
    """`relay submit` builds the job's working_dir from `PACKAGES`: a package missing there imports on this machine
    (from the checkout) and fails on a cluster's nodes."""
    import tomllib

    from cluster.cli.jobs import PACKAGES

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in include} <= set(PACKAGES)
