"""MegaContext core: the docs/DESIGN.md §3 invariants I1–I5 and I9 as properties, plus compile and training facts."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from builders import (
    STEP_WEIGHTS,
    TINY_VOCAB,
    VOCAB,
    cases,
    contexts,
    flat,
    make_system,
    random_batches,
    tiny_profile_system,
)
from compile_check import assert_one_graph_equals_eager
from hypothesis import given

from mcfn.config import MCConfig, OptimConfig
from mcfn.core.context import WorkingContext
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.system import build_contexts, process_batch
from mcfn.core.tree import build_tree
from mcfn.core.variants import draw_variant_noise, sample_variants
from mcfn.core.weights import LossWeights
from mcfn.shell.optim import build_optimizers


def valid_rows(wc: WorkingContext):
    for r in range(wc.batch_size[0]):
        n = int(wc.valid[r].sum())
        yield r, wc.start[r, :n].tolist(), wc.span[r, :n].tolist(), wc.lod[r, :n].tolist()


@given(cases)
def test_property_I1_alignment_each_gist_is_gistnet_of_exactly_its_aligned_children(case):
    shape, batch, seed = case
    system, window, wc = contexts(shape, batch, seed)
    layout, K = system.layout, shape["K"]
    with torch.no_grad():
        tree = build_tree(system.gistnet, system.base.embed(window[:, : layout.T]), layout)
        for k in range(1, layout.L + 1):
            for j in range(layout.eligible_counts[k]):
                lo = layout.level_offsets[k - 1] + j * K
                expected = system.gistnet(tree.emb[:, lo : lo + K], level=k)
                torch.testing.assert_close(tree.emb[:, layout.level_offsets[k] + j], expected, atol=1e-5, rtol=1e-5)
    for r, starts, spans, lods in valid_rows(wc):
        for s, sp, k in zip(starts, spans, lods, strict=True):
            assert sp == K**k and s % K**k == 0
        n = len(starts)
        torch.testing.assert_close(wc.emb[r, :n], tree.emb[r // layout.V, wc.node[r, :n]])


@given(cases)
def test_property_I2_partition_compressed_variants_cover_what_they_keep_once_baseline_the_recent_W(case):
    """Entries are disjoint and in increasing order; the baseline is the last W tokens; a compressed variant
    reaches the end of the window, and each gap in it is text left out in whole aligned spans of droppable
    gists (top-level blocks), before the tail."""
    shape, batch, seed = case
    _, _, wc = contexts(shape, batch, seed)
    T, W, V, H = shape["T"], shape["W"], shape["N"] + 1, shape["H"]
    unit = shape["K"] ** shape["L"]
    for r, starts, spans, lods in valid_rows(wc):
        ends = [a + s for a, s in zip(starts, spans, strict=True)]
        assert all(e <= b for e, b in zip(ends[:-1], starts[1:], strict=True)), "disjoint, increasing"
        if r % V == 0:
            assert starts == list(range(T - W, T)) and set(lods) == {0}
            continue
        assert ends[-1] == T
        gaps = [(a, b) for a, b in zip([0, *ends[:-1]], starts, strict=True) if a < b]
        for gap_start, gap_end in gaps:
            assert gap_start % unit == 0 and gap_end % unit == 0 and gap_end <= T - H, "left out in whole spans"


@given(cases)
def test_property_I3_capacity_padding_is_last_targetless_and_cannot_touch_valid_entries(case):
    shape, batch, seed = case
    system, _, wc = contexts(shape, batch, seed)
    valid = wc.valid
    assert valid.shape[1] == shape["W"]
    assert (valid[:, :-1] >= valid[:, 1:]).all(), "padding only after the last valid entry"
    assert (wc.target[~valid] == -1).all() and (wc.emb[~valid] == 0).all()
    base = system.base
    with torch.no_grad():
        nll = base.nll(base.hidden(wc.emb, wc.position, wc.span.float()), wc.target)
        noisy = torch.where(valid[..., None], wc.emb, torch.randn_like(wc.emb) * 10)
        nll_noisy = base.nll(base.hidden(noisy, wc.position, wc.span.float()), wc.target)
    torch.testing.assert_close(nll[valid], nll_noisy[valid])
    assert (nll[~valid] == 0).all()


@given(cases)
def test_property_I4_tail_is_tokens_in_every_variant(case):
    shape, batch, seed = case
    _, _, wc = contexts(shape, batch, seed)
    T, H = shape["T"], shape["H"]
    for _, starts, spans, lods in valid_rows(wc):
        tail = [s for s, k in zip(starts, lods, strict=True) if k == 0 and s >= T - H]
        assert tail == list(range(T - H, T))
        assert all(s + sp <= T - H for s, sp, k in zip(starts, spans, lods, strict=True) if k > 0)


@given(cases)
def test_property_I5_every_entry_predicts_the_token_after_its_span(case):
    shape, batch, seed = case
    system = make_system(**shape, seed=seed)
    T = shape["T"]
    window = torch.arange(T + 1).expand(batch, T + 1) % VOCAB  # token id = position, modulo the vocabulary
    noise = draw_variant_noise(system.layout, batch, torch.Generator().manual_seed(seed), torch.device("cpu"))
    with torch.no_grad():
        wc, _, _ = build_contexts(system, window, noise)
    v = wc.valid
    assert torch.equal(wc.target[v], ((wc.start + wc.span) % VOCAB)[v])
    assert (wc.span[v] % VOCAB != 0).all()  # so the next check can tell a target from the entry's own token
    assert not (wc.target[v] == wc.start[v] % VOCAB).any(), "never the entry's own (first) input token"


@given(cases)
def test_property_I9_same_seed_same_variants_and_losses(case):
    shape, batch, seed = case
    system = make_system(**shape, seed=seed)
    window = torch.randint(0, VOCAB, (batch, shape["T"] + 1), generator=torch.Generator().manual_seed(seed))

    def run(noise_seed: int):
        noise = draw_variant_noise(system.layout, batch, torch.Generator().manual_seed(noise_seed), torch.device("cpu"))
        with torch.no_grad():
            return sample_variants(noise, system.nodes), process_batch(system, window, noise, STEP_WEIGHTS)

    (shown_a, out_a), (shown_b, out_b) = run(seed), run(seed)
    assert torch.equal(shown_a, shown_b)
    assert all(torch.equal(a, b) for a, b in zip(flat(out_a).values(), flat(out_b).values(), strict=True))


def test_compressed_variants_differ_in_where_detail_goes():
    layout = Layout(T=1024, K=16, L=2, W=256, H=64, N=2)
    noise = draw_variant_noise(layout, 8, torch.Generator().manual_seed(0), torch.device("cpu"))
    shown = sample_variants(noise, NodeTable.of(layout))
    lod_of = NodeTable.of(layout).lod
    for b in range(8):
        assert not torch.equal(shown[b, 1], shown[b, 2])
    gists_per_level = [int((shown[:, 1:] & (lod_of == k)).sum()) for k in (1, 2)]
    assert all(n > 0 for n in gists_per_level), "mixes of LOD1 and LOD2"
    counts = shown[:, 1:].sum(-1)
    assert (counts <= layout.W).all() and counts.float().mean() > layout.W * 0.6


def test_compressed_variants_spend_the_whole_spare_budget():
    """Within one expansion's cost of ``W``: a variant that wasted budget would show less than the tree allows."""
    layout = Layout(T=1024, K=16, L=2, W=256, H=64, N=2)
    noise = draw_variant_noise(layout, 64, torch.Generator().manual_seed(1), torch.device("cpu"))
    counts = sample_variants(noise, NodeTable.of(layout))[:, 1:].sum(-1)
    assert (counts <= layout.W).all()
    assert (counts >= layout.W - (layout.K - 2)).all()


