"""Priority sampling of the random variants (issue 93): a variant that prefers ``match``'s blocks expands them first
and leaves them out last, the rest explore, the step compiles whole with it; and each kind of variant's share of
``loss_lm``."""

from __future__ import annotations

import pytest
import torch
from builders import STEP_WEIGHTS, VOCAB, make_system
from compile_check import assert_one_graph_equals_eager
from hypothesis import given
from hypothesis import strategies as st

from mcfn.core.losses import loss_shares
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.preferences import node_min_lod
from mcfn.core.system import build_contexts, process_batch
from mcfn.core.variants import compressed_cuts, draw_variant_noise, voted_first, voted_nodes
from mcfn.geometry import coarsest_cover_size

CPU = torch.device("cpu")


def drawn(layout: Layout, batch: int, seed: int, vote_share: float = 0.3):
    """A batch's noise and random votes on about ``vote_share`` of its LOD1 blocks."""
    g = torch.Generator().manual_seed(seed)
    noise = draw_variant_noise(layout, batch, g, CPU)
    return noise, (torch.rand(batch, layout.T // layout.K, generator=g) < vote_share).float()


# Trees where a variant has choices to make: budgets between the coarsest cover and most of the history, tails short
# of it, several blocks at each level (the invariant suites' shapes, many of which fit every expansion, say little).
choosing = st.builds(
    lambda K, T, H, spare, N: dict(T=T, K=K, L=2, W=min(T - K, coarsest_cover_size(T, K, 2, H) + spare), H=H, N=N),
    K=st.sampled_from([2, 4]), T=st.sampled_from([64, 128]), H=st.sampled_from([4, 8, 16]),
    spare=st.integers(2, 40), N=st.integers(1, 3),
)  # fmt: skip


@given(choosing, st.integers(1, 4), st.integers(0, 2**16))
def test_property_a_preferring_variant_expands_voted_nodes_first_and_leaves_them_out_last(shape, batch, seed):
    """At every level, where a variant that prefers (share 1) expands an unvoted eligible node, it expands every
    voted one it could (its parent expanded); where it leaves out a voted top-level block, it leaves out every
    unvoted one. With share 0 the cuts are those of the noise as drawn."""
    layout = Layout(**shape)
    nodes = NodeTable.of(layout)
    noise, votes = drawn(layout, batch, seed)
    voted = voted_nodes(votes, layout)[:, None].expand(-1, layout.N, -1)
    assert torch.equal(compressed_cuts(voted_first(noise, voted[:, 0], 0.0), nodes), compressed_cuts(noise, nodes))
    shown = compressed_cuts(voted_first(noise, voted[:, 0], 1.0), nodes)
    finest = node_min_lod(shown, nodes)
    expanded, covered = finest < nodes.lod, finest <= layout.L
    for k in range(1, layout.L + 1):
        parent = nodes.level(nodes.parent, k).clamp(min=0)
        parent_open = expanded[..., parent] if k < layout.L else nodes.level(covered, k)
        candidate = nodes.level(nodes.eligible, k) & parent_open
        at = lambda x, k=k: nodes.level(x, k)  # noqa: E731
        unvoted_taken = (candidate & ~at(voted) & at(expanded)).any(-1)
        voted_left = (candidate & at(voted) & ~at(expanded)).any(-1)
        assert not (unvoted_taken & voted_left).any(), f"level {k}: an unvoted node expanded before a voted one"
    top = nodes.level(nodes.eligible, layout.L)
    left_out = top & ~nodes.level(covered, layout.L)
    voted_top = nodes.level(voted, layout.L)
    assert not ((left_out & voted_top).any(-1) & (top & ~voted_top & ~left_out).any(-1)).any()


def test_the_share_leaves_the_rest_to_explore():
    """At share 0.5 about half the variants prefer (the others' cuts are the noise's own), and two variants that
    both prefer still differ where the votes leave them a choice."""
    layout = Layout(T=256, K=4, L=2, W=96, H=32, N=3)
    nodes = NodeTable.of(layout)
    noise, votes = drawn(layout, 400, seed=3, vote_share=0.2)
    preferring = noise.prefer < 0.5
    assert 0.45 < preferring.float().mean() < 0.55
    plain, ruled = (
        compressed_cuts(noise, nodes),
        compressed_cuts(voted_first(noise, voted_nodes(votes, layout), 0.5), nodes),
    )
    assert torch.equal(ruled[~preferring], plain[~preferring]) and not torch.equal(ruled, plain)
    both = preferring[:, 0] & preferring[:, 1]
    assert (ruled[both, 0] != ruled[both, 1]).any(-1).float().mean() > 0.5


def test_each_kinds_share_of_the_loss_is_its_nll_over_the_whole():
    """Against a loop over rows: the baseline (slot 0), the random slots and the allocator's (the last ones)."""
    layout = Layout(T=16, K=4, L=1, W=8, H=4, N=3)
    rows, width = 2 * layout.V, 8
    g = torch.Generator().manual_seed(0)
    nll = torch.rand(rows, width, generator=g)
    valid = torch.rand(rows, width, generator=g) < 0.7
    shares = loss_shares(nll, valid, layout, allocated=1)
    sums = [0.0] * 3
    for r in range(rows):
        slot = r % layout.V
        kind = 0 if slot == 0 else (2 if slot == layout.V - 1 else 1)
        sums[kind] += float((nll[r] * valid[r]).sum())
    total = sum(sums)
    for kind, value in zip(("recency", "random", "allocator"), sums, strict=True):
        assert shares[f"mc/loss_share/{kind}"].item() == pytest.approx(value / total, rel=1e-5)


def copying_windows(layout: Layout, batch: int, seed: int) -> torch.Tensor:
    """Windows whose second half repeats a span of the first: ``match`` votes on the span's blocks."""
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (batch, layout.T + 1), generator=g)
    half = layout.T // 2
    window[:, half : half + half // 2] = window[:, 8 : 8 + half // 2]
    return window


@pytest.mark.heavy(10)
def test_the_step_with_priority_sampling_is_one_graph_equal_to_eager(fresh_dynamo):
    system = make_system(T=64, K=4, L=2, W=32, H=16, N=3, voted_share=1.0)
    g = torch.Generator().manual_seed(2)
    batches = []
    for i in range(2):
        window = copying_windows(system.layout, 2, i)
        batches.append((system, window, draw_variant_noise(system.layout, 2, g, CPU), STEP_WEIGHTS))
    _, shown, _ = build_contexts(system, *batches[0][1:3])
    plain = make_system(T=64, K=4, L=2, W=32, H=16, N=3)
    assert not torch.equal(shown, build_contexts(plain, *batches[0][1:3])[1]), "the votes moved no random variant"
    assert_one_graph_equals_eager(process_batch, batches, loss=lambda out: out.total(), params=system.parameters())
