"""A streaming refocus's choice as one fixed-shape graph, compiled once per shape.

Eagerly a refocus's choice is hundreds of small operators, and compiled as it stands it would recompile at nearly
every refocus: the view's layout (:func:`~mcfn.core.stream_view.stream_view`) changes its ``T`` every ``K^L`` tokens
while a history grows, and its tail ``H`` and budget ``W`` at every refocus. So the view is laid in a **capacity**
(:func:`capacity_of`): its length rounded up to a power of two of top-level blocks, at most the longest view the
budget allows (:func:`longest_view`), the tokens added being phantoms after the newest one, like the view's own: in the
tail, shown at LOD0 and paid for by the budget they raise. The view's tail, budget and length are tensors (``where``;
:meth:`~mcfn.core.nodes.NodeTable.fixed`, and the scorers' ``scale``). Every node the capacity adds lies over the
tail: never eligible, never a candidate, so the allocator makes the view's own cut. The block view keeps a fixed
width, the most entries a view of the capacity gives it before its phantoms (:func:`block_view_width`): the phantoms
past them stay outside it, and score 0 as padding does, as the view's own phantoms do (I11).

:func:`choose` is then the whole choice: the scores, the previous context carried over and shrunk within budget, the
allocator's steps, and the context the cut gives, fixed-width (valid entries first). :class:`FocusChoice` runs it for
one stream, compiled (one graph per capacity and step count: a history meets ``log2`` of its longest view's
blocks, plus one, capacities over its whole life, ten at the default layout, and one or two in any 200 refocuses past
the first few thousand tokens) or eagerly on the view's own length; a test holds both to
:func:`~mcfn.core.focus.focus_cut`'s cut, the evaluation's. Its compiled calls run under a recompile limit that
holds every graph its streams can need (:func:`choice_graphs`): dynamo's default of 8 a function stopped a stream
grown from a short prompt to 32k tokens at its ninth shape (LABLOG, forty-first session).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import numpy
import torch
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.context import WorkingContext
from mcfn.core.focus import Refocus, chosen_context, chosen_cut, valid_prefix
from mcfn.core.nodes import Layout, NodeTable
from mcfn.core.policy import FocusPolicy
from mcfn.core.stream_view import StreamView, stream_view, view_blocks
from mcfn.core.system import MegaContext
from mcfn.core.tree import Tree
from mcfn.inference.streaming import LaidView, StreamingTree
from mcfn.typecheck import typechecked


def longest_view(layout: Layout, budget: int) -> int:
    """The longest ``T`` of a view of ``layout`` within ``budget`` over any history (:func:`stream_view`): its
    :func:`~mcfn.core.stream_view.view_blocks` whole top-level blocks. A test holds it to a scan."""
    return layout.top_span * view_blocks(layout, budget)


def capacity_of(view: StreamView, layout: Layout, budget: int) -> int:
    """The ``T`` a view is laid in: its own rounded up to a power of two of top-level blocks, at most the longest
    view: never twice the view, and few shapes over a history's life (even steps of the longest view would lay a
    16k history of the GPU layout, whose longest view is 902,144 tokens, in 150,528)."""
    top = layout.top_span
    blocks = view.layout.T // top
    return min(top << (blocks - 1).bit_length(), longest_view(layout, budget))


def capacities(layout: Layout, budget: int) -> list[int]:
    """Every capacity :func:`capacity_of` lays a view of ``layout`` within ``budget`` in, over any history."""
    top, longest = layout.top_span, longest_view(layout, budget)
    return sorted({min(top << j, longest) for j in range((longest // top - 1).bit_length() + 1)})


def choice_graphs(layout: Layout, budget: int) -> int:
    """The graphs a stream's compiled choice can need over its life: at each capacity a cold refocus's (the first,
    or every one without warm steps) and a warm one's."""
    return 2 * len(capacities(layout, budget))


