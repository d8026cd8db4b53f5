"""The lines a run's report opens with: what was trained and for how long (:func:`trained_line`), then
(:func:`summary_lines`) the policy the run ships with its pass key and its corpus gain over truncation, the pass key
and the corpus under the conditions a reader needs, one pass-key window as the shipped policy cuts it, and a
continuation generated with it refocusing.

The two examples run generation itself (:func:`~mcfn.inference.generation.generate_mc`, greedy) on the first
window of the test split, so what the report shows is what ``train.generate`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mcfn.config import RunConfig
from mcfn.core.cadence import CLOCK, resolved_rule
from mcfn.core.policy import RECENCY, SHIPPED, FocusPolicy, policies
from mcfn.core.system import MegaContext
from mcfn.data.probes import evaluation_probe
from mcfn.data.tokenizer import Tokenizer
from mcfn.evaluation.result import EvalReport, Row
from mcfn.inference.generation import generate_mc


def briefed() -> list[str]:
    """What the summary compares, in the registry's order: the policies a brief evaluation scores, then the shipped
    one."""
    return [*(policy.name for policy in policies(brief=True)), SHIPPED]


CONTINUATION = 32  # tokens generated after the held-out prompt
SHOWN_CHARS = 80  # of the prompt's end and of the continuation, in the summary line


@dataclass(frozen=True)
class Example:
    """Generation on one held-out window: the LOD map of each refocus and the text on either side."""

    maps: list[str]  # one character per block of K tokens at each refocus (mcfn.inference.render)
    prompt: str
    generated: str
    expected: str  # what the window holds after the prompt


def _one_line(text: str, keep: int, tail: bool) -> str:
    text = text.replace("\n", "⏎").replace("`", "'")
    return text[-keep:] if tail else text[:keep]


def generate_example(
    system: MegaContext, policy: FocusPolicy, prompt: Tensor, expected: Tensor, tokenizer: Tokenizer, every: int
) -> Example:
    """Greedy generation of ``expected.numel()`` tokens after ``prompt [n]`` with ``policy`` refocusing under its
    own rule (else every ``every`` tokens), as ``train.generate`` does."""
    maps: list[str] = []
    on, every = resolved_rule(policy.rule, every)
    tokens, _ = generate_mc(
        system, prompt, expected.numel(), every, policy=policy, on_refocus=lambda _, m: maps.append(m), on=on
    )
    decode = tokenizer.decode
    return Example(maps, decode(prompt.tolist()), decode(tokens.tolist()), decode(expected.tolist()))


def passkey_example(
    system: MegaContext, policy: FocusPolicy, window: Tensor, tokenizer: Tokenizer, every: int
) -> tuple[Example, str]:
    """The pass key written into ``window [T + 1]`` as the evaluation writes its first one, generation's answer with
    ``policy``, and the LOD map of the refocus that answered it with the blocks holding the key in brackets."""
    layout = system.layout
    probe = evaluation_probe("passkey", window[None].cpu(), tokenizer, layout.H, 0)
    answer = probe.answer[0].nonzero().flatten() + 1  # the key's tokens' positions in the window
    tokens = probe.window[0].to(window.device)
    example = generate_example(system, policy, tokens[: int(answer[0])], tokens[answer], tokenizer, every)
    key, lod = tokens[answer].tolist(), example.maps[-1]
    at = next((i for i in range(int(answer[0])) if tokens[i : i + len(key)].tolist() == key), None)
    if at is None:  # the key tokenised differently inside the fact: the map without brackets
        return example, lod
    first, last = at // layout.K, (at + len(key) - 1) // layout.K
    return example, f"{lod[:first]}[{lod[first : last + 1]}]{lod[last + 1 :]}"


@torch.no_grad()
def summary_lines(
    system: MegaContext,
    shipped: tuple[str, FocusPolicy],
    window: Tensor,
    tokenizer: Tokenizer,
    every: int,
    report: EvalReport,
) -> list[str]:
    """The report's opening lines after :func:`trained_line`: the ``shipped`` policy (the candidate's name and its
    policy) with its pass key and its paired corpus gain over truncation, the pass key and corpus figures of the final
    evaluation's ``report`` (which scored the pass key and the shipped policy), and the two examples generated with
    the shipped policy on the held-out ``window [T + 1]``."""
    W, T, K = report.W, report.T, system.layout.K
    name, policy = shipped
    passkey, corpus = report.scored("passkey"), report.head.head
    assert passkey is not None and passkey.refocus.head.accuracy is not None, "the caller checks it was scored"
    share = passkey.refocus.head.accuracy  # of the pass-key windows answered, per condition
    accuracy = ", ".join(f"{c} {share[c]:.2f}" for c in briefed() if c in share)
    bpb = ", ".join(f"{c} {corpus.bpb[c]:.4f}" for c in briefed() if c in corpus.bpb)
    gain = corpus.paired.get(f"{SHIPPED}_over_{RECENCY.name}")
    over = f"{gain.bpb:+.4f} ± {gain.se:.4f} bits per byte" if gain else "n/a"
    key, lod = passkey_example(system, policy, window, tokenizer, every)
    answered = "answers" if key.generated == key.expected else "misses"
    cut = window.numel() - 1 - CONTINUATION
    text = generate_example(system, policy, window[:cut], window[cut : cut + CONTINUATION], tokenizer, every)
    return [
        f"**Ships `{name}`** (chosen on validation windows; `train.generate` uses it when no `--context` is given): "
        f"pass key {share[SHIPPED]:.2f}, corpus gain over truncation {over} (paired, on the test windows below).",
        f"**Pass key** at W = {W} = T/{T // W}, share of {report.windows_per_probe} test windows answered: {accuracy}.",
        f"**Corpus bpb** at W = {W}, last {report.H} tokens of {report.windows} test windows from "
        f"{report.documents} documents: {bpb} (paired standard errors by bootstrap over documents in eval.json).",
        f"**A pass-key window as `{name}` cuts it** (a character per {K} tokens: 0 tokens, k a level-k gist, · left "
        f"out; the key in brackets), where generation {answered} `{key.generated.strip()}`: `{lod}`",
        f"**Generated** with `{name}` refocusing {_rule_words(policy.rule, every)} ({len(text.maps)} refocuses"
        f"{_refocus_rate(corpus)}): "
        f"`…{_one_line(text.prompt, SHOWN_CHARS, True)}` → `{_one_line(text.generated, SHOWN_CHARS, False)}`",
    ]


def _rule_words(rule: str | None, every: int) -> str:
    on, every = resolved_rule(rule, every)
    return f"every {every} tokens" if on == CLOCK else f"when a copy starts, at the latest every {every} tokens"


def _refocus_rate(corpus: Row) -> str:
    rate = (corpus.refocus_rate or {}).get(SHIPPED)
    return "" if rate is None else f"; {rate:.3f} a token on the test windows"


def trained_line(cfg: RunConfig, summary: dict[str, Any]) -> str:
    """The first line: what was trained on what, for how long (``summary``: the run's ``summary.json``)."""
    plain = cfg.train.plain_steps
    steps = f"{plain} plain + {cfg.train.steps - plain} MegaContext" if plain else f"{cfg.train.steps} MegaContext"
    return (
        f"**Trained** on `{cfg.data.source}` ({summary['params']:,} parameters): {steps} steps of "
        f"{cfg.train.batch_size} × {cfg.data.seq_len} tokens, {summary['wall_s'] / 60:.1f} min on {summary['device']} "
        f"with the ship choice and the final evaluation, which took {summary['final_eval_s'] / 60:.1f} min."
    )
