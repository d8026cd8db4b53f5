"""Per-layer key/value gists (``mc.gist.carrier = "kv"``): what the tree pools, and how the base model reads it."""

from __future__ import annotations

import pytest
import torch
from compile_check import assert_one_graph_equals_eager
from einops import rearrange
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mc import STEP_WEIGHTS, VOCAB, _batches, decisive, make_system

from mcfn.core.context import assemble, context_hidden
from mcfn.core.model import causal_attention, with_gist_kv
from mcfn.core.system import history_tree, process_batch
from mcfn.core.tree import Tree, block_kv
from mcfn.core.variants import coarsest_cut
from mcfn.errors import UserError
from mcfn.inference.streaming import StreamingTree
from mcfn.tools.evaluation import zeroed_gists

T, K, L, W, H = 64, 4, 2, 32, 8  # top-level blocks of 16 tokens; the tail's 8 tokens lie in the last one
LAYERS = 2


def kv_system(seed: int = 5):
    return decisive(make_system(T, K, L, W, H, N=2, seed=seed, gist={"carrier": "kv"}, n_layer=LAYERS))


def window_of(seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T + 1), generator=torch.Generator().manual_seed(seed))


def captured_keys_values(system, wc) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The keys and values ``[r, h, n, e]`` each layer attends with over ``wc``."""
    seen = []

    def keep(layer, q, k, v):
        seen.append((k, v))
        return causal_attention(layer, q, k, v)

    system.base.hidden(wc.emb, wc.position, wc.span.float(), attend=with_gist_kv(keep, wc.kv, wc.lod > 0))
    return seen


def test_block_kv_is_each_top_level_block_read_on_its_own_at_its_true_positions():
    """The first top-level block's keys and values are the plain forward's over those 16 tokens; a later block's
    are a forward over its own tokens at positions from its start on (its keys carry those positions)."""
    system = kv_system()
    tokens = window_of(0, batch=2)[:, :T]
    kv = block_kv(system.base, tokens, 16)
    assert kv.shape == (2, T, LAYERS, 2, 2, 8)
    for b in range(2):
        for start in (0, 32):
            positions = torch.arange(start, start + 16, dtype=torch.float32)[None]
            block = tokens[b : b + 1, start : start + 16]
            seen = []
            system.base.hidden(
                system.base.embed(block),
                positions,
                torch.ones_like(positions),
                attend=lambda layer, q, k, v: seen.append((k, v)) or causal_attention(layer, q, k, v),
            )
            for layer, (k, v) in enumerate(seen):
                want = rearrange(torch.stack((k[0], v[0])), "two h s e -> s two h e")
                torch.testing.assert_close(kv[b, start : start + 16, layer], want, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(position=st.integers(0, T - 1), seed=st.integers(0, 2**16))
def test_property_pooled_kv_reads_only_its_own_top_level_block_up_to_its_end(position: int, seed: int):
    """Changing one token changes exactly the pooled keys and values of the LOD1 gists that end after it in its
    own top-level block: the base reads each top-level block causally, on its own."""
    system = kv_system()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (1, T), generator=g)
    changed = tokens.clone()
    changed[0, position] = (tokens[0, position] + 1 + torch.randint(0, VOCAB - 1, (), generator=g)) % VOCAB
    layout = system.layout
    lod1 = slice(layout.level_offsets[1], layout.level_offsets[1] + layout.eligible_counts[1])
    with torch.no_grad():
        before, after = (history_tree(system, t).kv[0, lod1] for t in (tokens, changed))
    moved = (before - after).flatten(1).abs().amax(-1) > 1e-6
    block = torch.arange(moved.size(0))
    expected = (block * K // 16 == position // 16) & ((block + 1) * K > position)
    assert torch.equal(moved, expected), (position, moved.tolist(), expected.tolist())


def test_a_gist_holds_the_mean_of_its_tokens_keys_and_values_and_an_ineligible_one_holds_zero():
    system = kv_system()
    layout = system.layout
    tokens = window_of(1)[:, :T]
    with torch.no_grad():
        kv = history_tree(system, tokens).kv[0]
    token_kv = kv[:T]
    torch.testing.assert_close(kv[layout.level_offsets[1] + 3], token_kv[12:16].mean(0))  # LOD1 block 3
    torch.testing.assert_close(kv[layout.level_offsets[2] + 1], token_kv[16:32].mean(0), atol=1e-6, rtol=1e-5)
    ineligible = layout.level_offsets[1] + layout.eligible_counts[1]
    assert not kv[ineligible : layout.level_offsets[2]].any()


def test_every_layer_reads_a_gist_through_its_pooled_keys_and_values_and_a_token_through_its_own():
    system = kv_system()
    window = window_of(2)
    with torch.no_grad():
        tree = history_tree(system, window[:, :T])
        wc = assemble(tree, coarsest_cut(system.layout, torch.device("cpu"))[None, None], window, system.nodes)
        seen = captured_keys_values(system, wc)
        plain = []
        system.base.hidden(
            wc.emb,
            wc.position,
            wc.span.float(),
            attend=lambda layer, q, k, v: plain.append(k) or causal_attention(layer, q, k, v),
        )
    gist = wc.lod[0] > 0
    assert gist.any() and (~gist).any()
    for layer, (k, v) in enumerate(seen):
        pooled = tree.kv[0, wc.node[0], layer]  # [w, 2, h, e]
        torch.testing.assert_close(rearrange(k[0], "h n e -> n h e")[gist], pooled[gist, 0])
        torch.testing.assert_close(rearrange(v[0], "h n e -> n h e")[gist], pooled[gist, 1])
    # A token's own keys in the first layer are those of its embedding (later layers read the swapped gists).
    torch.testing.assert_close(seen[0][0][0][:, ~gist], plain[0][0][:, ~gist])


def test_under_the_kv_carrier_no_entry_reads_a_gists_embedding_but_every_later_one_reads_its_kv():
    """Changing the gists' embeddings changes only the gists' own hidden states; changing one gist's pooled
    keys and values changes it and every valid entry after it, and nothing before it."""
    system = kv_system()
    window = window_of(3)
    with torch.no_grad():
        tree = history_tree(system, window[:, :T])
        cut = coarsest_cut(system.layout, torch.device("cpu"))[None, None]
        wc = assemble(tree, cut, window, system.nodes)
        base = context_hidden(system.base, wc)
        valid, gist = wc.valid[0], wc.lod[0] > 0
        emb = tree.emb.clone()
        emb[:, T:] += 1.0  # every gist's embedding, no token's
        other_emb = assemble(Tree(emb=emb, kv=tree.kv, batch_size=[1]), cut, window, system.nodes)
        moved = (context_hidden(system.base, other_emb) - base).abs().amax(-1)[0] > 1e-5
        assert torch.equal(moved[valid], gist[valid])
        newest_gist = int(torch.nonzero(gist)[-1])  # the newest gist: the entries before it must not move
        kv = tree.kv.clone()
        kv[0, wc.node[0, newest_gist]] += 1.0
        other_kv = assemble(Tree(emb=tree.emb, kv=kv, batch_size=[1]), cut, window, system.nodes)
        moved = (context_hidden(system.base, other_kv) - base).abs().amax(-1)[0] > 1e-5
    assert moved[newest_gist:][valid[newest_gist:]].all() and not moved[:newest_gist].any()


def test_zeroed_gists_zero_the_gists_pooled_keys_and_values_and_keep_the_tokens():
    system = kv_system()
    with torch.no_grad():
        tree = history_tree(system, window_of(4)[:, :T])
    ablated = zeroed_gists(tree, system.nodes)
    assert torch.equal(ablated.kv[:, :T], tree.kv[:, :T]) and tree.kv[:, T:].any()
    assert not ablated.kv[:, T:].any() and not ablated.emb[:, T:].any()


def test_the_step_with_kv_gists_is_one_graph_equal_to_eager(fresh_dynamo):
    system = make_system(T=32, K=4, L=2, W=16, H=8, N=2, gist={"carrier": "kv"}, n_layer=LAYERS)
    batches = [(system, window, noise, STEP_WEIGHTS) for window, noise in _batches(system, 3)]
    assert_one_graph_equals_eager(process_batch, batches, loss=lambda out: out.total(), params=system.base.parameters())


def test_streaming_generation_refuses_kv_gists_with_a_clear_error():
    with pytest.raises(UserError, match="mc.gist.carrier"):
        StreamingTree(kv_system(), torch.device("cpu"))
