"""The ship choice (issue 78): paired errors, a rule fixed in code, validation windows only, and a checkpoint whose
shipped policy evaluation and generation use."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil

import pytest
import torch

from mcfn.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from mcfn.core.policy import LENS, MATCH, RECENCY, SHIPPED, Choice
from mcfn.data.corpus import prepare_corpus
from mcfn.errors import UserError
from mcfn.evaluation.batch import EvalSettings
from mcfn.evaluation.result import Gain, Paired, Row
from mcfn.evaluation.stats import Clusters, paired_differences
from mcfn.shell.restore import load_trained
from mcfn.stage.ship import SHIP_EVAL_NAME, Candidate, choose, ship_run

NAMES = ["recency", "match", "lens", "gated"]  # simplest first


def row(bpb: dict[str, float], se: float, accuracy: dict[str, float] | None = None, acc_se: float = 0.05) -> Row:
    """A hand-built row: every pair's paired difference from ``bpb`` (and ``accuracy``) with the errors given."""
    paired = {}
    for i, a in enumerate(NAMES):
        for b in NAMES[i + 1 :]:
            acc = None if accuracy is None else accuracy[a] - accuracy[b]
            paired[f"{a}_over_{b}"] = Paired(bpb[b] - bpb[a], se, acc, None if accuracy is None else acc_se)
    gains: dict[str, Gain | None] = {}
    return Row(128, 4.0, bpb, None, None, gains, accuracy, paired=paired)


def test_the_rule_refuses_a_lost_pass_key_then_takes_the_lowest_bpb_a_tie_going_to_the_simpler():
    """Each verdict computed by hand from the rule: refuse more than 2 paired SE below the best pass key, keep the
    lowest corpus bpb, a tie within one paired SE going to the simpler candidate."""
    corpus = row({"recency": 1.20, "match": 1.17, "lens": 1.25, "gated": 1.17}, se=0.01)
    passkey = row({n: 1.0 for n in NAMES}, 0.01, {"recency": 0.03, "match": 0.10, "lens": 1.0, "gated": 0.97})
    verdict = choose(NAMES, corpus, passkey)
    # recency and match answer far below lens's 1.00: refused; gated is 0.03 below, within 2 x 0.05.
    assert set(verdict.refused) == {"recency", "match"} and verdict.shipped == "gated"
    # Without the pass key the tie of match and gated (equal bpb) goes to match, the simpler.
    assert choose(NAMES, corpus, None).shipped == "match"
    # recency within one SE of the lowest (0.005 behind, SE 0.01): a tie, and recency is the simplest.
    close = row({"recency": 1.175, "match": 1.17, "lens": 1.25, "gated": 1.18}, se=0.01)
    assert choose(NAMES, close, None).shipped == "recency"
    # ... but not beyond it (0.03 behind): the lowest, match, is shipped.
    assert choose(NAMES, corpus, None).refused == {} and choose(NAMES, corpus, None).shipped == "match"
    # A refused candidate is never shipped, however low its bpb.
    cheap = row({"recency": 1.0, "match": 1.17, "lens": 1.25, "gated": 1.18}, se=0.001)
    assert choose(NAMES, cheap, passkey).shipped == "gated"


def test_a_rule_over_the_refocus_cap_is_refused_saying_how_often_it_refocuses():
    """A candidate under a rule of its own that refocuses more than the cap times a token is refused first, with its
    rate and the cap, however low its bpb; the run's own clock (not capped) is never refused for its rate."""
    names = ["recency", "match", "lens", "gated"]
    corpus = dataclasses.replace(
        row({"recency": 1.20, "match": 1.17, "lens": 1.25, "gated": 1.10}, se=0.01),
        refocus_rate={"recency": 0.0625, "match": 0.25, "lens": 0.0625, "gated": 0.25},
    )
    verdict = choose(names, corpus, None, cap=0.1, capped=frozenset({"gated"}))
    assert verdict.refused == {"gated": "refocuses 0.250 times a token, over the cap of 0.100"}
    assert verdict.shipped == "match"  # over the cap too, but on the run's own clock, which its profile chose
    assert choose(names, corpus, None, cap=0.3, capped=frozenset({"gated"})).shipped == "gated"


