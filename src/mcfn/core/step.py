"""The plain language-model step and the byte-weighted NLL sums of evaluation, as pure functions.

A step returns a :class:`~mcfn.core.outputs.StepOutput`, as the MegaContext step does. ``compile_step`` is
how every step and evaluation function is compiled: one whole graph, fixed shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from mcfn.core.model import GPT
from mcfn.core.outputs import StepOutput
from mcfn.typecheck import typechecked, unchecked


@typechecked
def split_window(window: Int[Tensor, "b t1"]) -> tuple[Int[Tensor, "b t"], Int[Tensor, "b t"]]:
    """A window of ``T + 1`` tokens → inputs ``[:T]`` and next-token targets ``[1:]``."""
    return window[:, :-1], window[:, 1:]


def compile_step(fn: Callable, mode: str) -> Callable:
    return torch.compile(unchecked(fn), fullgraph=True, dynamic=False, mode=mode)


def plain_step(model: GPT, window: Tensor) -> StepOutput:
    """Next-token loss of the plain GPT over ``[B, T + 1]`` windows (mean over all ``B·T`` targets)."""
    inputs, targets = split_window(window)
    nll = model.nll(model.token_hidden(inputs), targets)
    return StepOutput({"loss_lm": nll.mean()}, {}, {})


def bits_per_byte(nats: Tensor, nbytes: Tensor) -> Tensor:
    """Bits per byte, elementwise: ``nats / (ln 2 · bytes)`` (no bytes counts as one, so the result is 0)."""
    return nats / (math.log(2) * nbytes.clamp(min=1))


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
