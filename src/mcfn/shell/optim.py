"""Optimizers and the learning-rate schedule.

Muon (torch's own) for the 2-D matrices inside the blocks; AdamW for the embedding and the head, whose
rows are looked up or read out one token at a time and do not suit orthogonalised updates, and for the
attention heads' scalar gains. Learning rates live in the param groups as 0-d tensors updated in place, so
nothing that changes during training is a Python number baked into a graph.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mcfn.config import OptimConfig


class Float32Muon(torch.optim.Muon):
    """torch's Muon with its Newton–Schulz orthogonalisation in fp32 instead of bf16, for the CPU.

    ``torch.optim.Muon`` casts every update to bf16 for the iteration. On a CPU without bf16 matrix
    units that is emulated, and the optimizer step then costs more than the compiled forward and backward
    (BENCHMARKS.md, "Muon on the CPU"). Everything else is torch's Muon:
    param groups, hyperparameters, the ``momentum_buffer`` state and so the checkpoint format.
    GPUs keep torch's own implementation.
    """

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (a, b, c), momentum = float(group["lr"]), group["ns_coefficients"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - momentum)
                update = (p.grad.lerp(buf, momentum) if group["nesterov"] else buf).float()
                tall = update.size(0) > update.size(1)
                x = update.T if tall else update
                x = x / x.norm().clamp(min=group["eps"])  # spectral norm at most 1
                for _ in range(group["ns_steps"]):
                    gram = x @ x.T
                    x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
                x = x.T if tall else x
                rows, cols = p.shape
                if group["adjust_lr_fn"] == "match_rms_adamw":
                    scale = 0.2 * max(rows, cols) ** 0.5
                else:  # torch's default, "original"
                    scale = max(1.0, rows / cols) ** 0.5
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(x.to(p.dtype), alpha=-lr * scale)
        return loss


EMBEDDINGS = ("wte.weight", "level_emb", "lod_emb", "offset_emb")  # looked up by index: AdamW at the embedding rate
HEADS = ("lm_head.weight", "lensnet.head.weight")  # read-out rows: AdamW at the unembedding rate
GAINS = ("attn.gain", "attn.key_mix")  # per-head scalars (attention gains, key smears): AdamW at the gain rate
GAIN_LR = 0.02
ADAM_BETAS = (0.8, 0.95)
FINAL_LR_FRAC = 0.05  # the learning-rate multiplier the warmdown reaches at the last step


def build_optimizers(model: nn.Module, cfg: OptimConfig) -> list[torch.optim.Optimizer]:
    """Muon for every 2-D matrix inside the networks (fp32 orthogonalisation off CUDA); AdamW for embeddings,
    the output heads and the attention gains."""
    embeddings, heads, gains, matrices = [], [], [], []
    for name, p in model.named_parameters():
        if name.endswith(EMBEDDINGS):
            embeddings.append(p)
        elif name.endswith(HEADS):
            heads.append(p)
        elif name.endswith(GAINS):
            gains.append(p)
        elif p.ndim == 2:
            matrices.append(p)
        else:
            raise ValueError(f"no optimizer rule for parameter {name} of shape {tuple(p.shape)}")
    lr = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    fused = heads[0].is_cuda
    muon_cls = torch.optim.Muon if fused else Float32Muon
    muon = muon_cls(matrices, lr=lr(cfg.matrix_lr), weight_decay=0.0)
    adamw = torch.optim.AdamW(
        [
            {"params": embeddings, "lr": lr(cfg.embedding_lr)},
            {"params": heads, "lr": lr(cfg.unembedding_lr)},
            {"params": gains, "lr": lr(GAIN_LR)},
        ],
        betas=ADAM_BETAS,
        weight_decay=0.0,
        fused=fused,
        foreach=False if not fused else None,
    )
    optimizers = [muon, adamw]
    for opt, names in zip(optimizers, (["matrix"], ["embedding", "unembedding", "gain"]), strict=True):
        for group, name in zip(opt.param_groups, names, strict=True):
            group["base_lr"] = float(group["lr"])
            group["name"] = name  # logged as train/lr/<name>
    return optimizers


def current_lrs(optimizers: list[torch.optim.Optimizer], mult: float) -> dict[str, float]:
    return {f"train/lr/{g['name']}": g["base_lr"] * mult for opt in optimizers for g in opt.param_groups}


def lr_multiplier(step: int, total: int, cfg: OptimConfig) -> float:
    """Constant, then a linear warmdown to :data:`FINAL_LR_FRAC` at the last step (no warmup: Muon does not need
    one at these sizes)."""
    warmdown = round(cfg.warmdown_frac * total)
    if warmdown > 0 and step >= total - warmdown:
        progress = (step - (total - warmdown) + 1) / warmdown
        return 1.0 - progress * (1.0 - FINAL_LR_FRAC)
    return 1.0


def set_lr_multiplier(optimizers: list[torch.optim.Optimizer], mult: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"].fill_(group["base_lr"] * mult)


GRAD_CLIP = 1.0  # the largest gradient norm of LensNet's parameters, and of the rest's


def clip_gradients(model: nn.Module, clip: float = GRAD_CLIP) -> tuple[Tensor, Tensor]:
    """Clip LensNet's gradient and the rest's (base model, GistNet, decoder) to ``clip`` each, and return the
    joint norm and LensNet's, both before clipping. One joint clip would couple them: LensNet's loss is a policy
    objective of its own, and a gradient spike there (its pair-level term sums over whole contexts, norms of
    20-100 against the rest's 1-2) would scale the base model's step down with it (measured: LABLOG)."""
    lens, rest = [], []
    for name, p in model.named_parameters():
        (lens if name.startswith("lensnet.") else rest).append(p)
    norms = [nn.utils.clip_grad_norm_(group, clip) for group in (rest, lens) if group]
    lens_norm = norms[1] if len(norms) > 1 else torch.zeros_like(norms[0])
    return torch.stack(norms).square().sum().sqrt(), lens_norm
