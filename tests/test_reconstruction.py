"""Gist reconstruction (``loss_recon``) and the mean-pool control: wired to the right tokens, and training GistNet."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, decisive, make_system
from compile_check import assert_one_graph_equals_eager, one_graph
from hypothesis import given
from hypothesis import strategies as st

from mcfn.config import GistConfig, MCConfig
from mcfn.core.reconstruction import reconstruction_nll, sample_tokens, tokens_read
from mcfn.core.system import process_batch, tree_stage
from mcfn.core.variants import draw_variant_noise
from mcfn.core.weights import LossWeights

SHAPE = {"T": 32, "K": 4, "L": 2, "W": 16, "H": 8, "N": 1}


def setup(gist: dict, seed: int = 0):
    system = make_system(**SHAPE, seed=seed, gist=gist)
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (2, SHAPE["T"] + 1), generator=g)
    return system, window, g


def test_each_gist_is_read_back_into_its_own_tokens():
    """The loss equals a hand computation that reads gist ``j`` of LOD ``k`` at offset ``o`` against token
    ``j·K^k + o`` (its own, not the next one: a target shifted by one token fails here), level by level. The base's
    head is made decisive, so that a wrong offset or target moves the loss well beyond the tolerance."""
    system, window, _ = setup({"recon_weight": 1.0})
    decisive(system)
    layout = system.layout
    tree = tree_stage(system, window)
    tokens = window[:, : layout.T]
    got = reconstruction_nll(system.gist_decoder, system.base, tree, tokens, layout)
    for k in range(1, layout.L + 1):
        span, terms = layout.K**k, []
        for b in range(tokens.size(0)):
            for j in range(layout.eligible_counts[k]):
                gist = tree.emb[b, layout.level_offsets[k] + j]
                hidden = system.gist_decoder(gist[None], k, torch.arange(span)[None])
                own = tokens[b, j * span : (j + 1) * span]
                terms.append(system.base.nll(hidden, own[None])[0])
        assert torch.allclose(got[k - 1], torch.cat(terms).mean(), atol=1e-5), f"LOD{k}"
    shifted = torch.roll(tokens, -1, dims=1)
    assert not torch.allclose(got, reconstruction_nll(system.gist_decoder, system.base, tree, shifted, layout))


def test_a_bounded_reconstruction_reads_a_sample_of_tokens_each_from_its_own_gist():
    """With ``max_tokens = 8`` (T = 32, K = 4: six eligible LOD1 gists of 4 tokens, one LOD2 gist of 16) each level
    reads back 8 tokens a sequence, the ones :func:`sample_tokens` draws: token ``i`` from gist ``i // K^k`` at
    offset ``i % K^k``. The LOD2 gist, larger than the bound on its own, is read at 8 of its 16 offsets, not whole:
    the decoder never reads more than the bound (the base's head made decisive, so a wrong offset shows)."""
    system, window, _ = setup({"recon_weight": 1.0})
    decisive(system)
    layout, decoder = system.layout, system.gist_decoder
    tree = tree_stage(system, window)
    tokens = window[:, : layout.T]
    seen: list[int] = []
    hook = decoder.register_forward_hook(lambda mod, args, out: seen.append(out.shape[0] * out.shape[1]))
    torch.manual_seed(7)
    got = reconstruction_nll(decoder, system.base, tree, tokens, layout, max_tokens=8)
    hook.remove()
    b = tokens.size(0)
    assert seen == [b * 8, b * 8], f"tokens read back per level: {seen}"
    torch.manual_seed(7)
    for k in (1, 2):
        span = layout.K**k
        pick = sample_tokens(b, layout.eligible_counts[k] * span, 8, torch.device("cpu"))
        terms = []
        for row in range(b):
            for i in pick[row].tolist():
                gist = tree.emb[row, layout.level_offsets[k] + i // span]
                hidden = decoder(gist[None], k, torch.tensor([[i % span]]))
                terms.append(system.base.nll(hidden, tokens[row, i : i + 1][None])[0])
        assert torch.allclose(got[k - 1], torch.cat(terms).mean(), atol=1e-5), f"LOD{k}"
    everything = reconstruction_nll(decoder, system.base, tree, tokens, layout)
    assert torch.equal(everything, reconstruction_nll(decoder, system.base, tree, tokens, layout, max_tokens=32))


@given(n=st.integers(1, 64), span=st.sampled_from([2, 4, 8, 64]), max_tokens=st.integers(0, 600), b=st.integers(1, 3))
def test_property_the_reconstruction_reads_at_most_its_bound_of_distinct_tokens(n, span, max_tokens, b):
    """Each row draws ``tokens_read`` distinct tokens of the level's ``n·span``: all of them without a bound, else
    exactly the bound (never more, whatever one gist's span), and always at least one."""
    m = tokens_read(n, span, max_tokens)
    assert 1 <= m <= n * span
    assert m == n * span if max_tokens == 0 else m <= max_tokens
    assert m in (n * span, max_tokens), "the bound is used, not undershot"
    pick = sample_tokens(b, n * span, m, torch.device("cpu"))
    assert pick.shape == (b, m) and int(pick.min()) >= 0 and int(pick.max()) < n * span
    assert all(len(set(row)) == m for row in pick.tolist())


def test_the_sample_is_drawn_afresh_and_covers_every_token():
    """Over many steps every eligible token is read back (the estimate is not stuck on one subset)."""
    counts = torch.zeros(40)
    for _ in range(200):
        counts += torch.bincount(sample_tokens(1, 40, 4, torch.device("cpu"))[0], minlength=40)
    assert (counts > 0).all() and counts.max() < 4 * counts.mean()


def test_the_bounded_reconstruction_compiles_to_one_graph_equal_to_eager(fresh_dynamo):
    """The sampled path (a config constant picks it) is one graph with no recompile, and draws the same gists as
    eager from the same seed."""
    system, _, g = setup({"recon_weight": 1.0})
    layout = system.layout

    def nll(window):
        return reconstruction_nll(
            system.gist_decoder, system.base, tree_stage(system, window), window[:, : layout.T], layout, 8
        )

    with one_graph() as compile_fn:
        compiled = compile_fn(nll)
        for i in range(3):
            window = torch.randint(0, VOCAB, (2, SHAPE["T"] + 1), generator=g)
            torch.manual_seed(i)
            got = compiled(window)
            torch.manual_seed(i)
            torch.testing.assert_close(got, nll(window), atol=1e-5, rtol=1e-4)
            if i == 0:
                compile_fn.forbid_recompiles()


def test_loss_recon_is_a_term_of_the_step_and_its_gradient_reaches_gistnet():
    system, window, g = setup({"recon_weight": 1.0})
    noise = draw_variant_noise(system.layout, window.size(0), g, torch.device("cpu"))
    out = process_batch(system, window, noise, weights({"recon_weight": 1.0}))
    assert "loss_recon" in out.losses and {"mc/recon_lod1", "mc/recon_lod2"} <= out.metrics.keys()
    out.losses["loss_recon"].backward()
    assert system.gistnet.out_proj.weight.grad.abs().sum() > 0, "the reconstruction trains GistNet"
    assert system.gist_decoder.offset_emb.grad.abs().sum() > 0


def test_a_short_training_on_loss_recon_alone_lowers_it():
    """Fifty AdamW steps on the reconstruction term alone lower it: the decoder and GistNet can learn it."""
    system, window, g = setup({"recon_weight": 1.0}, seed=1)
    layout = system.layout
    opt = torch.optim.AdamW(system.parameters(), lr=3e-3)
    first = None
    for _ in range(50):
        nll = reconstruction_nll(system.gist_decoder, system.base, tree_stage(system, window), window[:, :32], layout)
        first = float(nll.mean().detach()) if first is None else first
        opt.zero_grad()
        nll.mean().backward()
        opt.step()
    assert float(nll.mean().detach()) < first - 0.5


def test_a_new_gistnets_gist_is_the_plain_mean_of_its_children_and_recon_off_adds_no_term():
    """GistNet's output projection starts at zero, so before it learns a gist is its children's mean, already in the
    embedding space the base reads; with mc.gist.recon_weight = 0 there is no decoder and no loss_recon."""
    system, window, g = setup({})
    system.gistnet.reset_parameters()
    layout = system.layout
    tree = tree_stage(system, window)
    tokens = system.base.embed(window[:, : layout.T])
    lod1 = tree.emb[:, layout.level_offsets[1] : layout.level_offsets[1] + layout.eligible_counts[1]]
    want = tokens[:, : layout.eligible_counts[1] * layout.K].unflatten(1, (-1, layout.K)).mean(2)
    assert torch.allclose(lod1, want)
    noise = draw_variant_noise(layout, window.size(0), g, torch.device("cpu"))
    out = process_batch(system, window, noise, weights({}))
    assert "loss_recon" not in out.losses and system.gist_decoder is None


def weights(gist: dict) -> dict[str, torch.Tensor]:
    return LossWeights.of(MCConfig(gist=GistConfig(**gist)), torch.device("cpu"))


@pytest.mark.heavy(21)
def test_the_lens_step_with_loss_recon_compiles_to_one_graph_equal_to_eager(fresh_dynamo):
    from mcfn.core.system import process_batch

    system, _, g = setup({"recon_weight": 0.5})
    w = weights({"recon_weight": 0.5})
    batches = []
    for _ in range(3):
        window = torch.randint(0, VOCAB, (2, SHAPE["T"] + 1), generator=g)
        batches.append((system, window, draw_variant_noise(system.layout, 2, g, torch.device("cpu"), 1), w))
    assert_one_graph_equals_eager(process_batch, batches, loss=lambda out: out.total(), params=system.parameters())
