"""The full-window teacher: ``loss_full`` is the plain loss over the whole window, ``loss_distill`` the KL from the
full window's tail predictions to each compressed variant's, and each reaches exactly the weights it should."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from compile_check import assert_one_graph_equals_eager
from test_mc import VOCAB, decisive, make_system

from mcfn.config import MCConfig, TeacherConfig
from mcfn.core.step import plain_step
from mcfn.core.system import build_contexts, process_batch
from mcfn.core.teacher import distill_kl, variant_tail_logprobs
from mcfn.core.variants import draw_variant_noise
from mcfn.core.weights import LossWeights

SHAPE = dict(T=32, K=4, L=2, W=16, H=8, N=2)


def batch(system, seed: int = 0, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (b, system.layout.T + 1), generator=g)
    return window, draw_variant_noise(system.layout, b, g, torch.device("cpu"))


def weights(full: float, distill: float) -> LossWeights:
    mc = MCConfig(teacher=TeacherConfig(full_weight=full, distill_weight=distill))
    return LossWeights.of(mc, torch.device("cpu"))


def test_distill_kl_is_the_kl_from_the_teacher_to_the_student():
    """KL(p ‖ q) = Σ p (log p - log q), hand-computed; the reverse direction gives another number."""
    p = torch.tensor([0.9, 0.09, 0.01]).log()
    q = torch.tensor([0.1, 0.1, 0.8]).log()
    expected = sum(a * (torch.log(a) - torch.log(b)) for a, b in zip(p.exp(), q.exp(), strict=True))
    kl = distill_kl(p.view(1, 1, 3), q.view(1, 1, 1, 3))
    torch.testing.assert_close(kl, expected.view(1, 1, 1))
    reverse = distill_kl(q.view(1, 1, 3), p.view(1, 1, 1, 3))
    assert abs(float(reverse) - float(expected)) > 0.5
    assert float(distill_kl(p.view(1, 1, 3), p.view(1, 1, 1, 3))) == 0.0


def test_no_gradient_reaches_the_teacher():
    teacher = torch.randn(2, 4, 5).log_softmax(-1).requires_grad_()
    student = torch.randn(2, 3, 4, 5).log_softmax(-1).requires_grad_()
    distill_kl(teacher, student).sum().backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0


def test_loss_full_is_the_plain_loss_of_the_whole_window():
    system = decisive(make_system(**SHAPE, teacher={"full_weight": 0.5}))
    window, noise = batch(system)
    with torch.no_grad():
        out = process_batch(system, window, noise, weights(0.5, 0.0))
        plain = plain_step(system.base, window).losses["loss_lm"]
    torch.testing.assert_close(out.metrics["train/loss_full"], plain)
    torch.testing.assert_close(out.losses["loss_full"], 0.5 * plain)
    assert float(out.losses["loss_distill"]) == 0.0 and float(out.metrics["mc/distill_kl"]) > 0


def test_student_predictions_are_the_variants_tail_predictions():
    """The baseline variant shows the last W tokens at LOD0: its tail predictions are the full window's, up to
    what the older tokens change, and identical when the window is no longer than W."""
    system = decisive(make_system(T=16, K=4, L=1, W=16, H=8, N=1))
    window, noise = batch(system)
    with torch.no_grad():
        wc, _, _ = build_contexts(system, window, noise)
        hidden = system.base.hidden(wc.emb, wc.position, wc.span.float())
        student = variant_tail_logprobs(system.base, hidden, wc, system.layout)[:, 0]
        full = F.log_softmax(system.base(window[:, :-1])[:, -8:], -1)
    torch.testing.assert_close(student, full, atol=1e-5, rtol=1e-5)


def grads_of(system, out) -> dict[str, float]:
    system.zero_grad(set_to_none=True)
    out.total().backward()
    return {
        name: sum(float(p.grad.abs().sum()) for p in getattr(system, name).parameters() if p.grad is not None)
        for name in ("base", "gistnet")
    }


def test_the_distillation_gradient_reaches_gistnet():
    system = decisive(make_system(**SHAPE, teacher={"distill_weight": 1.0}))
    window, noise = batch(system, seed=1)
    only_distill = process_batch(system, window, noise, weights(0.0, 1.0))
    only_distill = only_distill._replace(losses={"loss_distill": only_distill.losses["loss_distill"]})
    grads = grads_of(system, only_distill)
    assert grads["gistnet"] > 0 and grads["base"] > 0


def test_the_step_with_the_teacher_is_one_graph_equal_to_eager(fresh_dynamo):
    """The last batch brings new weight values: they are tensors, so it does not recompile."""
    system = decisive(make_system(**SHAPE, teacher={"full_weight": 1.0, "distill_weight": 1.0}))
    batches = [(system, *batch(system, seed=i), weights(1.0, 1.0) if i < 3 else weights(0.1, 3.0)) for i in range(4)]
    assert_one_graph_equals_eager(process_batch, batches)
