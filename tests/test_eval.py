"""Held-out evaluation: what each condition means, the headline figures and the train.eval CLI."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re

import pytest
import torch
from builders import VOCAB, decisive, make_system, rewritten_after, spread_lens

from mcfn.checkpoint import Checkpoint
from mcfn.core.attention import attention_mass
from mcfn.errors import UserError
from mcfn.evaluation.batch import EvalBatch, EvalSettings, default_budgets, evaluation_budgets
from mcfn.evaluation.evaluate import conditions, evaluate
from mcfn.evaluation.held_out import HeldOut
from mcfn.evaluation.one_cut import predict_budget
from mcfn.evaluation.oracle import ORACLES
from mcfn.evaluation.report import format_eval_table
from mcfn.evaluation.result import EvalReport, ProtocolResult
from mcfn.evaluation.stats import Clusters, paired_accuracy, paired_gain, retained_with_interval, spearman
from mcfn.inference.generation import generate_mc

T, K, L, W, H = 64, 4, 2, 32, 8


def test_spearman_and_retained_fraction():
    x = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert spearman(x, x.exp()) == pytest.approx(1.0)  # any increasing map
    assert spearman(x, -(x**3)) == pytest.approx(-1.0)
    nbytes = torch.full((200,), 10.0, dtype=torch.float64)
    noise = 0.01 * torch.randn(200, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    nats = {"recency": 20.0 + noise, "full": 15.0 + noise, "lens": 17.5 + noise}
    each = Clusters(torch.arange(200))
    point, (lo, hi) = retained_with_interval(nats, nbytes, each)
    assert point == pytest.approx(0.5) and lo <= 0.5 <= hi and hi - lo < 0.05
    # No gain from full context, or one inside the noise: n/a, never a number.
    assert retained_with_interval({**nats, "full": nats["recency"] + 0.1}, nbytes, each) == (None, None)
    spread = 3 * torch.randn(200, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    wide = {**nats, "full": nats["recency"] - 0.001 + spread}  # seeded: unseeded, 1 draw in 75 looked like a gain
    assert retained_with_interval(wide, nbytes, each) == (None, None)


def test_errors_count_documents_not_windows():
    """Sixteen windows that are eight documents' windows twice over carry the error of eight documents: the cluster
    bootstrap gives exactly the error of the eight windows alone, where a bootstrap over windows gives one about
    sqrt(2) times too small."""
    g = torch.Generator().manual_seed(3)
    nats = {"recency": 20.0 + torch.randn(8, generator=g, dtype=torch.float64), "lens": torch.full((8,), 20.0)}
    nbytes = torch.full((8,), 10.0, dtype=torch.float64)
    alone = paired_gain(nats, nbytes, "recency", "lens", Clusters(torch.arange(8)))
    twice = {name: value.repeat(2) for name, value in nats.items()}
    docs = torch.arange(8).repeat(2)
    by_document = paired_gain(twice, nbytes.repeat(2), "recency", "lens", Clusters(docs))
    by_window = paired_gain(twice, nbytes.repeat(2), "recency", "lens", Clusters(torch.arange(16)))
    assert by_document.bpb == pytest.approx(alone.bpb) and by_document.se == pytest.approx(alone.se)
    assert by_window.se < 0.85 * by_document.se


def test_the_document_bootstrap_resamples_each_documents_own_windows():
    """Windows of unequal documents in no particular order (document ids that are not window indices): each
    resample's gain, summed by hand over the windows of the documents it picks, gives the reported error. Fails for
    a bootstrap that picked windows by the documents' indices."""
    docs = torch.tensor([5, 2, 5, 9, 2, 5, 7, 31, 9])
    g = torch.Generator().manual_seed(4)
    nats = {"recency": 30.0 + 5 * torch.rand(9, generator=g, dtype=torch.float64), "lens": torch.full((9,), 30.0)}
    nbytes = 10.0 + torch.randint(0, 20, (9,), generator=g).double()
    clusters = Clusters(docs)
    ids = sorted(set(docs.tolist()))  # resample column d picks document ids[d]
    by_hand = []
    for picks in clusters.picks.tolist():
        windows = [w for d in picks for w in range(9) if docs[w] == ids[d]]
        gained = sum(float(nats["recency"][w] - nats["lens"][w]) for w in windows)
        by_hand.append(gained / (math.log(2) * sum(float(nbytes[w]) for w in windows)))
    gain = paired_gain(nats, nbytes, "recency", "lens", clusters)
    assert clusters.documents == 5
    assert gain.se == pytest.approx(float(torch.tensor(by_hand, dtype=torch.float64).std()), rel=1e-9)