def block_view_width(capacity: Layout) -> int:
    """The most entries a view laid in ``capacity`` gives the block view before its phantoms: its eligible LOD1 gists
    cover at most ``T - H`` tokens, and its tail holds at most ``H + K - 1`` real ones (``H``: the system's tail)."""
    T, H, K = capacity.T, capacity.H, capacity.K
    return min(T, (T - H) // K + H + K - 1)


def capacity_layout(T: int, layout: Layout, budget: int) -> Layout:
    """The fixed layout of a capacity of ``T`` tokens: ``H`` the system's tail and ``W`` the refocus ``budget``,
    constants of the graph that size the block view and the context, and that no rule of the cut reads (the view's
    own come as tensors, :meth:`~mcfn.core.nodes.NodeTable.fixed`)."""
    return dataclasses.replace(layout, T=T, W=budget, N=0)


def view_where(view: StreamView) -> tuple[int, int, int, int]:
    """What :func:`choose` reads of a view, as one tensor's values: its real tokens, its origin, the first token of
    its tail (from the origin) and its length ``T``."""
    return view.real, view.origin, view.layout.T - view.layout.H, view.layout.T


@typechecked
def choose(
    system: MegaContext,
    policy: FocusPolicy,
    capacity: Layout,
    reach: int,
    steps: int,
    emb: Float[Tensor, "1 nodes d"],
    window: Int[Tensor, "1 t1"],
    where: Int[Tensor, "4"],
    previous: WorkingContext | None,
) -> WorkingContext:
    """One refocus of a view laid in ``capacity`` (its tree ``emb``, its tokens ``window``; ``where``:
    :func:`view_where`): ``policy``'s cut (:func:`~mcfn.core.focus.chosen_cut`, ``steps`` allocator steps, warm from
    ``previous``, the last refocus's answer, where given) and its context ``[1, W]`` (``capacity.W``: the refocus
    budget), valid entries first, starts and positions absolute (:func:`~mcfn.core.focus.chosen_context`).
    ``reach``: the predictions a cut serves. No host sync and fixed shapes: :class:`FocusChoice` compiles it whole."""
    real, origin, tail_start, length = where.unbind()
    view_budget = torch.clamp(capacity.W + capacity.T - real, max=capacity.T)  # the view's W, raised by its phantoms
    nodes = NodeTable.of(capacity, emb.device).fixed(tail_start, view_budget)
    tree = Tree(emb=emb, batch_size=[1])
    scorer = policy.scorer(system, window, capacity, reach, length)
    cut = chosen_cut(scorer, tree, window, nodes, (real - 1)[None], origin, steps, previous, block_view_width(capacity))
    return chosen_context(tree, cut, window, nodes, real, origin, capacity.W)


# The graphs each kind of compiled choice made in this process may need (choice_graphs): every choice runs the code of
# ``choose``, whose graphs dynamo counts together against its recompile limit.
GRAPHS: dict[tuple, int] = {}


def graphs_allowed() -> contextlib.AbstractContextManager:
    """Dynamo's recompile limit raised to the graphs of every kind of compiled choice made (:data:`GRAPHS`)."""
    return torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, sum(GRAPHS.values())))


class FocusChoice:
    """A scored policy's refocuses of one stream under ``protocol`` within ``budget`` entries: :func:`choose` on the
    view laid in its capacity, compiled by ``compile_fn`` (stepped capacities, one graph each) or eagerly (the view's
    own length). It keeps its last fixed-width answer for the next warm start."""

    def __init__(
        self,
        system: MegaContext,
        policy: FocusPolicy,
        protocol: Refocus,
        budget: int,
        compile_fn: Callable[[Callable], Callable] | None = None,
    ):
        assert policy.scored, f"the {policy.name} policy does not score a view"
        self.system, self.policy, self.protocol, self.budget = system, policy, protocol, budget
        self.choose = choose if compile_fn is None else compile_fn(choose)
        self.stepped = compile_fn is not None
        self.answer: WorkingContext | None = None  # [1, budget]: the last refocus's context, padded
        self.laid: LaidView | None = None  # the stream's view, its rows written as they arrive
        self.shapes: set[tuple[int, int, bool]] = set()  # (capacity, steps, warm): the graphs called
        if compile_fn is not None:  # each (system, policy, budget, protocol) compiled in this process has its graphs
            GRAPHS[(id(system), policy.name, budget, protocol)] = choice_graphs(system.layout, budget)
        self.compile_s = 0.0  # the calls that compiled a graph, their compilation included

    @torch.no_grad()
    def __call__(self, stream: StreamingTree) -> WorkingContext:
        """The context ``[1, m]`` over the stream's history now (valid entries only, as
        :func:`~mcfn.inference.streaming.focused_context` gives)."""
        layout = self.system.layout
        view = stream_view(len(stream), layout, self.budget)
        T = capacity_of(view, layout, self.budget) if self.stepped else view.layout.T
        capacity = capacity_layout(T, layout, self.budget)
        if self.laid is None or self.laid.stream is not stream:
            self.laid = LaidView(stream)
        tree, window = self.laid(view, capacity)
        # From numpy, the view's numbers become a tensor without an operator (a refocus's count is its operators).
        where = torch.from_numpy(numpy.array(view_where(view), dtype=numpy.int64)).to(window.device)
        previous = self.protocol.carried(self.answer)
        steps = self.protocol.steps_from(previous)
        self.shapes.add((T, steps, previous is not None))
        t0, compiled = time.perf_counter(), compiled_frames()
        args = (self.system, self.policy, capacity, self.protocol.every, steps, tree.emb, window, where, previous)
        with graphs_allowed():
            self.answer = self.choose(*args)
        self.compile_s += (time.perf_counter() - t0) if compiled_frames() > compiled else 0.0
        return valid_prefix(self.answer)


def compiled_frames() -> int:
    """Graphs dynamo has compiled in this process: a call that raises the count compiled (a shape seen first), one
    that leaves it reused a graph (a stream may meet the shapes another stream compiled)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