@pytest.mark.parametrize("network", ["gistnet", "lensnet"])
def test_network_is_in_the_optimizer_and_learns_in_the_training_step(network):
    system = make_system(T=32, K=4, L=2, W=16, H=8, N=2)
    module = getattr(system, network)
    optimizers = build_optimizers(system, OptimConfig())
    in_optimizer = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in in_optimizer for p in module.parameters())
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    weights = LossWeights.of(MCConfig(), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    # Output projections start at zero, so the inner matrices get gradient from the second step on.
    for _ in range(3):
        window = torch.randint(0, VOCAB, (2, 33), generator=g)
        noise = draw_variant_noise(system.layout, 2, g, torch.device("cpu"))
        process_batch(system, window, noise, weights).total().backward()
        for opt in optimizers:
            opt.step()
        system.zero_grad(set_to_none=True)
    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(before), f"unchanged: {set(before) - changed}"


@pytest.mark.heavy(24)
def test_mc_step_is_one_graph_with_no_recompile_over_many_batches(fresh_dynamo):
    system = make_system(T=32, K=4, L=2, W=16, H=8, N=2)
    batches = [(system, window, noise, STEP_WEIGHTS) for window, noise in random_batches(system, 24)]
    assert_one_graph_equals_eager(process_batch, batches, loss=lambda out: out.total(), against_eager=False)


@pytest.mark.heavy(108)
@pytest.mark.xdist_group("tiny-step")
def test_compiled_mc_step_equals_eager(fresh_dynamo):
    """The full step (tree, random and allocator variants, base model, LensNet and every loss) compiled by
    inductor gives the eager losses, metrics and gradients, on the tiny profile's system and batch (inductor's
    cache then serves the suite's other compiles of this step)."""
    system, B = tiny_profile_system()
    # A model that tells variants apart: at init every variant scores the same to 1e-6, and which of two
    # equal losses is "better" (so where the LensNet targets go) is then decided by rounding.
    with torch.no_grad():
        torch.nn.init.normal_(system.base.lm_head.weight, std=1.0)
        for block in system.base.blocks:
            torch.nn.init.normal_(block.attn.c_proj.weight, std=0.3)
            torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.3)
    weights = LossWeights.of(MCConfig(), torch.device("cpu"))
    batches = [(system, window, noise, weights) for window, noise in random_batches(system, 3, B, TINY_VOCAB)]
    assert_one_graph_equals_eager(
        process_batch, batches, backend="inductor", loss=lambda out: out.total(), params=system.parameters()
    )
