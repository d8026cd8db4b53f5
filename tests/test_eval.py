"""Held-out evaluation: what each condition means, the headline figures and the train.eval CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_mc import VOCAB, decisive, make_system

from mcfn.tools.evaluation import (
    CONDITIONS,
    EvalSettings,
    default_budgets,
    evaluate_mc,
    format_eval_table,
    retained_fraction,
    spearman,
)

T, K, L, W, H = 64, 4, 2, 32, 8


def test_spearman_and_retained_fraction():
    x = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert spearman(x, x.exp()) == pytest.approx(1.0)  # any increasing map
    assert spearman(x, -(x**3)) == pytest.approx(-1.0)
    assert retained_fraction({"recency": 2.0, "full": 1.5, "lens": 1.75}) == pytest.approx(0.5)
    assert math.isnan(retained_fraction({"recency": 2.0, "full": 2.0, "lens": 1.9}))


def test_default_budgets_start_with_the_runs_own():
    layout = make_system(T, K, L, W, H, N=2).layout
    budgets = default_budgets(layout)
    assert budgets == (W, T // 4)  # T/2 = W; T/8 is below the coarsest cover (13 entries)
    assert all(layout.coarsest_cover < b < layout.T for b in budgets)


@pytest.fixture(scope="module")
def report():
    system = decisive(make_system(T, K, L, W, H, N=2, seed=1))
    windows = [torch.randint(0, VOCAB, (3, T + 1), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    token_bytes = torch.randint(1, 4, (VOCAB,))
    return evaluate_mc(system, windows, token_bytes, EvalSettings(budgets=(W, T), random_contexts=4, refocus=2))


def test_report_has_every_condition_and_the_headline(report):
    assert report["T"] == T and report["W"] == W and report["n_windows"] == 6
    assert set(report["bpb"]) == set(CONDITIONS) and all(math.isfinite(v) for v in report["bpb"].values())
    assert [row["W"] for row in report["sweep"]] == [W, T]
    assert math.isfinite(report["retained_fraction"]) and -1.0 <= report["lens_rank_corr"] <= 1.0
    json.dumps(report)  # the CLI writes it as JSON
    table = format_eval_table(report)
    assert table.count("\n| ") == 3 and "retained_fraction" in table


def test_oracle_is_the_best_random_context(report):
    for row in report["sweep"]:
        assert row["oracle"] <= row["random"] + 1e-9


def test_recency_with_the_whole_window_is_full_context(report):
    """At W = T the recency context holds every token at LOD0: exactly the full condition."""
    row = next(r for r in report["sweep"] if r["W"] == T)
    assert row["recency"] == pytest.approx(row["full"], rel=1e-5)
    assert row["lens"] == pytest.approx(row["full"], rel=1e-5)  # the allocator expands everything it can


def test_eval_cli_on_a_trained_checkpoint(tmp_path, text_dir, capsys):
    from conftest import tiny_sections, write_profile

    from train.eval import main as eval_main
    from train.run import main as run_main

    profile = write_profile(tmp_path / "p.toml", tiny_sections(f"text:{text_dir}"))
    run = tmp_path / "run"
    assert run_main(["--profile", str(profile), "--out", str(run), "--steps", "4"]) == 0
    for name in ("eval.json", "eval.md", "eval_sweep.png"):  # the run ends with the evaluation
        assert (run / name).is_file(), name
    assert json.loads((run / "summary.json").read_text())["eval"]["W"] == 16
    out = tmp_path / "again"
    assert eval_main(["--ckpt", str(run), "--json", str(tmp_path / "e.json"), "--out", str(out), "--batches", "1"]) == 0
    report = json.loads((tmp_path / "e.json").read_text())
    assert {"T", "W", "bpb", "retained_fraction", "lens_rank_corr", "sweep", "n_windows"} <= report.keys()
    assert report["n_windows"] == 4 and (out / "eval_sweep.png").stat().st_size > 1000
    assert "| 16 |" in capsys.readouterr().out
    assert eval_main(["--ckpt", str(tmp_path / "nowhere")]) == 2
    assert eval_main(["--ckpt", str(run), "--budgets", "3"]) == 2
