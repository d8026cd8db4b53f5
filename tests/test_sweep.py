"""The T sweep (``train.bench --sweep-T``): every point's fields, the tree growing linearly with T, and a point
that runs past its cap reported as such while the sweep goes on."""

from __future__ import annotations

from mcfn.bench.sweep import (
    CONDITIONS,
    format_sweep_table,
    measure_point,
    point_config,
    run_sweep,
    sweep_lod_max,
    warm_caches,
)
from mcfn.profile import parse_override, resolve

TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "data.vocab_size=300",
    "data.seq_len=64",
    "mc.block_size=4",
    "mc.lod_max=2",
    "mc.budget=32",
    "mc.tail=8",
    "train.batch_size=2",
]
FIELDS = {"T", "condition", "status", "step_ms", "tokens_per_s", "peak_mem_mb", "compile_s", "graph_breaks",
          "recompiles", "lod_max", "n_nodes", "teacher_tokens", "teacher_window", "recon_tokens",
          "grad_blocks"}  # fmt: skip


def tiny_config():
    return resolve("cpu-longrange", [parse_override(o) for o in TINY] + [("mc", "enabled", True)])


def test_every_point_reports_every_field_and_the_tree_grows_linearly_with_T():
    import torch

    cfg, rows = tiny_config(), {}
    for T in (64, 128):
        for condition in CONDITIONS:
            point = point_config(cfg, T, condition, window=16, grad_blocks=4)
            rows[T, condition] = measure_point(point, condition, 320, torch.device("cpu"), 1, 1, None)
    for (T, condition), row in rows.items():
        assert FIELDS <= row.keys() and row["status"] == "ok" and row["T"] == T
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["peak_mem_mb"] > 0
        assert row["graph_breaks"] == 0 and row["recompiles"] == 0
        if condition != "plain":
            assert {"tree_share", "lens_share", "teacher_share"} <= row.keys()
            assert row["tree_share"] > 0 and row["lens_share"] > 0
            assert (row["teacher_share"] > 0) == (condition not in ("mc", "mc_sparse")), condition
            assert row["grad_blocks"] == (4 if condition == "mc_sparse" else 0), "bounded where it is asked, and bites"
    assert rows[64, "mc_bounded"]["teacher_window"] == rows[128, "mc_bounded"]["teacher_window"] == 16
    assert rows[128, "mc_teacher"]["teacher_window"] == 0 and rows[128, "mc_teacher"]["teacher_tokens"] == 128
    assert rows[64, "plain"]["recon_tokens"] is None and rows[64, "mc"]["recon_tokens"] == 512
    assert rows[64, "mc"]["lod_max"] == rows[128, "mc"]["lod_max"] == 2
    assert rows[128, "mc"]["n_nodes"] == 2 * rows[64, "mc"]["n_nodes"]  # the same depth: nodes linear in T
    table = format_sweep_table(list(rows.values()))
    assert "| 64 | 2 |" in table and "| 128 | 2 |" in table


def test_a_longer_history_gets_a_deeper_tree_that_fits_the_budget():
    cfg = tiny_config()
    assert sweep_lod_max(64, cfg) == 2 and sweep_lod_max(1024, cfg) > 2


def test_each_point_runs_in_its_own_process_and_one_past_its_cap_is_reported():
    """A point's row comes back from the process that measured it; one that cannot finish within the cap (a
    process cannot even import torch in 0.2 s) is reported as over it, and the sweep goes on to the next."""
    rows = run_sweep("cpu-longrange", TINY, [64, 128], 16, 1, 1, True, cap_s=0.2, conditions=("plain",), grad_blocks=4)
    assert rows == [{"T": T, "condition": "plain", "status": "over the 0.2 s cap"} for T in (64, 128)]
    (row,) = run_sweep("cpu-longrange", TINY, [64], 16, 1, 1, True, cap_s=300, conditions=("mc",), grad_blocks=4)
    assert row["status"] == "ok" and FIELDS <= row.keys() and row["tokens_per_s"] > 0


def test_warming_runs_every_point_at_once_and_counts_those_that_finished():
    """The warm pass starts all its processes together and stops waiting at the cap: a clean exit counts, a
    failure does not, and one still running at the cap is killed (all within about the cap, not their sum)."""
    import sys
    import time

    start = time.monotonic()
    commands = [[sys.executable, "-c", "pass"], [sys.executable, "-c", "raise SystemExit(3)"],
                [sys.executable, "-c", "import time; time.sleep(60)"]]  # fmt: skip
    assert warm_caches(commands, cap_s=5) == 1
    assert time.monotonic() - start < 30
    lines: list[str] = []
    (row,) = run_sweep(
        "cpu-longrange", TINY, [64], 16, 1, 1, True, 300, lines.append, ("plain",), warm_first=True, grad_blocks=4
    )
    assert lines[0] == "warm: 1 of 1 compiled" and row["status"] == "ok"
