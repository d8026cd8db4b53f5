"""The GPU paths, on a CUDA device only (``pytest -m cuda``; ``scripts/gpu_check.sh`` runs them first). Off a GPU
they are skipped: no CPU test can reach CUDA's kernels (its ``histc`` refuses bfloat16 where the CPU's accepts it),
fused AdamW, CUDA's out-of-memory error or bf16 autocast, so these say what the CPU suite cannot."""

from __future__ import annotations

import json

import pytest
import torch
from builders import VOCAB, decisive, make_system
from compile_check import assert_one_graph_equals_eager

from mcfn.config import MCConfig, OptimConfig
from mcfn.core.system import process_batch
from mcfn.core.variants import draw_variant_noise
from mcfn.core.weights import LossWeights
from mcfn.inference.decode import decoding_compiler
from mcfn.inference.generation import generate_full, generate_mc
from mcfn.shell.microbatch import fitting_micro_batch
from mcfn.shell.optim import build_optimizers, skip_if_non_finite
from train.run import main as run_main

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)"),
]
CUDA = torch.device("cuda")
T, K, L, W, H = 64, 4, 2, 32, 8


def cuda_batches(system, n: int, batch: int = 2):
    g = torch.Generator(device=CUDA).manual_seed(1)
    for _ in range(n):
        window = torch.randint(0, VOCAB, (batch, system.layout.T + 1), generator=g, device=CUDA)
        yield window, draw_variant_noise(system.layout, batch, g, CUDA)


def test_mc_step_under_bf16_autocast_is_one_inductor_graph_equal_to_eager(fresh_dynamo):
    """The training step as the trainer runs it on a GPU: bf16 autocast, inductor, one graph, no recompile on the
    next batch; its losses match eager's to bf16's precision, and the score histograms (CUDA's ``histc``) count
    every score in both."""
    system = make_system(T, K, L, W, H, N=2).to(CUDA)
    weights = LossWeights.of(MCConfig(), CUDA)

    def step(window, noise):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = process_batch(system, window, noise, weights)
        return {**out.losses, **{f"{k}/count": h.float().sum() for k, h in out.histograms.items()}}

    batches = [tuple(b) for b in cuda_batches(system, 2)]
    assert_one_graph_equals_eager(
        step, batches, backend="inductor", loss=lambda out: out["loss_lm"], params=[], atol=3e-2, rtol=3e-2
    )
    out = step(*batches[0])
    counts = [v for k, v in out.items() if k.endswith("/count")]
    assert counts and all(c > 0 for c in counts)
    out["loss_lm"].backward()
    grads = [p.grad for p in system.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_optimizers_on_cuda_are_fused_and_step():
    """On a GPU, AdamW runs fused and Muon iterates in bf16 as torch's does; one step moves every parameter that had
    a gradient, and a step flagged non-finite moves none, decided on the device."""
    system = make_system(T, K, L, W, H, N=2).to(CUDA)
    muon, adamw = build_optimizers(system, OptimConfig())
    assert adamw.defaults["fused"] is True and muon.ns_dtype == torch.bfloat16
    window, noise = next(cuda_batches(system, 1))
    before = [p.detach().clone() for p in system.parameters()]
    process_batch(system, window, noise, LossWeights.of(MCConfig(), CUDA)).total().backward()
    had_grad = [p.grad is not None and p.grad.abs().sum() > 0 for p in system.parameters()]
    for opt in (muon, adamw):
        opt.step()
    moved = [not torch.equal(a, p) for a, p in zip(before, system.parameters(), strict=True)]
    assert any(had_grad) and all(m for m, g in zip(moved, had_grad, strict=True) if g)
    after = [p.detach().clone() for p in system.parameters()]
    process_batch(system, window, noise, LossWeights.of(MCConfig(), CUDA)).total().backward()
    skip_if_non_finite([muon, adamw], torch.tensor(float("nan"), device=CUDA), torch.tensor(1.0, device=CUDA))
    for opt in (muon, adamw):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(after, system.parameters(), strict=True))


def test_automatic_micro_batch_halves_on_a_real_out_of_memory():
    """CUDA's own out-of-memory error (an allocation far beyond the card) makes the search halve, and the first size
    that fits is kept."""
    free, _ = torch.cuda.mem_get_info()

    def try_step(micro: int) -> None:
        torch.empty(int(free * 0.2 * micro), dtype=torch.uint8, device=CUDA)  # 1.6x what is free at 8, 0.8x at 4

    assert fitting_micro_batch(try_step, 8) == 4


def test_compiled_generation_on_cuda_decodes_what_eager_does(fresh_dynamo):
    """The token step and the refill compiled by inductor and replayed as CUDA graphs, across refocuses, decode
    greedily what eager does; so does full context's token step."""
    system = decisive(make_system(T, K, L, W, H, N=2, seed=3)).to(CUDA)
    prompt = torch.randint(0, VOCAB, (3 * W,), generator=torch.Generator().manual_seed(0)).to(CUDA)
    compile_fn = decoding_compiler("reduce-overhead")  # without inductor's CUDA graphs: the decoder captures its own
    eager, _ = generate_mc(system, prompt, 12, 4)
    compiled, stats = generate_mc(system, prompt, 12, 4, compile_fn=compile_fn)
    assert compiled.tolist() == eager.tolist() and stats.compile_s > 0
    full_eager, _ = generate_full(system.base, prompt, 8)
    full_compiled, _ = generate_full(system.base, prompt, 8, compile_fn=compile_fn)
    assert full_compiled.tolist() == full_eager.tolist()


def test_a_run_on_cuda_trains_tracks_the_pass_key_and_reports_its_mfu(tmp_path, profile):
    """``train.run`` on the GPU end to end (bf16, fused AdamW, the automatic micro-batch; compiled in the GPU check's
    own run step): the whole batch fits, the loss is finite, the pass key is tracked at every validation (the probe
    is written on the CPU and read on the GPU: the first H200 run crashed there), and the summary carries the MFU
    a known card gives."""
    out = tmp_path / "run"
    argv = ["--profile", str(profile), "--out", str(out), "--steps", "4", "--device", "cuda"]
    sets = [
        "train.final_eval_batches=0",
        "train.micro_batch_size=0",
        "train.eval_every=2",
        "data.seq_len=256",
        "mc.budget=128",
        "mc.tail=96",
    ]  # fmt: skip: a tail the pass key fits
    assert run_main(argv + [a for s in sets for a in ("--set", s)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["micro_batch_size"] == 4 and summary["device"].startswith("cuda")
    assert summary["final_val_bpb"] < 20 and summary["skipped_steps"] == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if "probe/passkey_full" in r]) == 3  # steps 0, 2 and 4
    known = any(name in torch.cuda.get_device_name() for name in ("H100", "H200", "A100"))
    assert (summary["mfu"] is not None) == known
