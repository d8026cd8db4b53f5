"""The layout's rules, checked: imports flow one way (import-linter contracts in pyproject.toml), and no
module or function grows past what a reader can hold in their head."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

REPO = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80


def test_import_contracts_hold():
    """train → shell → stage → evaluation | bench → inference → core | data → checkpoint → profile → base modules,
    a core without I/O, no cycles.
    ``lint-imports`` prints which import breaks which contract."""
    assert lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True, no_logo=True) == 0


@pytest.mark.parametrize(
    ("planted", "line", "broken"),
    [
        ("mcfn/core/planted.py", "from mcfn.checkpoint import CHECKPOINT_NAME", "The compiled core does no I/O"),
        ("mcfn/core/planted.py", "import mcfn.profile", "The compiled core does no I/O"),
        ("mcfn/shell/planted.py", "import train.run", "train/ (the entry points) on top"),
        ("mcfn/core/planted.py", "import torch", None),  # the copy itself keeps every contract
    ],
)
def test_a_planted_import_breaks_its_contract(tmp_path, planted, line, broken):
    """The contracts on a copy of the code with one import planted: the core reading a file format or a profile, or
    the package importing an entry point, breaks the contract that names it."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(REPO / "src", tmp_path / "src", ignore=ignore)
    shutil.copytree(REPO / "train", tmp_path / "train", ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    (tmp_path / "src" / planted).write_text(line + "\n")
    lint = "from importlinter.cli import lint_imports; raise SystemExit(lint_imports(no_cache=True, no_logo=True))"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'src'}{os.pathsep}{tmp_path}"}
    done = subprocess.run([sys.executable, "-c", lint], cwd=tmp_path, env=env, capture_output=True, text=True)
    report = " ".join(done.stdout.split())  # lint-imports wraps its lines
    assert done.returncode == (0 if broken is None else 1), report[-2000:]
    assert broken is None or broken in report.partition("Broken contracts")[2], report[-2000:]


def python_files() -> list[Path]:
    return sorted(p for folder in ("src", "train", "tests") for p in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_modules_and_functions_stay_small(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{path.name}: split it into modules with one job each"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def design_anchors() -> set[str]:
    """The invariants (``I1``…) and sections (``§1``…) that docs/DESIGN.md defines, by its bold or heading labels."""
    text = (REPO / "docs" / "DESIGN.md").read_text()
    invariants = re.findall(r"^- \*\*(I\d+) ", text, flags=re.MULTILINE)
    sections = re.findall(r"^## (§\d+) ", text, flags=re.MULTILINE)
    return set(invariants) | set(sections)


def test_every_cited_invariant_and_section_is_defined_in_docs_design():
    """A citation such as ``(I7)`` or ``DESIGN §4`` in the code must name something docs/DESIGN.md defines."""
    cited = {
        (match, str(path.relative_to(REPO)))
        for path in python_files()
        for match in re.findall(r"\b(I\d+)\b|(§\d+)", path.read_text())
        for match in match
        if match
    }
    anchors = design_anchors()
    assert {f"I{n}" for n in range(1, 13)} <= anchors and {f"§{n}" for n in range(1, 8)} <= anchors
    assert not {(name, where) for name, where in cited if name not in anchors}


def test_the_readme_names_the_invariants_docs_design_defines():
    """The README says which invariants there are as docs/DESIGN.md does: I1 to the highest it defines, and no
    other range."""
    highest = max(int(name[1:]) for name in design_anchors() if name.startswith("I"))
    readme = (REPO / "README.md").read_text()
    ranges = set(re.findall(r"\bI1[–-]I(\d+)\b", readme))
    assert ranges == {str(highest)}, f"the README names I1–I{sorted(ranges)}; docs/DESIGN.md defines I1–I{highest}"


MAX_CONFIG_LEAVES = 51  # 50, and mc.refocus_cap (issue 90: the decode cost a shipped refocus rule may buy)


def profile_leaves() -> set[str]:
    """Every dotted key some profile in ``profiles/`` sets."""
    import tomllib

    def walk(table: dict, prefix: str = "") -> set[str]:
        keys = set()
        for key, value in table.items():
            keys |= walk(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
        return keys

    return set().union(*(walk(tomllib.loads(p.read_text())) for p in (REPO / "profiles").glob("*.toml")))


def test_every_config_leaf_is_set_by_a_profile_or_a_flag_and_there_are_few():
    """A knob nothing sets is a decision not made: it earns a profile line (with its reason) or becomes a constant
    (issue 65). Derived fields (the vocabulary, from the tokenizer) are set by the run itself."""
    import dataclasses

    from mcfn.config import RunConfig
    from train.run import flag_settings, parse_args

    every_flag = parse_args(["--steps", "1", "--seed", "1", "--data", "x", "--wandb", "disabled", "--compile",
                             "--no-mc", "--init-from", "x"])  # fmt: skip
    flags = {f"{section}.{key}" for (section, key), value in flag_settings(every_flag).items() if value is not None}
    derived = {
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(RunConfig)
        for f in dataclasses.fields(
            section.type if isinstance(section.type, type) else getattr(RunConfig(), section.name)
        )
        if f.metadata.get("derived")
    }
    leaves = set(RunConfig().flat())
    assert len(leaves) <= MAX_CONFIG_LEAVES
    assert flags <= leaves and derived == {"model.vocab_size"}
    assert not leaves - profile_leaves() - flags - derived, "set by no profile and no flag"
