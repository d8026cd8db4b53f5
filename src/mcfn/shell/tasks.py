"""What the training loop trains: the plain GPT or MegaContext, behind one small interface.

A task owns its model and its (optionally compiled) training steps. ``train_step`` returns the step's
:class:`~mcfn.core.outputs.StepOutput`; ``validate`` returns the held-out figures for the log. Validation runs
eagerly: compiling its graph costs more than it saves over a run's validations (a tiny compiled run on a fresh CPU
machine: 184 s with it compiled, 132 s without, the same bpb; gpu-h100's model on an H200: 48 s to compile it,
then 0.4 s a validation of 8 batches against 0.6 s eager; LABLOG, nineteenth session).
Anything random in a step is drawn from a generator seeded by ``(seed, step)``, so a step depends
only on the run's seed and its index: resuming replays exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mcfn.config import RunConfig
from mcfn.core.model import GPT
from mcfn.core.outputs import StepOutput
from mcfn.core.policy import RANDOM, RECENCY
from mcfn.core.step import bits_per_byte, compile_step, nll_and_bytes, plain_step
from mcfn.core.system import (
    MegaContext,
    build_contexts,
    process_batch,
    validation_sums,
)
from mcfn.core.variants import draw_variant_noise
from mcfn.core.weights import LossWeights
from mcfn.data.loader import VAL_SEED
from mcfn.inference.render import lod_string
from mcfn.seeding import derive_seed


@torch.no_grad()
def validation_bpb(sums_fn, batches: list[Tensor], device: torch.device) -> Tensor:
    """Bits per byte over fixed validation batches, pooled: total nats over total bytes.

    ``sums_fn(i, batch)`` returns summed NLL (any shape, one bpb per element) and summed bytes for batch ``i``.
    """
    total_nll: Tensor | int = 0
    total_bytes: Tensor | int = 0
    for i, batch in enumerate(batches):
        nll, nbytes = sums_fn(i, batch.to(device, non_blocking=True))
        total_nll = total_nll + nll.double()
        total_bytes = total_bytes + nbytes
    return bits_per_byte(total_nll, total_bytes).cpu()


class PlainTask:
    """The plain GPT over all ``T`` tokens of each window (``--no-mc``)."""

    mode = "plain"

    def __init__(self, cfg: RunConfig, token_bytes: Tensor, device: torch.device):
        self.model: nn.Module = GPT(cfg.model).to(device)
        self.token_bytes, self.device = token_bytes, device
        self._step: Callable = plain_step

    def compile(self, mode: str) -> None:
        self._step = compile_step(self._step, mode)

    def train_step(self, window: Tensor, step: int, rows: slice | None = None) -> StepOutput:
        return self._step(self.model, window)

    def contexts_per_window(self, step: int) -> int:
        """What the base model reads per window at ``step``: the whole window, once."""
        return 1

    def validate(self, batches: list[Tensor]) -> dict[str, float]:
        bpb = validation_bpb(lambda i, w: nll_and_bytes(self.model, w, self.token_bytes), batches, self.device)
        return {"val/bpb": float(bpb)}


class MCTask:
    """MegaContext: variants of each window packed into one forward (DESIGN §4), after ``train.plain_steps``
    steps of the plain step on the base model alone.

    Validation reports bits per byte on the last ``H`` tokens of each window: ``val/bpb`` under the
    compressed variants (the full history in at most ``W`` entries) and ``val/bpb_recency`` under the
    recency baseline (the last ``W`` tokens only), with fixed variant noise per validation batch.
    """

    mode = "mc"

    def __init__(self, cfg: RunConfig, token_bytes: Tensor, device: torch.device):
        mc = cfg.mc
        self.model = MegaContext(cfg).to(device)
        self.global_batch = cfg.train.batch_size
        self.layout = self.model.layout
        self.token_bytes, self.device, self.seed = token_bytes, device, cfg.train.seed
        self.alloc_iterations = mc.alloc.iterations
        self.generator = torch.Generator(device=device)
        # Loss weights are tensors: changing one during training never recompiles the step.
        self.weights = LossWeights.of(mc, device)
        self.plain_steps = cfg.train.plain_steps
        self._plain: Callable = plain_step
        self._step: Callable = process_batch

    def compile(self, mode: str) -> None:
        self._plain, self._step = compile_step(self._plain, mode), compile_step(self._step, mode)

    def noise(self, batch: int, seed: int):
        self.generator.manual_seed(seed)
        return draw_variant_noise(self.layout, batch, self.generator, self.device, self.alloc_iterations)

    def contexts_per_window(self, step: int) -> int:
        """Working contexts the base model reads per window at ``step``: ``V``; the whole window, once, in the
        plain phase."""
        return 1 if step < self.plain_steps else self.layout.V

    def train_step(self, window: Tensor, step: int, rows: slice | None = None) -> StepOutput:
        """The step on ``window``, rows ``rows`` of the global batch (None: ``window`` is the whole batch).
        Variant noise is drawn for the global batch and sliced, so a sample gets the same variants however
        the batch is split (processes, micro-batches)."""
        if step < self.plain_steps:  # the plain phase: the base model alone over whole windows
            return self._plain(self.model.base, window)
        if rows is None:
            rows = slice(0, window.size(0))
        noise = self.noise(max(self.global_batch, rows.stop), derive_seed(self.seed, "train_noise", step))[rows]
        return self._step(self.model, window, noise, self.weights)

    @torch.no_grad()
    def lod_maps(self, window: Tensor, step: int) -> list[tuple[str, str]]:
        """Sample 0's working contexts at this step (``window`` holds rows from 0 of the global batch), as
        ``(kind, one character per block)`` pairs."""
        noise = self.noise(self.global_batch, derive_seed(self.seed, "train_noise", step))[:1]
        wc, _, _ = build_contexts(self.model, window[:1], noise)
        V, A = self.layout.V, self.model.alloc_variants
        kinds = [RECENCY.name] + [RANDOM.name] * (V - 1 - A) + ["allocator"] * A
        return [
            (kind, lod_string(wc.start[v], wc.span[v], wc.lod[v], wc.valid[v], self.layout.T, self.layout.K))
            for v, kind in enumerate(kinds)
        ]

    def validate(self, batches: list[Tensor]) -> dict[str, float]:
        def sums(i: int, window: Tensor) -> tuple[Tensor, Tensor]:
            return validation_sums(
                self.model, window, self.noise(window.size(0), derive_seed(VAL_SEED, "val_noise", i)), self.token_bytes
            )

        bpb = validation_bpb(sums, batches, self.device)  # [V]
        return {"val/bpb": float(bpb[1:].mean()), "val/bpb_recency": float(bpb[0])}


def build_task(cfg: RunConfig, token_bytes: Tensor, device: torch.device) -> PlainTask | MCTask:
    return (MCTask if cfg.mc.enabled else PlainTask)(cfg, token_bytes, device)
