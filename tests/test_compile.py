"""Compile discipline for the plain step: fullgraph, no recompiles, and equal to eager."""

import pytest
import torch
import torch._dynamo
from compile_check import assert_one_graph_equals_eager

from mcfn.config import ModelConfig
from mcfn.core.model import GPT
from mcfn.core.step import nll_and_bytes, plain_step

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _model(key_smear: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=128, key_smear=key_smear))
    for block in model.blocks:  # non-zero output projections, so every path carries gradient
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.05)
        torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.05)
    return model


def _windows(shape: tuple[int, int], n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, shape, generator=g) for _ in range(n)]


@pytest.mark.heavy(30)
@pytest.mark.parametrize("key_smear", [False, True])
def test_compiled_step_equals_eager_and_never_recompiles(key_smear):
    """One graph for the whole step (no graph break, no recompile), the same loss and gradients as eager; with the
    key smear too."""
    model = _model(key_smear)
    batches = [(model, window) for window in _windows((3, 17), 4)]
    assert_one_graph_equals_eager(
        plain_step, batches, backend="inductor", loss=lambda out: out.total(), params=model.parameters(), rtol=1e-5
    )


def test_compiled_eval_has_one_graph():
    model = _model()
    token_bytes = torch.randint(0, 4, (128,), dtype=torch.int32)
    with torch.no_grad():
        batches = [(model, window, token_bytes) for window in _windows((2, 9), 3)]
        assert_one_graph_equals_eager(nll_and_bytes, batches, backend="inductor", atol=1e-4, rtol=1e-5)


def test_the_shared_check_catches_a_graph_break_and_a_recompile():
    def branches_on_a_value(x):
        return x * 2 if x.sum() > 0 else x  # data-dependent control flow: a graph break

    def scales(x, factor: int):
        return x * factor  # a new Python int is a new constant: a recompile

    x = torch.ones(3)
    with pytest.raises(Exception, match="(?i)data-dependent|graph break|unsupported"):
        assert_one_graph_equals_eager(branches_on_a_value, [(x,)])
    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?i)recompil"):
        assert_one_graph_equals_eager(scales, [(x, 2), (x, 3)])
