"""``mc.gist.grad_blocks``: the tree's values without a gradient, GistNet rerun with one on a bounded set of blocks."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, make_system
from compile_check import one_graph
from hypothesis import given
from hypothesis import strategies as st

from mcfn.config import GistConfig, MCConfig
from mcfn.core.nodes import Layout
from mcfn.core.system import history_tree, process_batch
from mcfn.core.tree import gradient_blocks, sparse_gradient_bites, with_sparse_gradient
from mcfn.core.variants import draw_variant_noise
from mcfn.core.weights import LossWeights

SHAPE = {"T": 32, "K": 4, "L": 2, "W": 16, "H": 8, "N": 1}  # six eligible LOD1 blocks, one LOD2 block


def setup(grad_blocks: int, seed: int = 0):
    system = make_system(**SHAPE, seed=seed, gist={"recon_weight": 1.0, "grad_blocks": grad_blocks})
    with torch.no_grad():  # a GistNet that is not the plain mean, so its gradient has work to do
        system.gistnet.out_proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    window = torch.randint(0, VOCAB, (2, SHAPE["T"] + 1), generator=torch.Generator().manual_seed(seed))
    return system, window


def read_only(layout: Layout, b: int, node: int) -> torch.Tensor:
    read = torch.zeros(b, layout.n_nodes, dtype=torch.bool)
    read[:, node] = True
    return read


def sparse_tree(system, window, picks):
    tokens = system.base.embed(window[:, : system.layout.T])
    with torch.no_grad():
        values = history_tree(system, window[:, : system.layout.T])
    return with_sparse_gradient(system.gistnet, tokens, values, system.layout, picks)


def grads_of(system, loss) -> list[torch.Tensor]:
    system.zero_grad(set_to_none=True)
    loss.backward()
    params = [*system.gistnet.parameters(), system.base.wte.weight]
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


def test_the_values_are_the_exact_trees():
    system, window = setup(2)
    layout = system.layout
    picks = gradient_blocks(read_only(layout, 2, layout.level_offsets[2]), layout, 2)
    exact = history_tree(system, window[:, : layout.T])
    torch.testing.assert_close(sparse_tree(system, window, picks).emb, exact.emb)


def test_a_read_gists_gradient_is_exact_when_its_subtree_fits_and_stops_where_it_does_not():
    """A loss on the one LOD2 gist (16 tokens under 4 LOD1 gists): with 4 blocks a level its children are chosen
    before any other block and every gradient equals the exact tree's; with 2 it is not, and GistNet reruns
    on no more than 2 blocks a level and sequence."""
    system, window = setup(4)
    layout = system.layout
    top = layout.level_offsets[2]
    exact = grads_of(system, history_tree(system, window[:, : layout.T]).emb[:, top].square().sum())
    picks = gradient_blocks(read_only(layout, 2, top), layout, 4)
    assert sorted(picks[0][0].tolist()) == [0, 1, 2, 3], "the read gist's children come first"
    got = grads_of(system, sparse_tree(system, window, picks).emb[:, top].square().sum())
    for a, b in zip(got, exact, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    rows: list[int] = []
    hook = system.gistnet.register_forward_hook(lambda mod, args, out: rows.append(out.shape[0]))
    picks = gradient_blocks(read_only(layout, 2, top), layout, 2)
    cut = grads_of(system, sparse_tree(system, window, picks).emb[:, top].square().sum())
    hook.remove()
    assert rows[-2:] == [2 * 2, 2 * 1], f"blocks rerun with a gradient, per level: {rows[-2:]}"
    assert not all(torch.allclose(a, b, atol=1e-5) for a, b in zip(cut, exact, strict=True))


@given(
    grad_blocks=st.integers(1, 16),
    b=st.integers(1, 3),
    density=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_property_gradient_blocks_choose_read_gists_then_their_children(grad_blocks, b, density, seed):
    """Each level gets ``min(n_k, m)`` distinct eligible blocks, by priority: a block some working context reads
    first, then a child of a block chosen a level up, then any. No block left out outranks a chosen one."""
    layout = make_system(**{**SHAPE, "T": 64, "H": 8, "L": 2}).layout
    g = torch.Generator().manual_seed(seed)
    read = torch.rand(b, layout.n_nodes, generator=g) < density
    torch.manual_seed(seed)
    picks = gradient_blocks(read, layout, grad_blocks)
    for k in range(layout.L, 0, -1):
        n, lo, pick = layout.eligible_counts[k], layout.level_offsets[k], picks[k - 1]
        assert pick.shape == (b, min(n, grad_blocks))
        for row in range(b):
            chosen = set(pick[row].tolist())
            assert len(chosen) == pick.size(1) and all(0 <= j < n for j in chosen)
            parents = set(picks[k][row].tolist()) if k < layout.L else set()
            rank = [2 * int(read[row, lo + j]) + int(j // layout.K in parents) for j in range(n)]
            left_out = [rank[j] for j in range(n) if j not in chosen]
            assert not left_out or max(left_out) <= min(rank[j] for j in chosen), (k, rank, sorted(chosen))


def test_the_bound_bites_only_where_a_level_holds_more_blocks():
    layout = make_system(**SHAPE).layout  # six eligible LOD1 blocks
    assert not sparse_gradient_bites(layout, 0) and not sparse_gradient_bites(layout, 6)
    assert sparse_gradient_bites(layout, 5)


def weights() -> dict[str, torch.Tensor]:
    return LossWeights.of(MCConfig(gist=GistConfig(recon_weight=1.0)), torch.device("cpu"))


@pytest.mark.heavy(31)
def test_the_bounded_step_has_the_exact_steps_losses_and_compiles_to_one_graph_equal_to_eager(fresh_dynamo):
    """The step's losses are the exact step's (only the gradient is bounded), and the bounded step compiles to one
    graph with no recompile whose losses and gradients equal eager's from the same seed."""
    exact, window = setup(0)
    system, _ = setup(2)
    noise = draw_variant_noise(system.layout, 2, torch.Generator().manual_seed(3), torch.device("cpu"))
    torch.manual_seed(0)
    want = process_batch(exact, window, noise, weights()).losses
    torch.manual_seed(0)
    got = process_batch(system, window, noise, weights()).losses
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-4, msg=key)

    w = weights()

    def loss(window, noise):
        return process_batch(system, window, noise, w).total()

    g = torch.Generator().manual_seed(5)
    with one_graph() as compile_fn:
        compiled = compile_fn(loss)
        for i in range(3):
            window = torch.randint(0, VOCAB, (2, SHAPE["T"] + 1), generator=g)
            noise = draw_variant_noise(system.layout, 2, g, torch.device("cpu"))
            runs = []
            for fn in (compiled, loss):
                torch.manual_seed(i)
                runs.append(grads_of(system, fn(window, noise)))
            for a, b in zip(*runs, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
            assert any(float(grad.abs().sum()) > 0 for grad in runs[0][:-1]), "GistNet learns in the bounded step"
            if i == 0:
                compile_fn.forbid_recompiles()
