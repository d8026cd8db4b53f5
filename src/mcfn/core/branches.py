"""One focus policy in branches (issue 90), as NSA joins a sliding window, selected blocks and compressed blocks: the
newest tokens raw (the view's tail, and the tokens read after the cut), LensNet's most confident picks at full
detail, ``match``'s copy votes for the rest of the budget, and gists wherever nothing asks for detail.

LensNet answers the pass key, the template it was trained on, and reads text worse than ``match``, which misses the
key (LABLOG, thirty-third session). So the picks are few and sure: of LensNet's :data:`PICKS` highest far entries of
the block view, those :data:`SURE_Z` standard deviations above the row's far entries lead the allocator (a score above
any ``match`` score), and ``match``'s order settles the rest. A key's six or seven tokens straddle two blocks of
eight more often than not, so each pick also leads the far entry after it; the leads rank by LensNet's own
confidence, so that when they outgrow the far budget the surest picks are the last to go (led by ``match``'s votes,
the key's own block fell back to a gist). Chosen on the validation windows of five runs (three stdlib seeds, C++, Vim;
LABLOG, forty-second session): against two picks at 2.5 led by the votes, text no worse anywhere and 375 keys
answered against 370.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from mcfn.core.context import WorkingContext
from mcfn.core.lensnet import row_moments
from mcfn.typecheck import typechecked

PICKS = 3  # LensNet's picks a cut may show in detail before match's votes (chosen on validation: LABLOG)
SURE_Z = 3.0  # a pick leads only this many standard deviations above its row's far entries (chosen on validation)
LEAD = 1e4  # a lead's score, plus its z: above any match score (votes of at most 32 queries, a prior in (-1, 0])


@typechecked
def branch_scores(
    learned: Float[Tensor, "r w"],
    votes: Float[Tensor, "r w"],
    wc: WorkingContext,
    picks: int = PICKS,
    sure_z: float = SURE_Z,
) -> Float[Tensor, "r w"]:
    """Scores ``[R, W]`` of the block view ``wc``'s entries (in text order): ``match``'s ``votes``, but where a lead
    stands. The leads are the ``picks`` far entries (gists: the tail's tokens are raw whatever they score) that
    LensNet scores highest (``learned``) which stand more than ``sure_z`` standard deviations above the mean of the
    row's far entries, and the far entry after each; a lead scores :data:`LEAD` plus its own z (its standard
    deviations above that mean), so leads rank by LensNet's confidence."""
    far = wc.valid & (wc.lod > 0)
    mean, spread = row_moments(learned, far)
    z = (learned - mean) / torch.where(spread > 0, spread, 1.0)
    sure = far & (z > sure_z) & (spread > 0)
    top = torch.where(far, learned, float("-inf")).topk(min(picks, learned.size(1)), -1).indices
    picked = torch.zeros_like(far).scatter(1, top, True) & sure
    led = picked | (F.pad(picked[:, :-1], (1, 0)) & far)
    return torch.where(led, LEAD + z, votes)
