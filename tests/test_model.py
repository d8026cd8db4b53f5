import dataclasses
import math
from functools import partial

import pytest
import torch
from einops import rearrange
from hypothesis import given
from hypothesis import strategies as st

from mcfn.config import ModelConfig
from mcfn.core.model import GPT, SOFTCAP, SelfAttention, apply_rotary, causal_attention, rotary_tables


def tiny_model(seed: int = 0, vocab: int = 64) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=vocab))


def reference_rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Textbook rotary: pairs (x_j, x_{j+e/2}) as complex numbers times exp(i·pos·base^(-2j/e))."""
    half = x.size(-1) // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float64) / half)
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    z = z * torch.polar(torch.ones_like(freqs), positions.double()[..., None] * freqs)
    return torch.cat((z.real, z.imag), dim=-1).float()


@given(st.integers(1, 3), st.integers(1, 9), st.sampled_from([2, 4, 8]), st.integers(0, 2**31 - 1))
def test_property_span_one_rotary_is_exactly_the_standard_rotary(b, n, e, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 2, n, e, generator=g)
    positions = torch.randint(0, 5000, (b, n), generator=g).float()
    cos, sin = rotary_tables(positions, torch.ones_like(positions), e, 10000.0)
    expected = reference_rotary(x, positions[:, None, :], 10000.0)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, atol=1e-4, rtol=1e-4)


def test_rotary_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)

    def score(pq: float, pk: float) -> float:
        cq, sq = rotary_tables(torch.tensor([[float(pq)]]), torch.ones(1, 1), 8, 10000.0)
        ck, sk = rotary_tables(torch.tensor([[float(pk)]]), torch.ones(1, 1), 8, 10000.0)
        return float((apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-4)


def test_wider_spans_damp_high_frequencies_more():
    positions = torch.full((1, 3), 48.0)
    cos, sin = rotary_tables(positions, torch.tensor([[1.0, 32.0, 1024.0]]), 16, 10000.0)
    magnitude = (cos.square() + sin.square()).sqrt()[0, 0]  # [3 entries, 8 frequencies]
    torch.testing.assert_close(magnitude[0], torch.ones(8))  # a token is not damped at all
    assert (magnitude[1] <= 1).all() and (magnitude[2] <= magnitude[1]).all()
    assert magnitude[2, 0] < 1e-3 and magnitude[1, -1] > 0.99  # fastest phase washed out, slowest kept
    # The damping is the Gaussian approximation of averaging the phase over the span.
    theta = 1.0  # the fastest frequency
    assert float(magnitude[1, 0]) == pytest.approx(math.exp(-0.5 * theta**2 * (32**2 - 1) / 12), rel=1e-5)


def test_entry_forward_at_token_positions_equals_token_forward():
    model = tiny_model()
    tokens = torch.randint(0, 64, (2, 12))
    positions = torch.arange(12, dtype=torch.float32).expand(2, 12)
    by_entries = model.logits(model.hidden(model.embed(tokens), positions, torch.ones(2, 12)))
    torch.testing.assert_close(by_entries, model(tokens))


def test_attention_is_causal():
    model = tiny_model()
    for block in model.blocks:  # make the blocks do something (output projections start at zero)
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.3)
        torch.nn.init.normal_(block.mlp.c_proj.weight, std=0.3)
    tokens = torch.randint(0, 64, (1, 10))
    changed = tokens.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 64
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_attention_gain_sets_how_sharply_each_head_reads():
    """A head's gain scales its logits: at zero it reads the plain mean of the values before each entry; at a
    large gain it reads mostly its best-aligned key, which QK-norm alone never lets it do."""
    torch.manual_seed(0)
    attn = SelfAttention(16, 2)
    x = torch.randn(1, 6, 16)
    cos, sin = rotary_tables(torch.arange(6.0)[None], torch.ones(1, 6), 8, 10000.0)
    v = rearrange(attn.c_v(x), "b n (h e) -> b h n e", h=2)
    causal_mean = v.cumsum(2) / torch.arange(1, 7.0)[:, None]
    with torch.no_grad():
        attn.gain.copy_(torch.tensor([0.0, 1.0]))
    heads = causal_attention(0, *attn.qkv(x, cos, sin))
    torch.testing.assert_close(heads[:, 0], causal_mean[:, 0])
    assert not torch.allclose(heads[:, 1], causal_mean[:, 1], atol=1e-3)
    q, k, _ = attn.qkv(x, cos, sin)
    with torch.no_grad():
        attn.gain.fill_(50.0)
    sharp_q, _, _ = attn.qkv(x, cos, sin)
    torch.testing.assert_close(sharp_q[:, 1], 50.0 * q[:, 1])
    future = torch.ones(6, 6).triu(1).bool()

    def last_row(q: torch.Tensor) -> torch.Tensor:  # head 1's weights for the last entry
        return torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(future, -torch.inf), -1)[0, 1, -1]

    # At unit gain a logit lies within ±sqrt(8), so one key of six gets at most e^2.83 / (e^2.83 + 5·e^-2.83) ≈ 0.983.
    assert last_row(q).max() < 0.99 < last_row(sharp_q).max()


def test_initial_state_is_identity_blocks_and_uniform_predictions():
    model = tiny_model(vocab=512)
    x = torch.randn(2, 5, 16)
    cos, sin = rotary_tables(torch.arange(5.0)[None], torch.ones(1, 5), 8, 10000.0)
    for block in model.blocks:
        torch.testing.assert_close(
            block(x, cos, sin, partial(causal_attention, 0)), x
        )  # zero-initialised output projections
    tokens = torch.randint(0, 512, (2, 20))
    loss = model.nll(model.token_hidden(tokens), tokens).mean()
    assert float(loss.detach()) == pytest.approx(math.log(512), abs=0.05)
    assert not any(m.bias is not None for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_logits_are_soft_capped_and_targets_below_zero_are_ignored():
    model = tiny_model()
    torch.nn.init.normal_(model.lm_head.weight, std=100.0)
    h = model.token_hidden(torch.randint(0, 64, (1, 4)))
    assert model.logits(h).abs().max() <= SOFTCAP
    nll = model.nll(h, torch.tensor([[1, -1, 2, -1]]))
    assert nll[0, 1] == 0 and nll[0, 3] == 0 and nll[0, 0] > 0


def test_shape_checks_run_in_eager_code():
    with pytest.raises(Exception, match="(?i)type-check|shape|dimension"):
        rotary_tables(torch.zeros(2, 5), torch.ones(2, 6), 8, 10000.0)


@pytest.mark.parametrize("mc", [False, True])
def test_step_flops_estimate_matches_the_counted_flops(mc):
    """The MFU numerator against torch's FLOP counter over a real forward + backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from mcfn.core.flops import step_flops
    from mcfn.profile import build_config
    from mcfn.shell.tasks import build_task

    cfg = build_config(
        {
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 64},
            "data": {"seq_len": 64},
            "train": {"batch_size": 2},
            "mc": {"enabled": mc, "block_size": 4, "budget": 32, "tail": 8},
        }
    )
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=256))
    task = build_task(cfg, torch.ones(256, dtype=torch.int64), torch.device("cpu"))
    window = torch.randint(0, 256, (2, 65))
    with FlopCounterMode(display=False) as counter:
        out = task.train_step(window, 0)
        out.total().backward()
    counted, estimated = counter.get_total_flops(), step_flops(cfg, task.model)
    assert 0.75 < estimated / counted < 1.25, (estimated, counted)
