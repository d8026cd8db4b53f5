"""How many operators a refocus's choice launches: the count a refocus compiled into one graph brings down.

On a GPU the choice is launch-bound (61 ms of a 106 ms refocus on the H100 at 131,072 tokens, BENCHMARKS), so its
cost follows the number of operators it launches more than their arithmetic. :class:`OperatorCount` counts them from
the profiler's record: every ATen operator called outside any other (a composite's own calls are part of it) and
every kernel of a compiled graph (inductor's C++ kernels record themselves where ``cpp.enable_kernel_profile`` was on
when they were compiled, which :func:`counted_kernels` switches on; its Triton kernels' launches always do).
:func:`warm_refocus_operators` counts them for each warm refocus of a growing history, as generation runs it
(:class:`~mcfn.inference.choice.FocusChoice`, eager or compiled). A dispatch mode cannot count a graph: dynamo runs
a compiled function eagerly under one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch._inductor.config as inductor_config
from jaxtyping import Int
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from mcfn.core.focus import Refocus
from mcfn.core.policy import LENS
from mcfn.core.stream_view import refocus_budget
from mcfn.core.system import MegaContext
from mcfn.inference.choice import FocusChoice
from mcfn.inference.streaming import StreamingTree
from mcfn.typecheck import typechecked

# How a compiled graph's kernels appear to the profiler: inductor's C++ kernels ("graph_0_cpp_fused_..."), its Triton
# kernels on a GPU, each launch recorded under its name ("triton_poi_fused_...").
KERNEL_PREFIXES = ("graph_", "triton_")


def is_kernel(name: str) -> bool:
    return name.startswith(KERNEL_PREFIXES)


def is_operator(name: str) -> bool:
    return name.startswith("aten::") or is_kernel(name)


def launched(events) -> list[str]:
    """The operators among the profiler's ``events``, by name: each ATen operator or compiled kernel with no operator
    above it (what a composite or a kernel calls inside is its own work)."""
    names = []
    for event in events:
        if not is_operator(event.name):
            continue
        above = event.cpu_parent
        while above is not None and not is_operator(above.name):
            above = above.cpu_parent
        if above is None:
            names.append(event.name)
    return names


class OperatorCount:
    """Within ``with OperatorCount() as ops:``, ``ops.count`` is, on leaving, the number of operators launched, and
    ``ops.kernels`` how many of them are compiled kernels."""

    def __enter__(self) -> OperatorCount:
        self.count = self.kernels = 0
        self.profile = profile(activities=[ProfilerActivity.CPU])
        self.profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.profile.__exit__(*exc)
        names = launched(self.profile.events())
        self.count, self.kernels = len(names), sum(map(is_kernel, names))


@contextmanager
def counted_kernels() -> Iterator[None]:
    """Graphs compiled in the block record each of their C++ kernels, so that :class:`OperatorCount` sees them."""
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        yield


@torch.no_grad()
@typechecked
def warm_refocus_operators(
    system: MegaContext,
    ids: Int[Tensor, " n"],
    prompt_tokens: int,
    refocus_every: int,
    refocuses: int,
    compile_fn: Callable[[Callable], Callable] | None = None,
) -> list[int]:
    """The operators of each of ``refocuses`` warm refocuses' choice (the view, its tree, ``lens``'s cut and the
    context it gives: :class:`~mcfn.inference.choice.FocusChoice`, compiled by ``compile_fn`` where given) after a
    cold one over the first ``prompt_tokens`` of ``ids``, the history growing by ``refocus_every`` of the tokens that
    follow (from the start of ``ids`` again where they run out), as generation's refocuses see it. Compiled, the same
    refocuses run once uncounted first, so that every graph they need is compiled before the count."""

    def run(counted: bool) -> list[int]:
        stream, protocol = StreamingTree(system, ids.device), Refocus(refocus_every)
        choice = FocusChoice(system, LENS, protocol, refocus_budget(system.layout, refocus_every), compile_fn)
        stream.append(ids[:prompt_tokens])
        choice(stream)
        counts = []
        for i in range(refocuses):
            at = (prompt_tokens + i * refocus_every) % max(1, ids.numel() - refocus_every)
            stream.append(ids[at : at + refocus_every])
            with OperatorCount() if counted else nullcontext() as ops:
                choice(stream)
            # On the CPU a graph's kernels are seen only where it was compiled within counted_kernels(); a GPU's
            # Triton launches are recorded as they are made (unverified here: no GPU).
            if counted and compile_fn is not None and ops.kernels == 0 and ids.device.type == "cpu":
                raise RuntimeError("the choice's graphs were compiled outside counted_kernels(): no kernel is seen")
            counts.append(ops.count if counted else 0)
        assert not counted or choice.compile_s == 0.0, "a counted refocus compiled a graph"
        return counts

    with counted_kernels():
        if compile_fn is not None:
            run(counted=False)
        return run(counted=True)
