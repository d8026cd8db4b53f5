"""Optimizers and the learning-rate schedule.

Muon (torch's own) for the 2-D matrices inside the blocks; AdamW for the embedding and the head, whose
rows are looked up or read out one token at a time and do not suit orthogonalised updates. Learning
rates live in the param groups as 0-d tensors updated in place, so nothing that changes during training
is a Python number baked into a graph.
"""

from __future__ import annotations

import torch
from torch import nn

from mcfn.config import OptimConfig

EMBEDDINGS = ("wte.weight", "level_emb")  # looked up by index: AdamW at the embedding rate
HEADS = ("lm_head.weight",)  # read out one vocabulary row per token: AdamW at the unembedding rate


def build_optimizers(model: nn.Module, cfg: OptimConfig) -> list[torch.optim.Optimizer]:
    """Muon for every 2-D matrix inside the networks; AdamW for embeddings and the output head."""
    embeddings, heads, matrices = [], [], []
    for name, p in model.named_parameters():
        if name.endswith(EMBEDDINGS):
            embeddings.append(p)
        elif name.endswith(HEADS):
            heads.append(p)
        elif p.ndim == 2:
            matrices.append(p)
        else:
            raise ValueError(f"no optimizer rule for parameter {name} of shape {tuple(p.shape)}")
    lr = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    muon = torch.optim.Muon(matrices, lr=lr(cfg.matrix_lr), weight_decay=cfg.weight_decay)
    fused = heads[0].is_cuda
    adamw = torch.optim.AdamW(
        [{"params": embeddings, "lr": lr(cfg.embedding_lr)}, {"params": heads, "lr": lr(cfg.unembedding_lr)}],
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.weight_decay,
        fused=fused,
        foreach=False if not fused else None,
    )
    optimizers = [muon, adamw]
    for opt in optimizers:
        for group in opt.param_groups:
            group["base_lr"] = float(group["lr"])
    return optimizers


def lr_multiplier(step: int, total: int, cfg: OptimConfig) -> float:
    """Linear warmup, constant, then linear warmdown to ``final_lr_frac`` at the last step."""
    warmup = round(cfg.warmup_frac * total)
    warmdown = round(cfg.warmdown_frac * total)
    if step < warmup:
        return (step + 1) / warmup
    if warmdown > 0 and step >= total - warmdown:
        progress = (step - (total - warmdown) + 1) / warmdown
        return 1.0 - progress * (1.0 - cfg.final_lr_frac)
    return 1.0


def set_lr_multiplier(optimizers: list[torch.optim.Optimizer], mult: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"].fill_(group["base_lr"] * mult)
