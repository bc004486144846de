"""The lock (requirements/) is what the environment is, and what pyproject.toml's ranges say.

`make lock` solves pyproject's ranges into requirements/lock.txt (+ torch-cpu.txt / torch-cuda.txt) and records
a hash of the ranges in each header; `make install` builds .venv from those files alone. These tests fail when
the ranges moved without a new lock, when a pin left its range, when the running environment is not the lock,
and when the code imports a distribution pyproject does not declare.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from orchestrator.version import pins

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"
PACKAGES = ("orchestrator", "workers", "db", "analysis", "dashboard", "sweeps")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")  # a pin line, for the hash check


def _lock_script():
    spec = importlib.util.spec_from_file_location("lock_script", ROOT / "scripts" / "lock.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def declared(extras=("dev", "postgres")) -> list[Requirement]:
    p = project()
    return [
        Requirement(r) for r in p["dependencies"] + [r for e in extras for r in p["optional-dependencies"][e]]
    ]


def test_the_lock_was_solved_from_the_current_ranges():
    want = _lock_script().ranges_hash()
    for name in ("lock.txt", "torch-cpu.txt", "torch-cuda.txt"):
        got = re.search(r"^# pyproject-ranges-sha256: (\w+)$", (REQ / name).read_text(), re.M)
        assert got and got.group(1) == want, (
            f"requirements/{name} was solved from other ranges than pyproject.toml's: run `make lock`, "
            "then `make test`, and commit both"
        )


def test_the_ranges_hash_moves_with_a_range(tmp_path):
    (tmp_path / "requirements").mkdir()
    for name in ("torch.in", "constraints.in"):
        (tmp_path / "requirements" / name).write_text((REQ / name).read_text())
    text = (ROOT / "pyproject.toml").read_text()
    script = _lock_script()
    (tmp_path / "pyproject.toml").write_text(text)
    same = script.ranges_hash(tmp_path / "pyproject.toml")
    (tmp_path / "pyproject.toml").write_text(text.replace('"scipy>=1.11"', '"scipy>=1.12"'))
    assert same == script.ranges_hash() != script.ranges_hash(tmp_path / "pyproject.toml")
    (tmp_path / "pyproject.toml").write_text(text.replace('version = "0.1.0"', 'version = "0.1.1"'))
    assert script.ranges_hash(tmp_path / "pyproject.toml") == same  # the package's own version is no range


def test_every_declared_dependency_is_pinned_within_its_range():
    locked = pins(REQ / "lock.txt") | pins(REQ / "torch-cpu.txt")
    for req in declared():
        name = canonicalize_name(req.name)
        assert name in locked, f"{req} is declared in pyproject.toml but not in the lock: run `make lock`"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"the lock pins {name}=={locked[name]} outside pyproject's range {req}: run `make lock`"
        )


def test_every_pin_is_exact_and_hashed_and_the_files_name_no_index():
    for name in ("lock.txt", "torch-cpu.txt", "torch-cuda.txt"):
        text = (REQ / name).read_text()
        blocks = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 3)[3])
        assert blocks and all(PIN.match(b) and "--hash=sha256:" in b for b in blocks), name
        assert not re.search(r"--(extra-)?index-url|--find-links|file://", text), name


def test_torch_is_one_release_in_both_builds():
    release = (REQ / "torch.in").read_text().split("torch==")[1].strip()
    assert pins(REQ / "torch-cpu.txt") == {"torch": f"{release}+cpu"}
    cuda = pins(REQ / "torch-cuda.txt")
    assert cuda["torch"] == release
    assert not set(cuda) & set(pins(REQ / "lock.txt")), "torch-cuda.txt repeats a package lock.txt fixes"
    (torch_range,) = [r for r in declared() if r.name == "torch"]
    assert torch_range.specifier.contains(release)


def test_the_running_environment_is_the_lock():
    locked = pins(REQ / "lock.txt")
    wrong = []
    for name, version in locked.items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have is None or canonicalize_name(have) != canonicalize_name(version):
            wrong.append(f"{name} {have} (locked {version})")
    torch_pin = pins(REQ / "torch-cpu.txt")["torch"]
    if Version(md.version("torch")).public != Version(torch_pin).public:  # the CPU or the CUDA build
        wrong.append(f"torch {md.version('torch')} (locked {torch_pin})")
    assert not wrong, f"this environment is not the lock (`make test` builds .venv from it): {wrong}"


def _imported_top_levels() -> dict[str, str]:
    """{top-level module imported by the product code: a file importing it}."""
    found: dict[str, str] = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for n in names:
                    found.setdefault(n.split(".")[0], str(f.relative_to(ROOT)))
    return found


def test_every_imported_distribution_is_declared():
    dists = md.packages_distributions()
    p = project()
    names = {
        canonicalize_name(Requirement(r).name)
        for r in p["dependencies"] + [r for e in p["optional-dependencies"].values() for r in e]
    }
    undeclared = []
    for mod, where in _imported_top_levels().items():
        if mod in sys.stdlib_module_names or mod in PACKAGES or mod == "vllm":  # vllm: the [gpu] extra
            continue
        owners = {canonicalize_name(d) for d in dists.get(mod, [])}
        if not owners & names:
            undeclared.append(f"{mod} ({where}; from {sorted(owners) or 'no installed distribution'})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_rays_extras_are_the_ones_the_code_uses():
    (ray,) = [r for r in declared() if r.name == "ray"]
    used = set()
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            used |= set(
                re.findall(r"^\s*(?:from|import) ray\.(tune|train|serve|data)\b", f.read_text(), re.M)
            )
    assert set(ray.extras) == used, f"ray extras {sorted(ray.extras)} declared, {sorted(used)} imported"


def test_vllm_lives_in_its_own_environment():
    assert project()["optional-dependencies"]["gpu"] == ["vllm"]
    assert "vllm" not in pins(REQ / "lock.txt")
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e '.[gpu]'" in readme and "separate environment" in readme


@pytest.mark.parametrize("name", ["lock.txt", "torch-cpu.txt", "torch-cuda.txt"])
def test_the_lock_files_parse_as_pinned_requirements(name):
    for pin_name, version in pins(REQ / name).items():
        Requirement(f"{pin_name}=={version}")
