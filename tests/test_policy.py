"""Focus policies are one registry (:mod:`mcfn.core.policy`): a policy registered in one place is decoded with by
``train.generate --context`` and scored by both of ``train.eval``'s protocols, and no other module names one."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from mcfn.core.policy import POLICIES, Choice, FocusPolicy, register

REPO = Path(__file__).resolve().parents[1]


def every_other_block(system, window, layout, reach, scale):
    """A scored policy's scorer: the blocks of even index up, the odd ones down (a policy no module knows; it reads
    no distance, so it needs no ``scale``)."""

    def score(wc):
        return torch.where(wc.valid, 1.0 - 2.0 * ((wc.start // layout.K) % 2).float(), 0.0)

    return score


@pytest.fixture
def alternate():
    policy = register(FocusPolicy("alternate", Choice.SCORED, every_other_block))
    yield policy
    del POLICIES[policy.name]


def test_a_policy_registered_in_one_place_is_generated_with_and_scored_under_both_protocols(
    alternate, decoding_run, tmp_path, capsys
):
    from train.eval import main as eval_main
    from train.generate import main as generate_main

    run, prompt = decoding_run
    flags = ["--ckpt", str(run), "--prompt-file", str(prompt), "--max-new-tokens", "6", "--refocus-every", "4"]
    assert generate_main([*flags, "--context", "alternate"]) == 0
    err = capsys.readouterr().err
    assert "[generate] alternate, refocus 4:" in err and "[refocus]" in err
    maps = [line.strip() for line in err.splitlines() if line.startswith("  ")]
    assert any("1" in m and "0" in m for m in maps), maps  # a cut the scorer shaped: gists and tokens
    out = tmp_path / "eval.json"
    assert eval_main(["--ckpt", str(run), "--json", str(out), "--out", str(tmp_path), "--batches", "1"]) == 0
    report = json.loads(out.read_text())
    assert "alternate" in report["bpb"] and "alternate" in report["one_cut"]["bpb"]
    assert report["tasks"]["corpus"]["bpb"]["alternate"] == report["bpb"]["alternate"]


def test_a_scored_policy_needs_a_scorer_and_names_are_unique():
    with pytest.raises(ValueError, match="needs a scorer"):
        FocusPolicy("unscored", Choice.SCORED)
    with pytest.raises(ValueError, match="registered already"):
        register(FocusPolicy("lens", Choice.TRUNCATION))


def policy_literals(path: Path) -> list[tuple[str, int, str]]:
    """Each string literal in ``path`` that is a registered policy's name: (module, line, literal)."""
    names = set(POLICIES)
    return [
        (str(path.relative_to(REPO)), node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


# The same words meaning something else: each (module, literal) and what it names there.
NOT_POLICIES = {
    ("src/mcfn/stage/traces.py", "lens"): "the config section [mc.lens]",
    ("src/mcfn/bench/sweep.py", "lens"): "LensNet's share of an MC step's time, a column of stored sweeps",
    ("train/gpu_check.py", "full"): "the GPU check's full mode, beside its dry run",
    ("src/mcfn/core/weights.py", "full"): "the full-window teacher's loss weight, a LossWeights field",
}


def test_no_module_but_the_registry_spells_a_policys_name():
    """Readers iterate :data:`POLICIES` or name a policy by its constant (``LENS.name``), so a renamed or added
    policy reaches every table, plot and report. Fails on a literal such as ``"lens"`` outside the registry."""
    sources = [p for folder in ("src", "train") for p in sorted((REPO / folder).rglob("*.py"))]
    found = [hit for p in sources if p.name != "policy.py" for hit in policy_literals(p)]
    unexplained = [hit for hit in found if (hit[0], hit[2]) not in NOT_POLICIES]
    assert not unexplained, unexplained
    assert len(found) == len(NOT_POLICIES), "an entry of NOT_POLICIES is stale: remove it"
    assert policy_literals(REPO / "src" / "mcfn" / "core" / "policy.py"), "the check must see the registry's own"
