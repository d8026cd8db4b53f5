"""One shared check for compiled code (I10): one graph with ``fullgraph=True``, no recompile after the first
call, and the same outputs (and gradients) as eager. Compile tests call it instead of writing the loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._pytree import keystr, tree_flatten_with_path


def tensor_leaves(out: Any) -> dict[str, torch.Tensor]:
    """Every tensor in a nested output (StepOutput, tuples, dicts), by its path."""
    leaves, _ = tree_flatten_with_path(out)
    return {keystr(path): leaf.detach() for path, leaf in leaves if isinstance(leaf, torch.Tensor)}


@dataclass(frozen=True)
class CountingCompile:
    """The compile function of every compile test: ``fullgraph=True, dynamic=False`` (a graph break raises) on a
    backend that counts the frames it compiles. Pass it where the product takes a ``compile_fn``."""

    counter: CompileCounterWithBackend

    def __call__(self, fn: Callable) -> Callable:
        return torch.compile(fn, backend=self.counter, fullgraph=True, dynamic=False)

    @staticmethod
    def forbid_recompiles() -> None:
        """From now on a recompile raises (call it once every shape has been compiled)."""
        torch.compiler.set_stance("fail_on_recompile")


@contextmanager
def one_graph(backend: str = "aot_eager", functions: int = 1) -> Iterator[CountingCompile]:
    """A :class:`CountingCompile` for the block's compiled code; on leaving it, exactly one frame was compiled for
    each of the ``functions`` compiled (no graph break, no recompile), and the compiler's stance is back to its
    default. Use inside ``fresh_dynamo``."""
    compile_fn = CountingCompile(CompileCounterWithBackend(backend))
    try:
        yield compile_fn
    finally:
        torch.compiler.set_stance("default")
    frames = compile_fn.counter.frame_count
    assert frames == functions, f"{frames} frames for {functions} functions: a graph break or a recompile"


def run_once(fn: Callable, args: Sequence, loss: Callable[[Any], torch.Tensor] | None, params: list) -> tuple:
    for p in params:
        p.grad = None
    out = fn(*args)
    if loss is not None:
        loss(out).backward()  # outside the compiled region
    return tensor_leaves(out), [p.grad.clone() if p.grad is not None else None for p in params]


def assert_one_graph_equals_eager(
    fn: Callable,
    batches: Iterable[Sequence],
    *,
    backend: str = "aot_eager",
    loss: Callable[[Any], torch.Tensor] | None = None,
    params: Iterable[torch.nn.Parameter] = (),
    against_eager: bool = True,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> None:
    """``fn`` compiled (``fullgraph=True, dynamic=False``) on each argument tuple of ``batches``: the same tensors
    as eager, and with ``loss`` the same gradients on ``params``; recompiling after the first batch fails, and
    exactly one frame is compiled. Run it inside the ``fresh_dynamo`` fixture."""
    params = list(params)
    with one_graph(backend) as compile_fn:
        compiled = compile_fn(fn)
        for i, args in enumerate(batches):
            got, got_grads = run_once(compiled, args, loss, params)
            if against_eager:
                want, want_grads = run_once(fn, args, loss, params)
                assert got.keys() == want.keys()
                for key, value in want.items():
                    torch.testing.assert_close(got[key], value, atol=atol, rtol=rtol, msg=key)
                for a, b in zip(got_grads, want_grads, strict=True):
                    assert (a is None) == (b is None)
                    if a is not None:
                        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
            if i == 0:
                compile_fn.forbid_recompiles()
