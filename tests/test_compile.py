"""Compile discipline for the plain step: fullgraph, no recompiles, and equal to eager."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from mcfn.config import ModelConfig
from mcfn.core.model import GPT
from mcfn.core.step import nll_and_bytes, plain_step

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=128))
    for block in model.blocks:  # non-zero output projections, so every path carries gradient
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.05)
        torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.05)
    return model


def _grads(model: GPT, fn, window: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = fn(model, window).total()
    loss.backward()  # outside the compiled region
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_compiled_step_equals_eager_and_never_recompiles():
    model = _model()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(plain_step, backend=counter, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        window = torch.randint(0, 128, (3, 17), generator=g)
        loss_c, grads_c = _grads(model, compiled, window)
        loss_e, grads_e = _grads(model, plain_step, window)
        torch.testing.assert_close(loss_c, loss_e, atol=1e-5, rtol=1e-5)
        for gc, ge in zip(grads_c, grads_e, strict=True):
            torch.testing.assert_close(gc, ge, atol=1e-5, rtol=1e-4)
        if i == 0:
            torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")
    assert counter.frame_count == 1  # one graph for the whole step: no graph break, no recompile


def test_compiled_eval_has_one_graph():
    model = _model()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(nll_and_bytes, backend=counter, fullgraph=True, dynamic=False)
    token_bytes = torch.randint(0, 4, (128,), dtype=torch.int32)
    for seed in range(3):
        window = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            nll_c, bytes_c = compiled(model, window, token_bytes)
            nll_e, bytes_e = nll_and_bytes(model, window, token_bytes)
        torch.testing.assert_close(nll_c, nll_e, atol=1e-4, rtol=1e-5)
        assert int(bytes_c) == int(bytes_e)
    assert counter.frame_count == 1