def test_the_paired_accuracy_error_resamples_documents_with_all_their_windows():
    """A probe's paired accuracy over windows of unequal documents: each resample's difference, the share of the
    picked documents' windows answered by ``a`` less by ``b`` counted by hand, gives the reported error; the point is
    the plain difference over windows. Fails for a formula that averages per-document means or counts each document
    as one window (they agree with this one only where every document gives one window)."""
    docs = torch.tensor([5, 2, 5, 9, 2, 5, 7, 31, 9, 5, 5, 2])
    g = torch.Generator().manual_seed(5)
    correct = {name: torch.randint(0, 2, (12,), generator=g).double() for name in ("a", "b")}
    clusters = Clusters(docs)
    ids = sorted(set(docs.tolist()))
    by_hand = []
    for picks in clusters.picks.tolist():
        windows = [w for d in picks for w in range(12) if docs[w] == ids[d]]
        by_hand.append(sum(float(correct["a"][w] - correct["b"][w]) for w in windows) / len(windows))
    point, se = paired_accuracy(correct, "a", "b", clusters)
    assert point == pytest.approx(float((correct["a"] - correct["b"]).mean()))
    assert se == pytest.approx(float(torch.tensor(by_hand, dtype=torch.float64).std()), rel=1e-9)


def test_default_budgets_start_with_the_runs_own():
    layout = make_system(T, K, L, W, H, N=2).layout
    budgets = default_budgets(layout)
    assert budgets == (W, T // 4)  # T/2 = W; T/8 is below the coarsest cover (13 entries)
    assert all(layout.coarsest_cover < b < layout.T for b in budgets)


def test_an_evaluations_budgets_are_refused_before_any_work_where_they_cannot_be_scored():
    """Every place that makes an evaluation's settings checks its budgets with one function: the defaults where none
    are given; refused in one line (naming the valid range) outside [coarsest cover, T], or where the headline
    cannot refocus every R; a later budget that cannot is left to the one-cut protocol."""
    layout = make_system(T, K, L, W, H, N=2).layout
    most = W - H - (K - 1) * L
    assert evaluation_budgets(layout, None, 1) == default_budgets(layout)
    assert evaluation_budgets(layout, (W, layout.coarsest_cover), most) == (W, layout.coarsest_cover)
    cover = layout.coarsest_cover  # 13: W - R cannot even hold the tail and the gists, whatever R
    for budgets, R, says in (((T + 1,), 1, f"outside [{cover}, {T}]"), ((W,), most + 1, f"[1, {most}]"),
                             ((cover, W), 1, f"[1, {cover - H - (K - 1) * L}]"),
                             ((W, cover - 1), 1, f"budget {cover - 1} is outside [{cover}, {T}]")):  # fmt: skip
        with pytest.raises(UserError, match=re.escape(says)) as refused:
            evaluation_budgets(layout, budgets, R)
        assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def report():
    system = decisive(make_system(T, K, L, W, H, N=2, seed=1))
    windows = [torch.randint(0, VOCAB, (3, T + 1), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    token_bytes = torch.randint(1, 4, (VOCAB,))
    settings = EvalSettings(budgets=(W, T), random_contexts=4, refocus=2, tasks=("corpus",), refocus_every=4)
    return evaluate(system, HeldOut(windows, token_bytes), settings)


def corpus_result(report: EvalReport, protocol: str = "refocus") -> ProtocolResult:
    return report.tasks["corpus"].protocols[protocol]


def test_report_has_every_condition_and_the_headline(report):
    """Read as ``eval.json`` holds it: the headline keys, and the corpus task's under them."""
    js = json.loads(json.dumps(report.to_json()))
    assert js["T"] == T and js["W"] == W and js["windows"] == 6 and js["se"] == "window" and js["documents"] is None
    assert set(js["bpb"]) == set(conditions()) and all(math.isfinite(v) for v in js["bpb"].values())
    assert set(js["one_cut"]["bpb"]) == set(conditions()) and js["refocus_every"] == 4
    assert [row["W"] for row in js["sweep"]] == [W, T]
    corpus = js["tasks"]["corpus"]
    assert -1 <= js["utility_corr"] <= 1 and js["utility_corr"] == corpus["utility_corr"]
    assert corpus["utility_states"] == 6 * (H // 4), "one state per window and chunk of R = 4"
    assert "utility_corr" not in corpus["longrange"], "a per-state figure, not one of the long-range tokens"
    within_budget = ("recency", "attn", "match", "lens")  # what generation can refocus with
    assert js["bpb"][js["best_context"]] == min(js["bpb"][c] for c in within_budget)
    assert -1.0 <= js["lens_rank_corr"] <= 1.0
    assert corpus["bpb"] == js["bpb"] and "longrange" in corpus and corpus["one_cut"]["sweep"][0]["W"] == W
    assert list(js)[-2:] == ["one_cut", "tasks"] and "brief" not in js
    table = format_eval_table(report)
    assert table.count("\n| ") == 6 and "retained [95% CI]" in table  # two budgets, two protocols
    assert "refocused every R = 4" in table and "one cut (R = H = 8)" in table


def test_a_brief_evaluation_scores_its_conditions_exactly_as_the_full_one():
    """A run's final evaluation is brief: full, recency, match, lens and branches at the headline budget under
    generation's protocol, each scored exactly as the full evaluation scores it (the conditions it leaves out never
    feed them; a LensNet with spread scores, so that a cold refocus and a warm one cut differently)."""
    system = spread_lens(decisive(make_system(T, K, L, W, H, N=2, seed=1)), seed=2)
    windows = [torch.randint(0, VOCAB, (3, T + 1), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    token_bytes = torch.randint(1, 4, (VOCAB,))
    settings = EvalSettings(budgets=(W,), random_contexts=4, refocus=2, tasks=("corpus",), refocus_every=4)
    full = evaluate(system, HeldOut(windows, token_bytes), settings)
    brief = evaluate(system, HeldOut(windows, token_bytes), dataclasses.replace(settings, brief=True))
    js = brief.to_json()
    assert set(js["bpb"]) == {"full", "recency", "match", "lens", "branches"} and js["brief"] is True
    assert "one_cut" not in js and "one_cut" not in js["tasks"]["corpus"]
    for name, value in js["bpb"].items():
        assert value == pytest.approx(full.head.head.bpb[name], rel=1e-6), name
    brief_gain, full_gain = brief.head.head.gains["lens_gain"], full.head.head.gains["lens_gain"]
    assert (brief_gain.bpb, brief_gain.se) == pytest.approx((full_gain.bpb, full_gain.se))
    table = format_eval_table(brief)
    assert table.count("\n| ") == 2 and "one cut" not in table and "train.eval --ckpt DIR" in table


def test_best_of_random_is_the_best_random_context(report):
    for row in corpus_result(report).sweep + corpus_result(report, "one_cut").sweep:
        assert row.bpb["best_of_random"] <= row.bpb["random"] + 1e-9


def test_recency_with_the_whole_window_is_full_context(report):
    """At W = T the one-cut recency context holds every token at LOD0: exactly the full condition."""
    row = next(r for r in corpus_result(report, "one_cut").sweep if r.W == T).bpb
    assert row["recency"] == pytest.approx(row["full"], rel=1e-5)
    assert row["lens"] == pytest.approx(row["full"], rel=1e-5)  # the allocator expands everything it can
    assert row["lens_nogist"] == pytest.approx(row["lens"], rel=1e-5), "no gist there to zero"


def test_the_gist_ablation_and_the_paired_gains(report):
    """Where the lens context holds gists, zeroing them changes its predictions; each gain is the difference of
    its two columns, with a standard error above zero (the windows differ)."""
    head = corpus_result(report).head
    assert head.bpb["lens_nogist"] != pytest.approx(head.bpb["lens"], rel=1e-4)
    for name, (worse, better) in (("lens_gain", ("recency", "lens")), ("gist_worth", ("lens_nogist", "lens"))):
        gain = head.gains[name]
        assert gain.bpb == pytest.approx(head.bpb[worse] - head.bpb[better], abs=1e-9)
        assert gain.se > 0
    assert "gist_worth" in format_eval_table(report)


def test_eval_cli_on_a_trained_checkpoint(tmp_path, text_dir, capsys):
    from builders import tiny_sections, write_profile

    from train.eval import main as eval_main
    from train.run import main as run_main

    profile = write_profile(tmp_path / "p.toml", tiny_sections(f"text:{text_dir}"))
    run = tmp_path / "run"
    assert run_main(["--profile", str(profile), "--out", str(run), "--steps", "4"]) == 0
    for name in ("eval.json", "eval.md", "eval_sweep.png"):  # the run ends with the evaluation
        assert (run / name).is_file(), name
    assert json.loads((run / "summary.json").read_text())["eval"]["W"] == 16
    # The run's own evaluation reads the test split, which holds 4 of the 40 documents: at most 2 windows each.
    final = json.loads((run / "eval.json").read_text())
    assert final["split"] == "test" and final["se"] == "document" and final["documents"] == 4
    assert final["windows"] == 8  # every test document is long enough for two
    out = tmp_path / "again"
    assert eval_main(["--ckpt", str(run), "--json", str(tmp_path / "e.json"), "--out", str(out), "--batches", "1"]) == 0
    report = json.loads((tmp_path / "e.json").read_text())
    assert {
        "T",
        "W",
        "bpb",
        "retained_fraction",
        "lens_rank_corr",
        "sweep",
        "windows",
        "documents",
        "split",
    } <= report.keys()
    assert report["windows"] == 4 and report["split"] == "test"  # --batches 1
    assert (out / "eval_sweep.png").stat().st_size > 1000
    assert eval_main(["--ckpt", str(run), "--json", str(tmp_path / "v.json"), "--out", str(out), "--split", "val"]) == 0
    on_val = json.loads((tmp_path / "v.json").read_text())
    assert on_val["split"] == "val" and on_val["windows"] == 8 and on_val["documents"] == 7  # 2 batches of 4
    assert "| 16 |" in capsys.readouterr().out
    args = ["--ckpt", str(run), "--json", str(tmp_path / "o.json"), "--out", str(out), "--batches", "1"]
    assert eval_main([*args, "--brief", "--oracle"]) == 0  # the final evaluation's conditions and the oracles
    oracle = json.loads((tmp_path / "o.json").read_text())
    briefed = {"full", "recency", "match", "lens", "branches", "shipped"}
    assert oracle["brief"] is oracle["oracle"] is True and set(oracle["bpb"]) == briefed | set(ORACLES)
    assert "oracle_attn_over_match" in oracle["tasks"]["corpus"]["paired"]
    assert set(ORACLES) <= set(oracle["tasks"]["corpus"]["indexer_recall"])
    assert eval_main(["--ckpt", str(tmp_path / "nowhere")]) == 2
    assert eval_main(["--ckpt", str(run), "--budgets", "3"]) == 2
    capsys.readouterr()
    for bad in ("0", "3"):  # W=16, H=8, K=4, L=2: W - R must hold 8 + 3 + 3 entries, so R lies in [1, 2]
        assert eval_main(["--ckpt", str(run), "--refocus-every", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "[1, 2]" in err, err


def test_attention_mass_is_the_models_attention_from_the_queries():
    """Each query spreads one unit of attention per layer and head over the entries up to itself."""
    system = decisive(make_system(T, K, L, W, H, N=2, seed=2))
    window = torch.randint(0, VOCAB, (2, T + 1), generator=torch.Generator().manual_seed(0))
    from mcfn.core.system import build_contexts
    from mcfn.core.variants import draw_variant_noise

    noise = draw_variant_noise(system.layout, 2, torch.Generator().manual_seed(0), torch.device("cpu"))
    with torch.no_grad():
        wc, _, _ = build_contexts(system, window, noise)
    queries = wc.valid & (wc.start >= T - H)  # the last H valid entries (I4)
    mass = attention_mass(system.base, wc, H)
    heads = system.base.cfg.n_layer * system.base.cfg.n_head
    torch.testing.assert_close(mass.sum(-1), queries.sum(-1).float() * heads)
    assert (mass[~wc.valid] == 0).all() and (mass >= 0).all()
    last = (wc.valid.sum(-1) - 1)[:, None]
    later = torch.arange(wc.valid.size(1)) > last  # nothing attends past the last query (causal)
    assert (mass[later] == 0).all()


@pytest.mark.heavy(38)
def test_eval_with_probes_and_a_reference(tmp_path, text_dir, jsonl_file):
    """``--task`` and ``--reference`` end to end; a reference with another T or corpus is refused (exit 2)."""
    from builders import tiny_sections, write_profile

    from train.eval import main as eval_main
    from train.run import main as run_main

    bigger = {
        "data": {"seq_len": 256},
        "mc": {"block_size": 4, "budget": 128, "tail": 96, "refocus_every": 8},
        "train": {"steps": 3, "final_eval_batches": 2},
    }
    sections = tiny_sections(f"text:{text_dir}")
    for name, values in bigger.items():
        sections[name].update(values)
    profile = write_profile(tmp_path / "p.toml", sections)
    mc, plain, short = tmp_path / "mc", tmp_path / "plain", tmp_path / "short"
    assert run_main(["--profile", str(profile), "--out", str(mc)]) == 0
    # The run's own evaluation is brief, and its report opens with the five summary lines (mcfn.shell.headline).
    final = json.loads((mc / "eval.json").read_text())
    assert final["brief"] and list(final["tasks"]) == ["corpus", "passkey"] and final["W"] == 128
    assert set(final["tasks"]["passkey"]["accuracy"]) == {"full", "recency", "match", "lens", "branches", "shipped"}
    shipped = final["shipped"]  # chosen on validation windows, recorded in the checkpoint, scored as "shipped"
    candidates = json.loads((mc / "ship.json").read_text())["verdict"]["figures"]
    assert list(final)[0] == "shipped" and shipped in candidates
    assert Checkpoint.read(mc).state["shipped"]["name"] == shipped
    assert json.loads((mc / "summary.json").read_text())["shipped"] == shipped
    opening = (mc / "report.md").read_text().split("\n\n")[1].splitlines()
    heads = ["Trained", f"Ships `{shipped}`", "Pass key", "Corpus bpb", f"A pass-key window as `{shipped}` cuts it",
             "Generated"]  # fmt: skip
    assert [line.split("**")[1] for line in opening] == heads, opening
    if "@copy" in shipped:  # shipped with the copy rule: at least the clock's 4 refocuses
        assert f"`{shipped}` refocusing when a copy starts, at the latest every 8 tokens (" in opening[5]
    else:
        assert f"`{shipped}` refocusing every 8 tokens (4 refocuses; 0.125 a token" in opening[5], "32 tokens, R = 8"
    assert re.search(r"`[0-9·]*\[[0-9·]+\][0-9·]*`$", opening[4]), opening[4]
    # The opening lines' figures are eval.json's, condition by condition, truncation (recency) among them, and the
    # shipped policy's gain over truncation is the paired difference eval.json reports.
    answered, bpb = final["tasks"]["passkey"]["accuracy"], final["bpb"]
    shown = ("full", "recency", "match", "lens", "branches", "shipped")
    assert ", ".join(f"{c} {answered[c]:.2f}" for c in shown) in opening[2], opening[2]
    assert ", ".join(f"{c} {bpb[c]:.4f}" for c in shown) in opening[3], opening[3]
    over = final["tasks"]["corpus"]["paired"]["shipped_over_recency"]
    assert f"pass key {answered['shipped']:.2f}, corpus gain over truncation {over['bpb']:+.4f} ± " in opening[1]
    assert math.isclose(over["bpb"], bpb["recency"] - bpb["shipped"], abs_tol=1e-9)
    # The final evaluation refocuses as generation does: warm after a window's first refocus, with its steps.
    decoding = inspect.signature(generate_mc).parameters
    assert final["warm_steps"] == decoding["warm_steps"].default >= 1, "the final evaluation refocused cold"
    assert final["refocus"] == decoding["refocus_steps"].default and final["refocus_every"] == 8
    assert json.loads((mc / "summary.json").read_text())["final_eval_s"] > 0
    # The pass key, read with the whole window, is tracked at every validation: it shows when retrieval forms.
    records = [json.loads(line) for line in (mc / "metrics.jsonl").read_text().splitlines()]
    tracked = [r["probe/passkey_full"] for r in records if "probe/passkey_full" in r]
    assert len(tracked) == len([r for r in records if "val/bpb" in r]) >= 2 and all(0 <= a <= 1 for a in tracked)
    assert run_main(["--profile", str(profile), "--out", str(plain), "--no-mc"]) == 0
    assert run_main(["--profile", str(profile), "--out", str(short), "--no-mc", "--set", "data.seq_len=128"]) == 0
    args = ["--ckpt", str(mc), "--batches", "1", "--out", str(tmp_path / "e"), "--json", str(tmp_path / "e.json")]
    assert eval_main([*args, "--task", "passkey", "--reference", str(plain)]) == 0
    report = json.loads((tmp_path / "e.json").read_text())
    assert list(report["tasks"]) == ["corpus", "passkey"] and report["reference"] == str(plain)
    passkey = report["tasks"]["passkey"]
    assert {"full", "full_plain", "recency", "random", "attn", "lens", "best_of_all"} <= passkey["accuracy"].keys()
    assert all(0.0 <= v <= 1.0 for v in passkey["accuracy"].values()) and len(passkey["sweep"]) >= 1
    assert {"retained_fraction", "retained_ci", "lens_rank_corr", "bpb"} <= passkey.keys()
    assert (tmp_path / "e" / "eval_depth_passkey.png").stat().st_size > 1000
    assert eval_main([*args, "--reference", str(short)]) == 2
    other = write_profile(
        tmp_path / "o.toml", {**sections, "data": {**sections["data"], "source": f"jsonl:{jsonl_file}"}}
    )
    elsewhere = tmp_path / "elsewhere"
    assert run_main(["--profile", str(other), "--out", str(elsewhere), "--no-mc"]) == 0
    assert eval_main([*args, "--reference", str(elsewhere)]) == 2
    assert eval_main([*args, "--task", "needle"]) == 2


def test_I11_lensnets_rank_pairs_read_nothing_after_the_horizon():
    """``lens_rank_corr``'s predicted preferences read each random context up to the horizon (I11), as the cuts
    do: rewriting every later token changes the measured losses and no preference. Fails with ``seen_until``
    taken out of the evaluation's pair margin."""
    system = spread_lens(decisive(make_system(T, K, L, W, H, N=2, seed=1)), seed=2)
    window = torch.randint(0, VOCAB, (3, T + 1), generator=torch.Generator().manual_seed(3))
    horizon = torch.full((3,), T - H)
    rewritten = rewritten_after(window, horizon, seed=5)
    preds = []
    for w in (window, rewritten):
        generator = torch.Generator().manual_seed(4)
        with torch.no_grad():
            batch = EvalBatch.of(system, EvalSettings((W,), random_contexts=4, refocus=2), w, horizon)
            preds.append(predict_budget(batch, W, generator))
    assert not torch.allclose(preds[0].nll, preds[1].nll), "the rewritten tail is scored differently"
    torch.testing.assert_close(preds[0].preference, preds[1].preference)


@pytest.mark.parametrize("R", [3, 8])
def test_refocuses_per_token_are_the_refocuses_over_the_predictions_served(R):
    """On the clock every refocusing condition refocuses once a chunk of R of the H scored predictions: ceil(H / R)
    refocuses for H predictions a window, whatever the windows; eval.json says the same."""
    system = decisive(make_system(T, K, L, W, H, N=2, seed=1))
    windows = [torch.randint(0, VOCAB, (3, T + 1), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    settings = EvalSettings(budgets=(W,), random_contexts=2, refocus=2, tasks=("corpus",), refocus_every=R, brief=True)
    result = evaluate(system, HeldOut(windows, torch.randint(1, 4, (VOCAB,))), settings)
    row = corpus_result(result).sweep[0]
    assert row.refocus_rate and set(row.refocus_rate.values()) == {math.ceil(H / R) / H}
    assert row.to_json()["refocuses_per_token"] == row.refocus_rate
