"""One focus policy in branches (issue 90), as NSA joins a sliding window, selected blocks and compressed blocks: the
newest tokens raw (the view's tail, and the tokens read after the cut), LensNet's most confident picks at full
detail, ``match``'s copy votes for the rest of the budget, and gists wherever nothing asks for detail.

LensNet answers the pass key, the template it was trained on, and reads text worse than ``match``, which misses the
key (LABLOG, thirty-third session). So the picks are few: LensNet's :data:`PICKS` highest far entries of the block
view lead the allocator (a score above any ``match`` score), and ``match``'s order settles the rest.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from mcfn.core.context import WorkingContext
from mcfn.core.lensnet import row_moments
from mcfn.typecheck import typechecked

PICKS = 2  # LensNet's picks a cut may show in detail before match's votes (chosen on validation: LABLOG)
SURE_Z = 2.5  # a pick leads only this many standard deviations above its row's far entries (chosen on validation)
LEAD = 1e4  # added to a pick's score: above any match score (votes of at most 32 queries, a prior in (-1, 0])


@typechecked
def branch_scores(
    learned: Float[Tensor, "r w"],
    votes: Float[Tensor, "r w"],
    wc: WorkingContext,
    picks: int = PICKS,
    sure_z: float = SURE_Z,
) -> Float[Tensor, "r w"]:
    """Scores ``[R, W]`` of the block view ``wc``'s entries: ``match``'s ``votes``, with those of the ``picks`` far
    entries (gists: the tail's tokens are raw whatever they score) that LensNet scores highest (``learned``) which
    stand more than ``sure_z`` standard deviations above the mean of the row's far entries leading them."""
    far = wc.valid & (wc.lod > 0)
    mean, spread = row_moments(learned, far)
    sure = far & (learned - mean > sure_z * spread) & (spread > 0)
    top = torch.where(far, learned, float("-inf")).topk(min(picks, learned.size(1)), -1).indices
    picked = torch.zeros_like(far).scatter(1, top, True) & sure
    return torch.where(picked, votes + LEAD, votes)
