"""The bounded teacher (``mc.teacher.stretch``): it reads its stretch of each window and nothing else, always the
tail, a far stretch that moves over the whole window, and its attention target judges only the nodes it read."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, decisive, make_system
from compile_check import assert_one_graph_equals_eager
from hypothesis import given
from hypothesis import strategies as st

from mcfn.config import MCConfig, TeacherConfig
from mcfn.core.attention import node_mass
from mcfn.core.nodes import Layout
from mcfn.core.system import process_batch_lens
from mcfn.core.teacher import read_nodes, stretch_positions, teacher_losses
from mcfn.core.variants import draw_variant_noise
from mcfn.core.weights import LossWeights

SHAPE = dict(T=64, K=4, L=2, W=32, H=8, N=2)  # top-level blocks of 16 tokens
STRETCH = 24  # 12 far tokens (three blocks, not a whole top-level one) and the last 12


def bounded_system(seed: int = 0):
    teacher = {"full_weight": 1.0, "stretch": STRETCH}
    return decisive(make_system(**SHAPE, seed=seed, teacher=teacher, lens={"attention_weight": 1.0}))


def batch(system, seed: int):
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (2, system.layout.T + 1), generator=g)
    return window, draw_variant_noise(system.layout, 2, g, torch.device("cpu"), teacher_far=True)


def weights() -> LossWeights:
    return LossWeights.of(MCConfig(teacher=TeacherConfig(full_weight=1.0, stretch=STRETCH)), torch.device("cpu"))


@given(st.sampled_from([(4, 2, 64, 8, 32), (4, 1, 32, 4, 8), (2, 3, 64, 8, 16), (8, 1, 64, 16, 32)]), st.data())
def test_property_the_stretch_is_the_tail_and_whole_far_blocks_before_it(shape, data):
    """Every row reads S distinct positions in order: whole blocks of K tokens, then the window's last S/2 tokens (the
    tail among them); and over the draws every block before the near half is read."""
    K, L, T, H, S = shape
    layout = Layout(T=T, K=K, L=L, W=T // 2, H=H, N=1)
    far = torch.tensor(data.draw(st.lists(st.floats(0, 0.999999), min_size=1, max_size=6)))
    read = stretch_positions(layout, S, far)
    half = S // 2
    assert read.shape == (far.numel(), S)
    assert (read[:, 1:] > read[:, :-1]).all(), "distinct, in order"
    assert (read[:, half:] == torch.arange(T - half, T)).all(), "the near half is the window's end, the tail in it"
    assert (read[:, 0] % K == 0).all() and (read[:, half - 1] < T - half).all(), "whole far blocks before it"
    grid = torch.linspace(0, 0.999999, 200)
    reached = stretch_positions(layout, S, grid)[:, :half].unique()
    assert torch.equal(reached, torch.arange(T - half)), "the far half can be any block before the near half"


def test_the_bounded_teacher_reads_its_stretch_and_nothing_else():
    """Rewriting every token the stretch does not read changes neither ``loss_full`` nor the attention mass; a
    token of the tail moves the mass and not ``loss_full``, which leaves the tail's predictions out (their far text
    is mostly unread). Fails with the whole window read, a stretch without the tail, or the tail in ``loss_full``."""
    system = bounded_system()
    window, noise = batch(system, seed=1)
    layout = system.layout
    read = stretch_positions(layout, STRETCH, noise.teacher_far[:, 0])
    unread = torch.ones(2, layout.T + 1, dtype=torch.bool)
    unread[torch.arange(2)[:, None], read] = False
    unread[torch.arange(2)[:, None], read + 1] = False  # the targets of what it reads
    rewritten = torch.where(
        unread, torch.randint(0, VOCAB, window.shape, generator=torch.Generator().manual_seed(7)), window
    )
    assert not torch.equal(rewritten, window)
    recency = torch.rand(2, layout.H, generator=torch.Generator().manual_seed(3))

    def teach(w):
        with torch.no_grad():
            out, mass, seen = teacher_losses(system.base, w, recency, layout, weights(), True, read=read)
        return out.metrics["train/loss_full"], mass, seen

    (loss, mass, seen), (loss_b, mass_b, _) = teach(window), teach(rewritten)
    torch.testing.assert_close(loss, loss_b)
    torch.testing.assert_close(mass, mass_b)
    tail_changed = window.clone()
    tail_changed[:, layout.T - 2] = (tail_changed[:, layout.T - 2] + 1) % VOCAB
    loss_c, mass_c, _ = teach(tail_changed)
    assert not torch.allclose(mass_c, mass), "the tail is read: its queries' attention moves"
    torch.testing.assert_close(loss_c, loss)  # loss_full leaves the tail's predictions out
    assert torch.equal(seen, read_nodes(read, layout))
    touched = node_mass(torch.zeros(2, layout.T).scatter(1, read, 1.0), layout) > 0  # a node with a token read
    assert (mass[~touched] == 0).all() and (mass * seen).sum(-1).gt(0).all(), "mass only where it read"
    assert (touched & ~seen).any(), "some node is read in part (not judged) at this stretch"
    tokens_seen = seen[:, : layout.T]
    assert torch.equal(tokens_seen, torch.zeros_like(tokens_seen).scatter(1, read, True))


def test_the_attention_target_judges_only_the_nodes_the_stretch_read():
    """With a bounded teacher, LensNet's attention loss does not move with its scores on entries the stretch did not
    read. Fails with every entry a candidate (the unread ones would be pushed down as if nothing attended to them)."""
    from mcfn.core.attention import attention_target_loss
    from mcfn.core.system import build_contexts

    system = bounded_system(seed=2)
    window, noise = batch(system, seed=4)
    layout = system.layout
    read = stretch_positions(layout, STRETCH, noise.teacher_far[:, 0])
    with torch.no_grad():
        wc = build_contexts(system, window, noise)[0]
        _, mass, seen = teacher_losses(system.base, window, torch.rand(2, layout.H), layout, weights(), True, read=read)
    scores = torch.randn(wc.valid.shape, generator=torch.Generator().manual_seed(5))
    one = torch.tensor(1.0)
    seen_entry = seen.repeat_interleave(layout.V, 0).gather(1, wc.node.clamp(min=0)) & wc.valid
    outside = wc.valid & ~seen_entry & (wc.start < layout.T - layout.H)
    assert outside.any(), "some entries lie outside the stretch"
    moved = scores + 5.0 * outside * torch.randn(scores.shape, generator=torch.Generator().manual_seed(6))
    a = attention_target_loss(scores, wc, mass, layout, one, seen).losses["loss_lens_attn"]
    b = attention_target_loss(moved, wc, mass, layout, one, seen).losses["loss_lens_attn"]
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("bound", [{"stretch": STRETCH}, {"window": 16}])
def test_the_step_with_a_bounded_teacher_is_one_graph_equal_to_eager(fresh_dynamo, bound):
    """Either bound keeps the step one graph equal to eager; the far stretch moves from batch to batch as a tensor,
    so it never recompiles."""
    teacher = {"full_weight": 1.0, **bound}
    system = decisive(make_system(**SHAPE, seed=3, teacher=teacher, lens={"attention_weight": 1.0}))
    w = LossWeights.of(MCConfig(teacher=TeacherConfig(**teacher)), torch.device("cpu"))
    batches = [(system, *batch(system, seed=i), w) for i in range(2)]
    assert_one_graph_equals_eager(process_batch_lens, batches, loss=lambda out: out.total(), params=system.parameters())


def test_local_and_tail_attention_is_causal_attention_under_its_band():
    """Every entry reads the ``window`` entries up to itself and the tail reads them all: the blockwise computation
    equals dense attention under that mask, and with the window as long as the sequence, plain causal attention."""
    import torch.nn.functional as F

    from mcfn.core.attention import local_and_tail_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 8, generator=g) for _ in range(3))
    for window, tail in ((8, 5), (4, 8), (16, 1)):
        query, key = torch.arange(32)[:, None], torch.arange(32)[None]
        band = (key <= query) & ((query - key < window) | (query >= 32 - tail))
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        torch.testing.assert_close(local_and_tail_attention(window, tail, 0, q, k, v), want, atol=1e-5, rtol=1e-5)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(local_and_tail_attention(32, 4, 0, q, k, v), causal)


def test_the_windowed_teacher_reads_far_text_only_from_the_tail():
    """With ``mc.teacher.window``, a prediction before the tail does not move when a token more than the base's
    layers times the window back changes, and the tail's attention mass does (it reads every token). Fails with
    full attention everywhere (the early change reaches every later prediction) or a band over the tail too."""
    system = decisive(make_system(**SHAPE, seed=5, teacher={"full_weight": 1.0}, lens={"attention_weight": 1.0}))
    layout, base = system.layout, system.base
    window = torch.randint(0, VOCAB, (2, layout.T + 1), generator=torch.Generator().manual_seed(8))
    changed = window.clone()
    changed[:, 1] = (changed[:, 1] + 1) % VOCAB
    recency = torch.rand(2, layout.H, generator=torch.Generator().manual_seed(9))
    reach = 8  # one layer: a prediction at p reads tokens p - 7 .. p

    def teach(w):
        from functools import partial

        from mcfn.core.attention import hidden_and_tail_attention, local_and_tail_attention

        at = torch.arange(layout.T, dtype=torch.float32)[None]
        first = torch.full((2,), layout.T - layout.H)
        attend = partial(local_and_tail_attention, reach, layout.H)
        with torch.no_grad():
            hidden, attention = hidden_and_tail_attention(
                base, base.embed(w[:, :-1]), at, torch.ones_like(at), first, layout.H, attend
            )
            _, mass, _ = teacher_losses(base, w, recency, layout, weights(), True, reach=reach)
        return base.nll(hidden, w[:, 1:]), mass

    (nll, mass), (nll_b, mass_b) = teach(window), teach(changed)
    far = torch.arange(layout.T) >= 1 + reach * len(base.blocks)  # beyond the band's reach from token 1
    before_tail = torch.arange(layout.T) < layout.T - layout.H
    torch.testing.assert_close(nll[:, far & before_tail], nll_b[:, far & before_tail])
    assert not torch.allclose(nll[:, -layout.H :], nll_b[:, -layout.H :]), "the tail reads token 1"
    assert not torch.allclose(mass, mass_b)


def test_cpu_longhistory_trains_the_base_at_the_distances_it_is_evaluated_at():
    """The fix for positions past the plain phase's 512 (remapping them did not help, LABLOG): ``cpu-longhistory``
    trains at T = 4096 with the windowed teacher on, whose tail reads all 4096 tokens (the test above), so
    ``loss_full`` supervises predictions at every distance the profile's evaluation asks about. Fails if the
    profile drops the teacher, bands the whole window, or trains at the plain phase's length."""
    from mcfn.profile import resolve

    plain, long = resolve("cpu-longrange", []), resolve("cpu-longhistory", [])
    assert long.data.seq_len == 8 * plain.data.seq_len == 4096
    teacher = long.mc.teacher
    assert teacher.enabled and teacher.full_weight > 0 and teacher.stretch == 0
    assert 0 < teacher.window < long.data.seq_len, "a band over every token but the tail's, which reads all T"
