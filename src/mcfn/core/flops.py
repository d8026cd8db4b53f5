"""Model FLOPs per training step (forward + backward) and model FLOPs utilisation on known GPUs.

The count is the usual estimate: ``6 · params · entries`` for the matrix multiplies of every network that
runs (base model, GistNet over eligible blocks, LensNet over the working contexts) plus ``6 · layers ·
n² · width`` per sequence of ``n`` for causal attention scores and values (twice that for bidirectional).
Embedding lookups cost nothing; the output head counts.
"""

from __future__ import annotations

from torch import nn

from mcfn.config import AUX_LAYERS, RunConfig
from mcfn.core.nodes import Layout
from mcfn.core.units import unit_capacity

# Dense bf16 peak, FLOP/s, by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H100": 989.5e12, "H200": 989.5e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


def _matmul_params(module: nn.Module) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if p.ndim == 2 and "wte" not in n)


def _transformer(params: int, layers: int, width: int, sequences: int, length: int, causal: bool) -> float:
    attention = 6 * layers * length * length * width * (1 if causal else 2)
    return sequences * (6.0 * params * length + attention)


def step_flops(cfg: RunConfig, model: nn.Module) -> float:
    """FLOPs of one optimizer step over the global batch."""
    B, T, m = cfg.train.batch_size, cfg.data.seq_len, cfg.model
    if not cfg.mc.enabled:
        return _transformer(_matmul_params(model), m.n_layer, m.n_embd, B, T, causal=True)
    layout = Layout.from_config(cfg)
    flops = _transformer(_matmul_params(model.base), m.n_layer, m.n_embd, B * layout.V, layout.W, causal=True)
    blocks = sum(layout.eligible_counts[k] for k in range(1, layout.L + 1))
    flops += _transformer(_matmul_params(model.gistnet), AUX_LAYERS, cfg.aux_width, B * blocks, layout.K, causal=False)
    if model.lensnet is not None:
        read = unit_capacity(layout.W, layout)
        flops += _transformer(
            _matmul_params(model.lensnet), AUX_LAYERS, cfg.aux_width, B * layout.V, read, causal=False
        )
    return flops


def peak_flops(device_name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16.items() if key in device_name), None)
