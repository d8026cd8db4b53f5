"""The windowed teacher (``mc.teacher.window``): every token reads a band of tokens up to itself and the tail reads
them all, so its cost grows like ``T·window`` instead of ``T²``, and the step stays one graph."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, decisive, make_system
from compile_check import assert_one_graph_equals_eager

from mcfn.config import MCConfig, TeacherConfig
from mcfn.core.attention import AttentionTarget
from mcfn.core.system import process_batch
from mcfn.core.teacher import teacher_losses
from mcfn.core.variants import draw_variant_noise
from mcfn.core.weights import LossWeights

SHAPE = dict(T=64, K=4, L=2, W=32, H=8, N=2)


def batch(system, seed: int):
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (2, system.layout.T + 1), generator=g)
    return window, draw_variant_noise(system.layout, 2, g, torch.device("cpu"))


def weights() -> LossWeights:
    return LossWeights.of(MCConfig(teacher=TeacherConfig(full_weight=1.0)), torch.device("cpu"))


@pytest.mark.heavy(18)
def test_the_step_with_a_windowed_teacher_is_one_graph_equal_to_eager(fresh_dynamo):
    """The band keeps the step one graph equal to eager."""
    teacher = {"full_weight": 1.0, "window": 16}
    system = decisive(make_system(**SHAPE, seed=3, teacher=teacher, lens={"attention_weight": 1.0}))
    w = LossWeights.of(MCConfig(teacher=TeacherConfig(**teacher)), torch.device("cpu"))
    batches = [(system, *batch(system, seed=i), w) for i in range(2)]
    assert_one_graph_equals_eager(process_batch, batches, loss=lambda out: out.total(), params=system.parameters())


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
            _, mass = teacher_losses(base, w, recency, layout, weights(), AttentionTarget(), reach=reach)
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
    assert teacher.enabled and teacher.full_weight > 0
    assert 0 < teacher.window < long.data.seq_len, "a band over every token but the tail's, which reads all T"
