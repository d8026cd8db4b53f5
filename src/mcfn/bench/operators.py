"""How many operators a refocus's choice launches: the count a refocus compiled into one graph brings down.

On a GPU the choice is launch-bound (61 ms of a 106 ms refocus on the H100 at 131,072 tokens, BENCHMARKS), so its
cost follows the number of operators it dispatches more than their arithmetic. :class:`OperatorCount` counts the
ATen operators that reach the dispatcher (after composite operators decompose: the ones that run a kernel), and
:func:`warm_refocus_operators` counts them for each warm refocus of a growing history, as generation runs it.
"""

from __future__ import annotations

import torch
from jaxtyping import Int
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from mcfn.core.focus import Refocus, refocus_budget
from mcfn.core.policy import LENS
from mcfn.core.system import MegaContext
from mcfn.inference.streaming import StreamingTree, focused_context
from mcfn.typecheck import typechecked


class OperatorCount(TorchDispatchMode):
    """Within ``with OperatorCount() as ops:``, ``ops.count`` is the number of ATen operators dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
@typechecked
def warm_refocus_operators(
    system: MegaContext, ids: Int[Tensor, " n"], prompt_tokens: int, refocus_every: int, refocuses: int
) -> list[int]:
    """The operators of each of ``refocuses`` warm refocuses' choice (the view, its tree and ``lens``'s cut:
    :func:`~mcfn.inference.streaming.focused_context`) after a cold one over the first ``prompt_tokens`` of ``ids``,
    the history growing by ``refocus_every`` of the tokens that follow (from the start of ``ids`` again where they
    run out), as generation's refocuses see it."""
    stream, protocol = StreamingTree(system, ids.device), Refocus(refocus_every)
    budget = refocus_budget(system.layout, refocus_every)
    stream.append(ids[:prompt_tokens])
    context = focused_context(system, stream, budget, LENS, protocol)
    counts = []
    for i in range(refocuses):
        at = (prompt_tokens + i * refocus_every) % max(1, ids.numel() - refocus_every)
        stream.append(ids[at : at + refocus_every])
        with OperatorCount() as ops:
            context = focused_context(system, stream, budget, LENS, protocol, context)
        counts.append(ops.count)
    return counts
