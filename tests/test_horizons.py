"""LensNet trained where it is asked (``mc.lens.horizons = "chunks"``): each window's horizon is a chunk start inside
the tail, the cut and LensNet read up to it, and its preference targets come from that chunk's predictions."""

from __future__ import annotations

import torch
from builders import VOCAB, decisive, make_system, rewritten_after, spread_lens
from compile_check import assert_one_graph_equals_eager
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.config import MCConfig
from mcfn.core.system import process_batch_lens, training_horizon
from mcfn.core.variants import draw_variant_noise
from mcfn.core.weights import LossWeights

T, K, L, W, H, R = 64, 4, 2, 32, 16, 4


def chunk_system(teacher: bool = False, match_feature: bool = False):
    """A system trained at in-tail horizons, with the teacher's attention target and the match feature if asked."""
    lens = {"horizons": "chunks", "match_feature": match_feature, "attention_weight": 1.0 if teacher else 0.0}
    teacher_cfg = {"full_weight": 1.0} if teacher else None
    system = make_system(T, K, L, W, H, N=3, lens=lens, teacher=teacher_cfg, refocus_every=R)
    return spread_lens(decisive(system), seed=2)


def batch_at(system, chunk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (2, T + 1), generator=g)
    noise = draw_variant_noise(system.layout, 2, g, torch.device("cpu"), chunks=H // R)
    noise.tail_chunk = torch.full_like(noise.tail_chunk, chunk)
    return window, noise


def weights():
    return LossWeights.of(MCConfig(), torch.device("cpu"))


@settings(max_examples=12, deadline=None)
@given(st.integers(1, H // R - 2), st.integers(0, 2**10), st.booleans())  # a chunk with text after it
def test_property_in_tail_horizon_targets_come_from_the_chunk_after_the_horizon(chunk: int, seed: int, teacher: bool):
    """Chunk ``c``'s LensNet loss changes when the chunk's own predictions do (a token inside it rewritten) and not
    when any token after the chunk is: the cut, LensNet's reading and the targets all stop at the chunk (I11), while
    ``loss_lm`` keeps the whole tail. Fails with the horizon left at the tail's start."""
    system = chunk_system(teacher)
    window, noise = batch_at(system, chunk, seed)
    horizon = training_horizon(system, noise)
    assert (horizon == T - H + chunk * R).all()
    with torch.no_grad():
        base = process_batch_lens(system, window, noise, weights())
        after = rewritten_after(window, horizon + R, seed=seed + 1)  # tokens past the chunk's last target
        later = process_batch_lens(system, after, noise, weights())
        inside = window.clone()
        inside[:, horizon[0] + 2] = (window[:, horizon[0] + 2] + 1) % VOCAB  # a target of the chunk
        moved = process_batch_lens(system, inside, noise, weights())
    torch.testing.assert_close(later.losses["loss_lens"], base.losses["loss_lens"])
    assert not torch.allclose(later.losses["loss_lm"], base.losses["loss_lm"]), "the whole tail still trains the model"
    assert not torch.allclose(moved.losses["loss_lens"], base.losses["loss_lens"], rtol=0, atol=1e-7)


def test_the_step_at_in_tail_horizons_is_one_graph_equal_to_eager(fresh_dynamo):
    """The horizon is a tensor: batches at every chunk run through one compiled graph, with no recompile (the
    teacher's attention target and LensNet's match feature on)."""
    system = chunk_system(teacher=True, match_feature=True)
    batches = [(system, *batch_at(system, c, seed=c), weights()) for c in range(H // R)]
    assert_one_graph_equals_eager(process_batch_lens, batches)


def test_I11_lensnet_and_the_allocator_read_nothing_after_an_in_tail_horizon():
    """In training at chunk ``c``, rewriting every token after its horizon changes no variant (the allocator's cut
    included) and no LensNet score. Fails with LensNet reading past the horizon."""
    from mcfn.core.system import build_contexts, lens_stage

    system = chunk_system()
    for chunk in range(H // R):
        window, noise = batch_at(system, chunk, seed=chunk)
        horizon = training_horizon(system, noise)
        rewritten = rewritten_after(window, horizon, seed=9)
        with torch.no_grad():
            (wc, shown, _), (wc2, shown2, _) = (
                build_contexts(system, window, noise),
                build_contexts(system, rewritten, noise),
            )
            torch.testing.assert_close(
                lens_stage(system, wc, horizon, window), lens_stage(system, wc2, horizon, rewritten)
            )
        assert torch.equal(shown, shown2)