def test_the_paired_error_is_paired_window_by_window():
    """Two policies whose nats differ by exactly 0.1 bit a byte on every window, while the windows themselves differ
    widely: the paired error is 0, where an unpaired one (the error of each mean) would be large."""
    g = torch.Generator().manual_seed(0)
    nbytes = torch.randint(50, 200, (40,), generator=g).double()
    a = nbytes * math.log(2) * torch.rand(40, generator=g, dtype=torch.float64) * 3
    b = a + 0.1 * nbytes * math.log(2)
    clusters = Clusters(torch.arange(40) // 2)
    pairs = paired_differences({"lens": a, "recency": b}, None, nbytes, ("lens", "recency"), clusters)
    pair = pairs["lens_over_recency"]
    assert math.isclose(pair.bpb, 0.1, rel_tol=1e-9) and pair.se < 1e-9
    unpaired = clusters.resampled_bpb(a, nbytes).std()
    assert unpaired > 0.05, "the windows differ: each mean alone has a large error"
    # Probes: the accuracy difference and its error, by hand on windows that each answer or not.
    right = {"lens": torch.tensor([1.0, 1, 1, 0]), "recency": torch.tensor([0.0, 1, 0, 0])}
    nats = {"lens": torch.ones(4), "recency": torch.ones(4)}
    probe = paired_differences(nats, right, torch.ones(4), ("lens", "recency"), Clusters(torch.arange(4)))
    assert probe["lens_over_recency"].accuracy == 0.5 and probe["lens_over_recency"].accuracy_se > 0


@pytest.fixture
def run_copy(decoding_run, tmp_path):
    run, prompt = decoding_run
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", prompt


def test_the_choice_reads_validation_windows_never_the_test_split(run_copy, monkeypatch):
    """The choice on a saved run with its test split made unreadable: it still chooses, and records its choice."""
    run, _ = run_copy
    ckpt = Checkpoint.read(run)
    corpus = prepare_corpus(ckpt.cfg.data)

    class Unreadable:
        def __getattr__(self, name):
            raise AssertionError(f"the ship choice read the test split ({name})")

    corpus = dataclasses.replace(corpus, test=Unreadable())
    verdict = ship_run(run, torch.device("cpu"), print, corpus)
    R = ckpt.cfg.mc.refocus_every  # each scored candidate also under the copy rule; R/2 and R/4 are over the cap
    pool = [*NAMES, "branches"]  # the branches over match and lens follow gated
    ruled = {f"{name}@copy{R}" for name in pool[1:]}
    assert set(verdict.figures) == set(pool) | ruled and verdict.shipped in verdict.figures
    assert "@1" in verdict.refused and not any(verdict.refused.get(name, "").startswith("refocuses") for name in NAMES)
    assert Checkpoint.read(run).state["shipped"]["name"] == verdict.shipped
    choice = json.loads((run / SHIP_EVAL_NAME).read_text())  # the validation evaluation, for design choices
    assert choice["verdict"]["shipped"] == verdict.shipped and choice["split"] == "validation"
    assert set(NAMES) <= set(choice["tasks"]["corpus"]["bpb"])


def test_train_ship_keeps_the_validation_evaluation_beside_its_verdict(run_copy):
    """``python -m train.ship`` on a saved run: ship.json holds the verdict and the validation evaluation it was read
    from (the split, the corpus figures of every candidate), not the verdict alone. Fails with the command writing
    ship.json again from the verdict after the choice wrote it whole."""
    from train.ship import main as ship_main

    run, _ = run_copy
    (run / SHIP_EVAL_NAME).unlink(missing_ok=True)
    assert ship_main(["--run", str(run)]) == 0
    record = json.loads((run / SHIP_EVAL_NAME).read_text())
    assert record["split"] == "validation" and set(record["verdict"]["figures"]) <= set(
        record["tasks"]["corpus"]["bpb"]
    )
    assert Checkpoint.read(run).state["shipped"]["name"] == record["verdict"]["shipped"]


def test_every_candidate_is_paired_with_every_other(run_copy):
    """The rule reads the paired difference of any two candidates (the pass key's best against each, the lowest
    corpus against each simpler one), so every candidate is scored under a name the evaluation pairs: one of its own
    (an extra candidate) or one of :data:`~mcfn.evaluation.stats.PAIRED`. Fails with a registry policy added to the
    pool that no row pairs (KeyError: 'branches_over_lens' on the default job's validation)."""
    from mcfn.evaluation.stats import PAIRED
    from mcfn.stage.candidates import run_system
    from mcfn.stage.ship import candidates

    run, _ = run_copy
    ckpt = Checkpoint.read(run)
    system, cfg = run_system(ckpt, torch.device("cpu"))
    pool = candidates(system, cfg, {})
    assert all(c.extra or c.name in PAIRED for c in pool), [c.name for c in pool if not (c.extra or c.name in PAIRED)]


def shipped_record(run, record: dict) -> None:
    state = load_checkpoint(Checkpoint.read(run).path)
    state["shipped"] = record
    save_checkpoint(Checkpoint.read(run).path, state)


def test_a_checkpoint_without_a_choice_ships_lens_and_one_with_a_choice_ships_it(run_copy):
    """A checkpoint saved before the choice existed ships ``lens``; one that records ``recency`` ships truncation; one
    that records a LensNet of its own (the gated candidate) scores with that LensNet, not the run's."""
    run, _ = run_copy
    device = torch.device("cpu")
    name, policy = load_trained(run, device).shipped
    assert name == LENS.name and policy.name == SHIPPED and policy.scorer_of is LENS.scorer_of
    shipped_record(run, {"name": "recency", "policy": RECENCY.name, "match_prior": ""})
    name, policy = load_trained(run, device).shipped
    assert name == "recency" and policy.choice is Choice.TRUNCATION and policy.name == SHIPPED
    trained = load_trained(run, device)
    weights = {k: v * 2 for k, v in trained.model.lensnet.state_dict().items()}
    shipped_record(run, {"name": "gated", "policy": LENS.name, "match_prior": "gated", "lensnet": weights})
    trained = load_trained(run, device)
    name, policy = trained.shipped
    window = torch.randint(0, 50, (1, trained.model.layout.T + 1))
    scorer = policy.scorer(trained.model, window, trained.model.layout, 4)
    lensnet = scorer.func  # the LensNet the shipped policy scores with
    assert name == "gated" and lensnet is not trained.model.lensnet and lensnet.match_prior == "gated"
    assert torch.equal(lensnet.head.weight, weights["head.weight"])


def test_generate_without_a_context_decodes_with_the_shipped_policy(run_copy, monkeypatch, capsys):
    """``train.generate`` with no ``--context`` hands generation the checkpoint's shipped policy (here truncation,
    recorded by hand), and names it; ``--context lens`` still overrides it."""
    import mcfn.inference.generation as generation
    from train.generate import main as generate_main

    run, prompt = run_copy
    shipped_record(run, {"name": "recency", "policy": RECENCY.name, "match_prior": ""})
    used = []
    real = generation.generate_mc

    def spy(*args, policy, **kwargs):
        used.append(policy)
        return real(*args, policy=policy, **kwargs)

    monkeypatch.setattr(generation, "generate_mc", spy)
    flags = ["--ckpt", str(run), "--prompt-file", str(prompt), "--max-new-tokens", "4", "--quiet", "--temperature", "0"]
    assert generate_main(flags) == 0
    assert used[-1].name == SHIPPED and used[-1].choice is Choice.TRUNCATION
    assert "[generate] shipped (recency)" in capsys.readouterr().err
    assert generate_main([*flags, "--context", "lens"]) == 0 and used[-1] is LENS


def test_a_policy_ships_with_its_refocus_rule_and_generation_and_eval_refocus_by_it(run_copy, monkeypatch, capsys):
    """A candidate chosen under a rule of its own (``match@copy4``) records the rule; the checkpoint's shipped policy
    carries it; ``train.generate`` without flags decodes by it (the copy rule, at the latest every 4 tokens) and
    ``--refocus-on clock`` overrides it; the evaluation scores ``shipped`` under it while the rest keep the clock.
    Fails with the rule dropped on the way from the verdict to the checkpoint, or generation on the run's clock."""
    import mcfn.inference.generation as generation
    from train.generate import main as generate_main

    run, prompt = run_copy
    record = Candidate(MATCH.name, MATCH, MATCH.name).under("copy4").record()
    assert record == {"name": "match@copy4", "policy": "match", "match_prior": "", "rule": "copy4"}
    shipped_record(run, record)
    name, policy = load_trained(run, torch.device("cpu")).shipped
    assert name == "match@copy4" and policy.rule == "copy4" and policy.scorer_of is MATCH.scorer_of
    rules = []
    real = generation.generate_mc

    def spy(system, prompt, max_new_tokens, refocus_every, *args, on, **kwargs):
        rules.append((on, refocus_every))
        return real(system, prompt, max_new_tokens, refocus_every, *args, on=on, **kwargs)

    monkeypatch.setattr(generation, "generate_mc", spy)
    flags = ["--ckpt", str(run), "--prompt-file", str(prompt), "--max-new-tokens", "4", "--quiet", "--temperature", "0"]
    assert generate_main(flags) == 0 and rules[-1] == ("copy", 4)
    assert "[generate] shipped (match@copy4), refocus copy4:" in capsys.readouterr().err
    assert generate_main([*flags, "--refocus-on", "clock"]) == 0 and rules[-1] == ("clock", 4)
    settings = EvalSettings((8,), refocus_every=8, candidates=(policy,))
    assert settings.rule_of(policy).name == "copy4" and not settings.on_grid(policy)
    assert settings.on_grid(MATCH) and settings.rule_of(MATCH).name == "8"


def test_train_eval_scores_the_shipped_policy_beside_the_others(run_copy, tmp_path):
    """``train.eval`` on a checkpoint saved before the choice (it ships ``lens``): ``shipped`` at the top of eval.json,
    scored as ``lens`` is, with the paired differences of every pair among shipped, lens, branches, match and
    recency."""
    import json

    from train.eval import main as eval_main

    run, _ = run_copy
    out = tmp_path / "e.json"
    assert eval_main(["--ckpt", str(run), "--batches", "1", "--task", "corpus", "--json", str(out), "--out",
                      str(tmp_path / "e")]) == 0  # fmt: skip
    report = json.loads(out.read_text())
    assert list(report)[0] == "shipped" and report["shipped"] == "lens"
    corpus = report["tasks"]["corpus"]
    assert corpus["bpb"]["shipped"] == corpus["bpb"]["lens"]
    names = ["shipped", "lens", "branches", "match", "recency"]  # the order of PAIRED
    expected = {f"{a}_over_{b}" for i, a in enumerate(names) for b in names[i + 1 :]}
    assert set(corpus["paired"]) == expected
    for key, pair in corpus["paired"].items():
        a, b = key.split("_over_")
        assert math.isclose(pair["bpb"], corpus["bpb"][b] - corpus["bpb"][a], abs_tol=1e-9)


def test_the_gated_candidate_adds_its_scaled_scores_to_matchs_where_they_stand_out(decoding_run):
    """The gated candidate's scores, less ``match``'s own prior (the same LensNet with a zero head), are the run's own
    LensNet's scores times :data:`GATED_SCALE` on the units standing more than 2 standard deviations above their
    row's mean (computed here by hand), and zero elsewhere."""
    from mcfn.core.context import WorkingContext
    from mcfn.stage.candidates import GATED_SCALE, gated_lensnet, run_system

    own, cfg = run_system(Checkpoint.read(decoding_run[0]), torch.device("cpu"))
    gated = gated_lensnet(own.lensnet, cfg)
    layout, K = own.layout, own.layout.K
    R, U = 16, own.layout.T // K - 2
    g = torch.Generator().manual_seed(3)
    start = torch.arange(U).repeat(R, 1) * K
    wc = WorkingContext(emb=torch.randn(R, U, cfg.model.n_embd, generator=g), position=(start + (K - 1) / 2).float(),
                        start=start, span=torch.full_like(start, K), lod=torch.zeros_like(start),
                        node=torch.zeros_like(start), target=torch.full_like(start, -1),
                        valid=torch.ones(R, U, dtype=torch.bool), batch_size=[R, U])  # fmt: skip
    tokens = torch.randint(0, 20, (R, layout.T), generator=g)  # a small vocabulary: n-grams recur, match votes
    with torch.no_grad():
        learned = own.lensnet.score(wc)  # the run's own, no prior
        prior_only = copy.deepcopy(gated)
        prior_only.head.weight.zero_()
        added = gated.score(wc, tokens) - prior_only.score(wc, tokens)
    mean, std = learned.mean(-1, keepdim=True), learned.std(-1, unbiased=False, keepdim=True)
    out = learned - mean > 2 * std
    assert out.any() and not out.all(), "some rows stand out, not every unit"
    torch.testing.assert_close(added, torch.where(out, GATED_SCALE * learned, 0.0), rtol=1e-4, atol=1e-4)


def test_every_reader_of_a_working_context_refuses_a_plain_gpts_run(tmp_path, profile, capsys):
    """``train.eval``, ``train.history``, ``train.reuse``, ``train.needle``, ``train.bench --decode`` and
    ``train.serve`` load a run through :func:`~mcfn.shell.restore.load_shipped`: a plain GPT's run (``--no-mc``) is
    a user error (exit 2), raised before any text is read."""
    from train.bench import main as bench_main
    from train.eval import main as eval_main
    from train.history import main as history_main
    from train.needle import main as needle_main
    from train.reuse import main as reuse_main
    from train.run import main as run_main
    from train.serve import parse_args as serve_args
    from train.serve import served_run

    plain = tmp_path / "plain"
    assert run_main(["--profile", str(profile), "--out", str(plain), "--steps", "2", "--no-mc"]) == 0
    capsys.readouterr()
    given = ["--ckpt", str(plain)]
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a prompt " * 40)
    assert eval_main(given) == history_main([*given, "--split", "val"]) == reuse_main(given) == 2
    assert needle_main([*given, "--lengths", "64"]) == 2
    assert bench_main(["--decode", str(plain), "--prompt-file", str(prompt), "--lengths", "16"]) == 2
    assert capsys.readouterr().err.count("holds a plain GPT (--no-mc run)") == 5, "each refused for that reason"
    with pytest.raises(UserError, match="holds a plain GPT"):
        served_run(serve_args(given))
