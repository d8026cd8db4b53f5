"""The counterfactual evaluator: what each single edit of LensNet's own cut is worth, under generation's protocol.

At a chunk's refocus (:mod:`mcfn.evaluation.chunks`: the view, ``focus_cut`` and the warm start that ``train.generate``
and the evaluation use), the state is the one LensNet itself reached: on-policy, warm from its previous chunk's
context. The candidates are LensNet's cut, every single legal edit of it (:func:`mcfn.core.edits.single_edits`),
``match``'s cut, ``recency`` and a few random cuts, all scored on the chunk's next-token NLLs in one packed forward
of the base model. An edit's label is its ΔNLL: the policy cut's mean NLL over the chunk's predictions minus the
edited cut's (> 0: the edit helps).

Nothing that builds a candidate reads past the chunk's horizon (I11): the view, the scores and the cuts come from
tokens ``[0, n)``; only the labels read the chunk's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mcfn.core.context import WorkingContext
from mcfn.core.edits import Edits, edit_worth, single_edits
from mcfn.core.focus import Refocus, focus_scores
from mcfn.core.policy import LENS, MATCH, RANDOM, RECENCY, FocusPolicy
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.evaluation.chunks import ChunkView, chunk_predictions, chunk_view, refocus_rows
from mcfn.evaluation.one_cut import stacked
from mcfn.evaluation.stats import spearman

EDITS = "edits"  # the slots of a state's single edits among the candidates scored in one forward
TRACED = (LENS.name, MATCH.name, RECENCY.name)  # the policies whose chunk NLL every traced state records


@dataclass(frozen=True)
class Labelled:
    """One state's edits (in the view's node ids), their ΔNLL, and every candidate's chunk NLL."""

    edits: Edits
    delta: Tensor  # [e]: the policy cut's chunk NLL minus each edit's (nats per prediction)
    nll: dict[str, Tensor]  # per candidate policy, [c] chunk NLLs (the labelled cut is the lens policy's)
    delta_by_token: Tensor  # [e, k]: the same for each of the chunk's k predictions (delta is their mean)
    cuts_by_token: Tensor  # [c, k]: the NLL of each whole cut (the policy's, then the others') at each prediction


def lens_view_scores(system: MegaContext, cv: ChunkView) -> Tensor:
    """LensNet's node scores ``[g, view_nodes]`` in the chunk's view, read up to its horizon (I11)."""
    return focus_scores(
        system.lensnet.scorer(cv.nodes.layout, cv.window, system.base), cv.tree, cv.window, cv.nodes, cv.horizon
    )


@torch.no_grad()
def label_edits(
    system: MegaContext,
    tree: Tree,
    window: Tensor,
    cv: ChunkView,
    policy: Tensor,
    scores: Tensor,
    others: dict[str, Tensor] | None = None,
) -> Labelled:
    """The edits of one row's ``policy`` cut ``[view_nodes]`` (chosen with ``scores [view_nodes]``) and their ΔNLL;
    ``others`` are further candidates ``[1, c, nodes]`` (cuts of the window) scored in the same forward. ``tree
    [1, n_nodes, D]`` and ``window [1, T + 1]`` are the row's; ``cv`` its view at the chunk."""
    edits = single_edits(policy, scores, cv.nodes)
    views = torch.cat([policy[None], edits.shown])
    cuts = cv.window_cut(views)
    shown, slots = stacked({LENS.name: cuts[None, :1], EDITS: cuts[None, 1:], **(others or {})})
    by_token = chunk_predictions(system, tree, shown, window, cv)[0][0]  # [S, k]
    nll = by_token.mean(-1)
    by_slot = {name: nll[where] for name, where in slots.items()}
    delta_by_token = by_token[slots[LENS.name]] - by_token[slots[EDITS]]
    whole = torch.cat([by_token[where] for name, where in slots.items() if name != EDITS])
    return Labelled(edits, by_slot[LENS.name] - by_slot.pop(EDITS), by_slot, delta_by_token, whole)


def utility_corr(labelled: Labelled, scores: Tensor) -> float:
    """The Spearman correlation of LensNet's predicted worth of each edit with its measured ΔNLL (NaN below three
    edits)."""
    worth = edit_worth(scores, labelled.edits.gain, labelled.edits.loss)
    return spearman(worth.double().cpu(), labelled.delta.double().cpu())


@dataclass(frozen=True)
class State:
    """One traced state: a window's chunk at history ``n``, its edits and labels."""

    window: int  # the window's index among the traced ones
    n: int
    labelled: Labelled
    utility_corr: float  # of the policy that made the state


@torch.no_grad()
def trace_window(
    system: MegaContext,
    tree: Tree,
    window: Tensor,
    protocol: Refocus,
    random_cuts: int,
    generator: torch.Generator,
    index: int = 0,
) -> list[State]:
    """Walk one window's tail (``tree [1, n_nodes, D]``, ``window [1, T + 1]``) under generation's protocol, LensNet
    and ``match`` each refocusing warm from its own previous context, and label every chunk's state."""
    layout, R = system.layout, protocol.every
    previous: dict[FocusPolicy, WorkingContext | None] = {LENS: None, MATCH: None}
    states = []
    for n in range(layout.T - layout.H + 1, layout.T + 1, R):
        cv = chunk_view(tree, window, system.nodes, n, R)
        cuts = {}
        for policy in previous:
            view_cuts, contexts = refocus_rows(
                system, policy, cv.tree, cv.window, cv.view, protocol, [previous[policy]]
            )
            previous[policy], cuts[policy] = contexts[0], view_cuts[0, 0]
        scores = lens_view_scores(system, cv)[0]
        truncation = RECENCY.refocus(system, cv.tree, cv.window, cv.view, protocol)[0]
        others = {
            MATCH.name: cv.window_cut(cuts[MATCH])[None, None],
            RECENCY.name: cv.window_cut(truncation),
            RANDOM.name: cv.window_cut(cv.random(random_cuts, 1, generator)),
        }
        labelled = label_edits(system, tree, window, cv, cuts[LENS], scores, others)
        states.append(State(index, n, labelled, utility_corr(labelled, scores)))
    return states
