"""What keeping the KV cache at a refocus costs, scored through generation's own path (issue 101, item 1).

The evaluation (:mod:`mcfn.evaluation.refocused`) scores each chunk's context in one forward: the cache refilled in
full, what ``--reuse prefix`` decodes. Generation by default keeps every cached entry a refocus's new context still
holds, moved to its new slot (``--reuse moved``, :func:`~mcfn.inference.contexts.kept_slots`): its keys and values
at the layers above the first then read the context they were written in, not the new one. This measures the
difference on held-out windows: each window's first ``T - H + 1`` tokens are the prompt and its last ``H`` are fed
to :func:`~mcfn.inference.generation.teacher_forced_mc` (the decode loop itself, fed the text's tokens) under each
reuse, with the run's shipped policy and rule (:mod:`mcfn.evaluation.generated`); bits per byte of those ``H`` tokens,
paired by window, with the error by document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from mcfn.core.focus import Refocus
from mcfn.core.policy import FocusPolicy
from mcfn.core.system import MegaContext
from mcfn.evaluation.generated import generated_text
from mcfn.evaluation.held_out import HeldOut
from mcfn.inference.contexts import MOVED, PREFIX
from mcfn.inference.generation import teacher_forced_mc


@dataclass(frozen=True)
class ReuseCost:
    """Each reuse's bits per byte on the same windows and what its refocuses kept, and ``moved − prefix`` with its
    standard error by document (positive: keeping the moved entries costs text)."""

    windows: int
    documents: int
    bpb: dict[str, float]
    kept: dict[str, float]  # the share of context entries whose keys and values refocuses kept
    recomputed_per_refocus: dict[str, float]  # entries a refocus ran through the model, cold ones included
    cost: float
    cost_se: float


def reuse_cost(
    system: MegaContext,
    policy: FocusPolicy,
    refocus: Refocus,
    held: HeldOut,
    progress: Callable[[str], None] = lambda line: None,
) -> ReuseCost:
    """:class:`ReuseCost` of ``policy`` under ``refocus`` on every window of ``held`` (documents in ``held.docs``)."""
    first = system.layout.T - system.layout.H + 1  # the prompt: every token before the tail's H
    decoding = partial(teacher_forced_mc, system, refocus=refocus, policy=policy)
    decodings = {reuse: partial(decoding, reuse=reuse) for reuse in (PREFIX, MOVED)}
    text = generated_text(held, first, decodings, progress)
    gain = text.gain(MOVED, PREFIX)
    kept = {reuse: sum(s.reused_entries for s in text.stats[reuse]) for reuse in decodings}
    run = {reuse: sum(s.recomputed_entries for s in text.stats[reuse]) for reuse in decodings}
    refocuses = {reuse: sum(len(s.layouts) for s in text.stats[reuse]) for reuse in decodings}
    return ReuseCost(
        windows=text.windows,
        documents=text.clusters.documents,
        bpb={reuse: text.bpb(reuse) for reuse in decodings},
        kept={reuse: kept[reuse] / max(1, kept[reuse] + run[reuse]) for reuse in decodings},
        recomputed_per_refocus={reuse: run[reuse] / max(1, refocuses[reuse]) for reuse in decodings},
        cost=gain.bpb,
        cost_se=gain.se,
    )


def reuse_table(cost: ReuseCost) -> str:
    """The measurement as a markdown table, a row per reuse."""
    lines = ["| reuse | bpb | cache kept | entries run a refocus |", "| --- | ---: | ---: | ---: |"]
    for reuse in (PREFIX, MOVED):
        lines.append(f"| {reuse} | {cost.bpb[reuse]:.4f} | {cost.kept[reuse]:.0%} | "
                     f"{cost.recomputed_per_refocus[reuse]:.1f} |")  # fmt: skip
    lines.append(f"\n{MOVED} − {PREFIX}: {cost.cost:+.4f} ± {cost.cost_se:.4f} bpb (paired, {cost.windows} windows "
                 f"from {cost.documents} documents)")  # fmt: skip
    return "\n".join(lines)
