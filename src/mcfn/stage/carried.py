"""Labels over two chunks: each single edit of LensNet's cut carried forward, as generation carries a context.

At a traced state (chunk ``c``, history ``n``), an edit changes the context the chunk's predictions are read with;
generation then refocuses warm from that context at the next chunk, so an edit's effect outlasts its chunk. An edit's
two-chunk label is its ΔNLL over chunk ``c``'s predictions (the traced label's) and over chunk ``c + 1``'s, where
its context was carried into the next refocus (LensNet's, warm as the protocol says) against the policy's own
carried context there (the traced state at ``c + 1``). The per-prediction labels ``[e, k + k']`` feed the split-half
reliability (:mod:`mcfn.stage.reliability`) as the single edits' ``[e, k]`` do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mcfn.core.context import Scorer
from mcfn.core.focus import Refocus, focus_cut, view_context
from mcfn.core.policy import LENS
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.evaluation.chunks import chunk_predictions, chunk_view
from mcfn.evaluation.counterfactual import State


def scored_once(scorer: Scorer) -> Scorer:
    """``scorer``, run on its first call only: every warm refocus of one view scores the same block view (the scores
    read the view, never the carried context), so the edits' refocuses share one LensNet pass."""
    kept: list[Tensor] = []

    def score(wc):
        if not kept:
            kept.append(scorer(wc))
        return kept[0]

    return score


@torch.no_grad()
def carried_delta_by_token(
    system: MegaContext, tree: Tree, window: Tensor, protocol: Refocus, state: State, following: State
) -> Tensor:
    """``[e, k + k']``: each edit of ``state`` (a chunk of the window ``tree [1, n_nodes, D]``, ``window [1, T + 1]``)
    by prediction, its chunk's ΔNLL and then the next chunk's (``following``, the traced state there), where the
    edit's context was carried into LensNet's warm refocus against the policy's own carried one."""
    assert following.n == state.n + protocol.every, "the following state is the next chunk's"
    nodes = system.nodes
    here = chunk_view(tree, window, nodes, state.n, protocol.every)
    there = chunk_view(tree, window, nodes, following.n, protocol.every)
    scorer = scored_once(LENS.scorer(system, there.window, there.view.layout, protocol.every))
    cuts = []
    for shown in state.labelled.edits.shown:
        carried = protocol.carried(view_context(here.tree, shown[None, None], here.window, here.view))
        cuts.append(focus_cut(scorer, there.tree, there.window, there.view, protocol.steps_from(carried), carried))
    nll = chunk_predictions(system, tree, there.window_cut(torch.cat(cuts))[None, :, 0], window, there)[0][0]
    policy = following.labelled.cuts_by_token[0]  # the policy's own carried cut: the first whole cut traced
    return torch.cat([state.labelled.delta_by_token, policy[None] - nll], -1)
