"""The layout's rules, checked: imports flow one way (import-linter contracts in pyproject.toml), and no
module or function grows past what a reader can hold in their head."""

import ast
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

REPO = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80


def test_import_contracts_hold():
    """shell → tools | inference → core | data → profile → base modules, a core without I/O, no cycles.
    ``lint-imports`` prints which import breaks which contract."""
    assert lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True, no_logo=True) == 0


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
