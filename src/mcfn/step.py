"""The plain language-model step and bits-per-byte evaluation, as pure functions of model and batch.

A step returns named tensors: the ``loss_*`` terms, which the caller sums and backpropagates, and metrics,
which the shell reads only after the step. The same convention carries the MegaContext step.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.model import GPT
from mcfn.typecheck import typechecked


@typechecked
def split_window(window: Int[Tensor, "b t1"]) -> tuple[Int[Tensor, "b t"], Int[Tensor, "b t"]]:
    """A window of ``T + 1`` tokens → inputs ``[:T]`` and next-token targets ``[1:]``."""
    return window[:, :-1], window[:, 1:]


def plain_step(model: GPT, window: Tensor) -> dict[str, Tensor]:
    """Next-token loss of the plain GPT over ``[B, T + 1]`` windows (mean over all ``B·T`` targets)."""
    inputs, targets = split_window(window)
    nll = model.nll(model.token_hidden(inputs), targets)
    return {"loss_lm": nll.mean()}


def total_loss(out: dict[str, Tensor]) -> Tensor:
    return sum(v for k, v in out.items() if k.startswith("loss_"))


@typechecked
def byte_sums(
    nll: Float[Tensor, "r n"], targets: Int[Tensor, "r n"], token_bytes: Int[Tensor, " v"], mask: Tensor | None = None
) -> tuple[Float[Tensor, " r"], Int[Tensor, " r"]]:
    """Per row, summed NLL (nats) and summed bytes over the targets (within ``mask``) that stand for bytes:
    special tokens and padding (target -1) count for neither."""
    nbytes = token_bytes[targets.clamp(min=0)] * (targets >= 0 if mask is None else mask)
    return (nll * (nbytes > 0)).sum(-1), nbytes.sum(-1)


@typechecked
def nll_and_bytes(
    model: GPT, window: Int[Tensor, "b t1"], token_bytes: Int[Tensor, " v"]
) -> tuple[Float[Tensor, ""], Int[Tensor, ""]]:
    """Summed NLL (nats) and summed bytes over targets that stand for bytes (special tokens excluded)."""
    inputs, targets = split_window(window)
    nats, nbytes = byte_sums(model.nll(model.token_hidden(inputs), targets), targets, token_bytes)
    return nats.sum(), nbytes.sum()


@torch.no_grad()
def bits_per_byte(sums_fn, batches: list[Tensor], device: torch.device) -> Tensor:
    """Bits per byte over fixed validation batches: total nats / (ln 2 · total bytes).

    ``sums_fn(i, batch)`` returns summed NLL (any shape, one bpb per element) and summed bytes for batch ``i``.
    """
    total_nll: Tensor | int = 0
    total_bytes: Tensor | int = 0
    for i, batch in enumerate(batches):
        nll, nbytes = sums_fn(i, batch.to(device, non_blocking=True))
        total_nll = total_nll + nll.double()
        total_bytes = total_bytes + nbytes
    return (total_nll / (math.log(2) * total_bytes.clamp(min=1))).cpu()
