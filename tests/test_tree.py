"""The summary tree when its LOD1 gists read the base model's hidden states (``mc.gist.source = "hidden"``)."""

from __future__ import annotations

import torch
from builders import STEP_WEIGHTS, VOCAB, decisive, make_system, random_batches
from compile_check import assert_one_graph_equals_eager
from hypothesis import given, settings
from hypothesis import strategies as st

from mcfn.core.system import history_tree, process_batch
from mcfn.core.tree import block_hidden

T, K, L, W, H = 64, 4, 2, 32, 8  # top-level blocks of 16 tokens; the tail's 8 tokens lie in the last one


def hidden_system():
    system = decisive(make_system(T, K, L, W, H, N=2, seed=5, gist={"source": "hidden"}))
    with torch.no_grad():  # GistNet's output projection starts at zero: make what it reads show in the gist
        torch.nn.init.normal_(system.gistnet.out_proj.weight, std=0.5)
    return system


def lod1(system, tokens: torch.Tensor) -> torch.Tensor:
    """The eligible LOD1 gists ``[n, D]`` of one window."""
    layout = system.layout
    with torch.no_grad():
        emb = history_tree(system, tokens[None]).emb[0]
    return emb[layout.level_offsets[1] : layout.level_offsets[1] + layout.eligible_counts[1]]


@settings(max_examples=30, deadline=None)
@given(position=st.integers(0, T - 1), seed=st.integers(0, 2**16))
def test_property_hidden_gists_read_only_their_own_top_level_block_up_to_their_end(position: int, seed: int):
    """Changing one token changes exactly the LOD1 gists whose top-level block holds it at or after their own
    block's start: the gist over the token itself and the later ones of its top-level block (the base reads
    each top-level block causally, on its own). Nothing before it, nothing in another top-level block."""
    system = hidden_system()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (T,), generator=g)
    changed = tokens.clone()
    changed[position] = (tokens[position] + 1 + torch.randint(0, VOCAB - 1, (), generator=g)) % VOCAB
    before, after = lod1(system, tokens), lod1(system, changed)
    moved = (before - after).abs().amax(-1) > 1e-6
    top = K**L
    block = torch.arange(moved.size(0))
    expected = (block * K // top == position // top) & ((block + 1) * K > position)
    assert torch.equal(moved, expected), (position, moved.tolist(), expected.tolist())


def test_block_hidden_is_the_base_over_each_top_level_block_on_its_own():
    system = hidden_system()
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
    features = block_hidden(system.base, tokens, 16)
    for b in range(2):
        for start in range(0, T, 16):
            want = system.base.token_hidden(tokens[b : b + 1, start : start + 16])[0]
            torch.testing.assert_close(features[b, start : start + 16], want, atol=1e-5, rtol=1e-5)


def test_hidden_features_train_gistnet_not_the_base_blocks():
    """The features are detached: a loss on the gists reaches GistNet and the token embeddings (the gists'
    anchor), never the base model's transformer blocks."""
    system = hidden_system().train()
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(2))
    history_tree(system, tokens).emb.square().sum().backward()
    blocks = [p.grad for p in system.base.blocks.parameters()]
    assert all(grad is None or not grad.any() for grad in blocks)
    assert system.gistnet.in_proj.weight.grad.abs().sum() > 0
    assert system.base.wte.weight.grad.abs().sum() > 0


def test_the_step_with_hidden_gists_is_one_graph_equal_to_eager(fresh_dynamo):
    system = make_system(T=32, K=4, L=2, W=16, H=8, N=2, gist={"source": "hidden"})
    batches = [(system, window, noise, STEP_WEIGHTS) for window, noise in random_batches(system, 3)]
    assert_one_graph_equals_eager(
        process_batch, batches, loss=lambda out: out.total(), params=system.gistnet.parameters()
    )
