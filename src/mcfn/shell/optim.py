"""Optimizers and the learning-rate schedule.

Muon (torch's, batched over same-shape matrices) for the 2-D matrices inside the blocks; fused AdamW for the
embedding and the head, whose rows are looked up or read out one token at a time and do not suit orthogonalised
updates, and for the attention heads' scalar gains. A non-finite step is skipped on the device (no host sync).
Learning rates live in the param groups as 0-d tensors updated in place, so nothing that changes during training
is a Python number baked into a graph.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mcfn.config import OptimConfig


class BatchedMuon(torch.optim.Muon):
    """torch's Muon, stepping every matrix of one shape at once: one batched Newton–Schulz iteration per shape
    instead of one per matrix, so an update is a few dozen kernels, not thousands (on a GPU torch's per-matrix loop
    is launch-bound: BENCHMARKS.md). Everything else is torch's Muon: param groups, hyperparameters, the
    ``momentum_buffer`` state and so the checkpoint format.

    ``ns_dtype``: the iteration's dtype, bf16 as torch's on a GPU, fp32 on a CPU (bf16 matrix products are
    emulated there, and then the update costs more than the forward and backward: BENCHMARKS.md, "Muon on the
    CPU"). ``found_inf`` (a 0-d tensor on the parameters' device, or None), as torch's fused AdamW reads it: where
    it is nonzero the step changes neither the parameters nor the momentum, decided on the device, no host sync.
    """

    def __init__(self, params, ns_dtype: torch.dtype, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.found_inf: Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_shape: dict[torch.Size, list[Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault(p.shape, []).append(p)
            for params in by_shape.values():
                self.step_matrices(params, group)
        return loss

    def step_matrices(self, params: list[Tensor], group: dict) -> None:
        """One update of ``k`` same-shape matrices ``[r, c]``, stacked ``[k, r, c]``."""
        lr, (a, b, c), momentum = float(group["lr"]), group["ns_coefficients"], group["momentum"]
        for p in params:  # not setdefault: its default would allocate a zero matrix at every step
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        found_inf = torch.zeros((), device=params[0].device) if self.found_inf is None else self.found_inf
        keep = found_inf == 0
        # A non-finite gradient reaches nothing: zeroed, the momentum kept as it was, the step and decay nought.
        grad, buf = torch.where(keep, torch.stack([p.grad for p in params]), 0.0), torch.stack(bufs)
        buf = torch.where(keep, buf.lerp(grad, 1 - momentum), buf)
        torch._foreach_copy_(bufs, list(buf.unbind(0)))
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        rows, cols = params[0].shape
        x = update.to(self.ns_dtype)
        x = x.mT if rows > cols else x
        x = x / torch.linalg.matrix_norm(x, keepdim=True).clamp(min=group["eps"])  # spectral norm at most 1
        for _ in range(group["ns_steps"]):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        x = x.mT if rows > cols else x
        if group["adjust_lr_fn"] == "match_rms_adamw":
            scale = 0.2 * max(rows, cols) ** 0.5
        else:  # torch's default, "original"
            scale = max(1.0, rows / cols) ** 0.5
        if group["weight_decay"]:
            torch._foreach_mul_(params, torch.where(keep, 1 - lr * group["weight_decay"], 1.0))
        torch._foreach_add_(params, list((x.to(params[0].dtype) * torch.where(keep, -lr * scale, 0.0)).unbind(0)))


EMBEDDINGS = ("wte.weight", "level_emb", "lod_emb", "offset_emb")  # looked up by index: AdamW at the embedding rate
HEADS = ("lm_head.weight", "lensnet.head.weight")  # read-out rows: AdamW at the unembedding rate
GAINS = ("attn.gain", "attn.key_mix")  # per-head scalars (attention gains, key smears): AdamW at the gain rate
GAIN_LR = 0.02
MATRIX_LR = 0.02  # Muon's rate for the 2-D block matrices (0.03 lost on the slowest seed: LABLOG, twenty-third session)
ADAM_BETAS = (0.8, 0.95)
FINAL_LR_FRAC = 0.05  # the learning-rate multiplier the warmdown reaches at the last step


def build_optimizers(model: nn.Module, cfg: OptimConfig) -> list[torch.optim.Optimizer]:
    """Muon for every 2-D matrix inside the networks (batched; fp32 orthogonalisation off CUDA); fused AdamW for
    embeddings, the output heads and the attention gains."""
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
    ns_dtype = torch.bfloat16 if heads[0].is_cuda else torch.float32
    muon = BatchedMuon(matrices, ns_dtype, lr=lr(MATRIX_LR), weight_decay=0.0)
    adamw = torch.optim.AdamW(
        [
            {"params": embeddings, "lr": lr(cfg.embedding_lr)},
            {"params": heads, "lr": lr(cfg.unembedding_lr)},
            {"params": gains, "lr": lr(GAIN_LR)},
        ],
        betas=ADAM_BETAS,
        weight_decay=0.0,
        fused=True,  # one kernel a step, on the CPU too; it reads found_inf (skip_if_non_finite)
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


def skip_if_non_finite(optimizers: list[torch.optim.Optimizer], loss: Tensor, grad_norm: Tensor) -> Tensor:
    """Make the next step of every optimizer a no-op on the device when the loss or the gradient norm is not
    finite, without reading either back; returns that flag (0-d bool). Both optimizers read ``found_inf``: fused
    AdamW as torch's gradient scaler sets it, :class:`BatchedMuon` likewise."""
    bad = ~torch.isfinite(loss.float() + grad_norm.float())
    for opt in optimizers:
        opt.found_inf = bad.float()  # type: ignore[attr-defined]
    return bad


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
