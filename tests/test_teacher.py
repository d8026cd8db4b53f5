"""The full-window teacher: ``loss_full`` is the plain loss over the whole window, the variants' tail predictions
are read off the packed forward, and the teacher's step is one graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from builders import decisive, make_system, random_batch
from compile_check import assert_one_graph_equals_eager

from mcfn.config import MCConfig, TeacherConfig
from mcfn.core.losses import recency_tail_nll, tail_nll
from mcfn.core.step import plain_step
from mcfn.core.system import build_contexts, process_batch
from mcfn.core.weights import LossWeights

SHAPE = dict(T=32, K=4, L=2, W=16, H=8, N=2)


def weights(full: float) -> LossWeights:
    mc = MCConfig(teacher=TeacherConfig(full_weight=full))
    return LossWeights.of(mc, torch.device("cpu"))


def test_loss_full_is_the_plain_loss_of_the_whole_window():
    system = decisive(make_system(**SHAPE, teacher={"full_weight": 0.5}))
    window, noise = random_batch(system)
    with torch.no_grad():
        out = process_batch(system, window, noise, weights(0.5))
        plain = plain_step(system.base, window).losses["loss_lm"]
    torch.testing.assert_close(out.metrics["train/loss_full"], plain)
    torch.testing.assert_close(out.losses["loss_full"], 0.5 * plain)


def test_the_recency_tail_nll_is_the_full_windows_when_the_window_fits():
    """The baseline variant shows the last W tokens at LOD0: its tail NLL, read off the packed forward, is the
    full window's, up to what the older tokens change, and identical when the window is no longer than W."""
    system = decisive(make_system(T=16, K=4, L=1, W=16, H=8, N=1))
    window, noise = random_batch(system)
    with torch.no_grad():
        wc, _, _ = build_contexts(system, window, noise)
        hidden = system.base.hidden(wc.emb, wc.position, wc.span.float())
        recency = recency_tail_nll(system.base.nll(hidden, wc.target), wc, system.layout)
        full = F.cross_entropy(system.base(window[:, :-1])[:, -8:].transpose(1, 2), window[:, -8:], reduction="none")
    torch.testing.assert_close(recency, full, atol=1e-5, rtol=1e-5)
    # With W < T the variants differ: the rows read are the baseline's (slot 0 of tail_nll), not another's.
    system = decisive(make_system(**SHAPE))
    window, noise = random_batch(system)
    with torch.no_grad():
        wc, _, _ = build_contexts(system, window, noise)
        nll = system.base.nll(system.base.hidden(wc.emb, wc.position, wc.span.float()), wc.target)
        recency, tails = recency_tail_nll(nll, wc, system.layout), tail_nll(nll, wc, system.layout)
    torch.testing.assert_close(recency.mean(-1), tails[:, 0])
    assert not torch.allclose(tails[:, 0], tails[:, 1])


@pytest.mark.heavy(24)
def test_the_step_with_the_teacher_is_one_graph_equal_to_eager(fresh_dynamo):
    """The last batch brings new weight values: they are tensors, so it does not recompile."""
    system = decisive(make_system(**SHAPE, teacher={"full_weight": 1.0}))
    batches = [(system, *random_batch(system, seed=i), weights(1.0) if i < 3 else weights(0.1)) for i in range(4)]
    assert_one_graph_equals_eager(process_batch, batches)


def test_the_attention_target_by_hand_on_a_tiny_window():
    """The teacher's attention mass, computed the long way on a 16-token window: every layer's and head's full
    causal attention matrix written out, each tail query ``h`` weighted by ``recency_nll[h] - full_nll[T - H + h]``
    (floored), summed onto tokens and then onto every node's span. Fails with the full window's per-token loss read
    one position off, or a query's attention row taken from its neighbour."""
    import math

    from mcfn.core.attention import LONG_RANGE_FLOOR, AttentionTarget
    from mcfn.core.model import causal_attention
    from mcfn.core.teacher import teacher_losses

    system = decisive(make_system(T=16, K=2, L=2, W=12, H=4, N=1, teacher={"full_weight": 1.0}))
    base, layout = system.base, system.layout
    window, _ = random_batch(system, seed=3)
    inputs, targets = window[:, :-1], window[:, 1:]
    T, H = 16, 4
    matrices = []

    def written_out(layer, q, k, v):
        logits = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        matrices.append(torch.softmax(logits.masked_fill(~causal, -torch.inf), -1))  # [B, heads, T, T]
        return causal_attention(layer, q, k, v)

    with torch.no_grad():
        positions = torch.arange(T, dtype=torch.float32)[None]
        hidden = base.hidden(base.embed(inputs), positions, torch.ones_like(positions), attend=written_out)
        full_nll = F.cross_entropy(base.logits(hidden).transpose(1, 2), targets, reduction="none")  # [B, T]
        recency = full_nll[:, T - H :] + torch.tensor([[0.0, 2.0, -1.0, 0.5], [1.5, 0.0, 0.0, 3.0]])
        _, mass = teacher_losses(base, window, recency, layout, weights(1.0), AttentionTarget())
    weight = (recency - full_nll[:, T - H :]).clamp(min=0) + LONG_RANGE_FLOOR  # [B, H]
    attention = sum(m.sum(1) for m in matrices)  # [B, T, T]: every layer and head
    token_mass = torch.einsum("bh,bht->bt", weight, attention[:, T - H :])
    nodes = system.nodes
    expected = torch.stack(
        [token_mass[:, s : s + w].sum(-1) for s, w in zip(nodes.start.tolist(), nodes.span.tolist(), strict=True)], -1
    )
    torch.testing.assert_close(mass, expected, atol=1e-5, rtol=1e-5)
    assert float(token_mass[:, : T - H].sum()) > 0 and not torch.allclose(weight[:, 0], weight[:, 1])
