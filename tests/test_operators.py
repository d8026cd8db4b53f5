"""Counting the operators a warm refocus's choice launches (``mc_refocus_ops`` in ``train.bench --decode``)."""

from __future__ import annotations

import pytest
import torch
from builders import VOCAB, decisive, make_system, spread_lens

from mcfn.bench.operators import OperatorCount, warm_refocus_operators
from mcfn.core.focus import Refocus
from mcfn.core.policy import LENS
from mcfn.core.stream_view import refocus_budget
from mcfn.inference.streaming import StreamingTree, focused_context


def test_the_count_is_the_operators_dispatched_and_their_results_pass_through():
    a = torch.arange(3.0)
    with OperatorCount() as ops:
        b = torch.cat([a, a * 2 + 1]).sum()
    assert ops.count == 4  # mul, add, cat, sum
    assert float(b) == 3.0 + 9.0


def test_counting_a_warm_refocus_leaves_its_context_as_generation_gets_it():
    """The counted refocuses choose the contexts the uncounted ones do (the count watches, it does not change them),
    a count is the same twice, and a warm refocus launches fewer operators than the cold one it follows (one
    allocator step from the previous context against four from the coarsest cut)."""
    system = decisive(make_system(64, 4, 2, 32, 8, N=2, seed=3)).eval()
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(0))
    counts = warm_refocus_operators(system, ids, 200, 4, refocuses=3)
    assert counts == warm_refocus_operators(system, ids, 200, 4, refocuses=3) and min(counts) > 0
    stream, protocol, budget = StreamingTree(system, ids.device), Refocus(4), refocus_budget(system.layout, 4)
    stream.append(ids[:200])
    with OperatorCount() as cold:
        counted = focused_context(system, stream, budget, LENS, protocol)
    assert cold.count > max(counts)
    plain = focused_context(system, stream, budget, LENS, protocol)
    for at in (200, 204, 208):
        stream.append(ids[at : at + 4])
        with OperatorCount():
            counted = focused_context(system, stream, budget, LENS, protocol, counted)
        plain = focused_context(system, stream, budget, LENS, protocol, plain)
        torch.testing.assert_close(counted.start, plain.start)
        torch.testing.assert_close(counted.lod, plain.lod)


@pytest.mark.heavy(40)
def test_a_compiled_warm_refocus_launches_a_fifth_of_the_eager_ones_operators_kernels_counted(fresh_dynamo):
    """Compiled (inductor), the choice is one graph: a warm refocus launches at most 100 operators, its kernels
    among them (the count sees inside the graph), against the eager choice's hundreds. Fails if the kernels went
    uncounted (a graph compiled without their records is refused) or the choice fell back to eager operators. The
    cold refocus before the counted ones runs eagerly here: it is not counted, and its graph, which inductor would
    take as long again to build, is compiled in ``test_compiled_decoding_is_one_graph_and_decodes_what_eager_does``."""
    from mcfn.core.step import compile_step

    def warm_compiled(fn):
        compiled = compile_step(fn, mode="default")
        return lambda *args: fn(*args) if args[-1] is None else compiled(*args)  # the last: the previous context

    system = spread_lens(decisive(make_system(64, 4, 2, 32, 8, N=2, seed=3)), seed=4).eval()
    ids = torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(0))
    eager = warm_refocus_operators(system, ids, 1200, 4, refocuses=2)
    compiled = warm_refocus_operators(system, ids, 1200, 4, 2, warm_compiled)
    assert max(compiled) <= 100 and 5 * max(compiled) < min(eager), (compiled, eager)
