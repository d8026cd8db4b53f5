"""The indexer recall: per chunk, the share of the far blocks full attention reads most that a cut shows at LOD0."""

from __future__ import annotations

import torch
from builders import make_system

from mcfn.evaluation.indexer_recall import TOP, IndexerRecall, chunk_recall

T, K, H, R, W = 64, 4, 8, 4, 24


def block_mass(blocks: dict[int, float]) -> torch.Tensor:
    """``[T]`` attention over tokens: ``mass`` spread evenly over each listed block's ``K`` tokens."""
    out = torch.zeros(T)
    for block, mass in blocks.items():
        out[block * K : (block + 1) * K] = mass / K
    return out


def showing(layout, blocks: list[int]) -> torch.Tensor:
    """A node mask ``[nodes]`` showing the given blocks' tokens at LOD0 (and nothing else)."""
    cut = torch.zeros(layout.n_nodes, dtype=torch.bool)
    for block in blocks:
        cut[block * K : (block + 1) * K] = True
    return cut


def test_recall_counts_the_far_blocks_full_attention_reads_most_leaving_out_the_sink_and_the_near_past():
    layout = make_system(T, K, 2, W, H, N=2, refocus_every=R).layout
    near = W - R
    attention = torch.zeros(H, T)
    # chunk 0 (horizon 56): far blocks are 1..8; its top 4 there are 2, 5, 7 and 8; the sink (block 0) and the
    # near block 12 draw more, and count for nothing
    attention[:4] = block_mass({0: 9.0, 12: 8.0, 2: 4.0, 5: 3.0, 7: 2.0, 8: 1.5, 3: 0.5})
    # chunk 1 (horizon 60): far blocks 1..9; its top 4 are 9, 1, 3 and 4
    attention[4:] = block_mass({9: 4.0, 1: 3.0, 3: 2.0, 4: 1.0, 6: 0.1})
    chunk = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    cuts = [showing(layout, [2, 5, 8, 3, 12, 13]), showing(layout, [9, 6, 13])]  # the sink's block not shown
    assert TOP == 4
    assert chunk_recall(attention, chunk, cuts, layout, near, R) == [0.75, 0.25]
    assert chunk_recall(attention, chunk, [showing(layout, list(range(16)))] * 2, layout, near, R) == [1.0, 1.0]
    assert chunk_recall(attention, chunk, [showing(layout, [12, 13, 14, 15])] * 2, layout, near, R) == [0.0, 0.0]
    # a chunk left unscored (-1) is not counted; nor is a chunk without far blocks (W as large as the history)
    assert chunk_recall(attention, torch.tensor([-1] * 4 + [1] * 4), cuts, layout, near, R) == [0.25]
    assert chunk_recall(attention, chunk, cuts, layout, T, R) == []


def test_the_summary_is_the_mean_over_windows_with_its_error_and_none_without_any():
    summary = IndexerRecall.of({"match": [0.5, 1.0, 0.0], "lens": [1.0, 1.0, 1.0]})
    assert summary.windows == 3
    mean, se = summary.by_policy["match"]
    assert mean == 0.5 and abs(se - 0.5 / 3**0.5) < 1e-12
    assert summary.to_json()["lens"] == {"recall": 1.0, "se": 0.0}
    assert IndexerRecall.of({"match": []}) is None and IndexerRecall.of({}) is None


def test_truncations_recall_is_zero_with_attention_on_both_sides_of_the_boundary():
    """Truncation's cut at a chunk's horizon ``h`` shows tokens ``[h + 1 - (W - R), h]`` (and the chunk's own): its
    recall is 0 by definition, here with all of the chunk's attention on the newest far block and the block just
    after it, which truncation shows in part or whole, for every place of the boundary within a block (``W - R``
    from 20 to 23). For a boundary a token or a block off, truncation's figure is not 0 or the newest far block goes
    uncounted."""
    layout = make_system(T, K, 2, W, H, N=2, refocus_every=R).layout
    chunk = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    node = torch.arange(layout.n_nodes)
    for near in range(20, 24):
        attention = torch.zeros(H, T)
        truncation, newest_only = [], []
        for c in range(2):
            horizon = T - H + R * c
            newest_far = (horizon + 1 - near) // K - 1  # the newest block wholly before the kept tokens
            attention[chunk == c] = block_mass({newest_far: 1.0, newest_far + 1: 3.0})
            truncation.append((node >= horizon + 1 - near) & (node < T))
            newest_only.append(showing(layout, [newest_far]))
        assert chunk_recall(attention, chunk, truncation, layout, near, R) == [0.0, 0.0], near
        assert chunk_recall(attention, chunk, newest_only, layout, near, R) == [0.25, 0.25], near  # 1 of TOP
