"""Text over histories longer than the training window, through generation's own loop (issue 100).

The evaluation scores windows of the training ``T``; the position rule's claim is that a model trained there reads
any history. This measures it on text: held-out windows of ``length`` tokens (``T/W`` = ``length / W``), each one's
first ``length - scored`` tokens the prompt and its last ``scored`` fed through the decode loop
(:mod:`mcfn.evaluation.generated`) under the run's shipped policy and rule, under truncation (``recency``: the
newest ``W - R`` tokens, at the run's clock ``R``) and under full context (every token at its absolute position, as a
plain GPT reads); bits per byte of the scored tokens and each one's gain over truncation, paired by document, and
each refocusing condition's **local window**: the newest tokens its contexts show at LOD0, the text truncation keeps
whole (a cut that pays for far picks by leaving the near past out shows it here; LABLOG, forty-fifth session). The
pass key at such lengths is the needle grid's (:mod:`mcfn.evaluation.needle`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from mcfn.core.focus import Refocus
from mcfn.core.policy import FULL, RECENCY, SHIPPED, FocusPolicy
from mcfn.core.system import MegaContext
from mcfn.evaluation.generated import generated_text
from mcfn.evaluation.held_out import HeldOut
from mcfn.evaluation.result import Gain
from mcfn.inference.contexts import GenerationStats
from mcfn.inference.generation import teacher_forced_full, teacher_forced_mc

TRUNCATION = RECENCY.name


def local_window(stats: GenerationStats, block: int) -> float | None:
    """The newest tokens a decoding's contexts showed at LOD0, averaged over its refocuses, read from their layouts
    (:func:`~mcfn.inference.render.lod_string`: ``0`` a block of ``block`` tokens shown as tokens, so counted to the
    block); ``None`` where it never refocused (full context)."""
    runs = [len(layout) - len(layout.rstrip("0")) for layout in stats.layouts]
    return block * sum(runs) / len(runs) if runs else None


@dataclass(frozen=True)
class HistoryText:
    """Each condition's bits per byte of the scored tokens, its gain over truncation (``bpb(truncation) −
    bpb(condition)``, positive where it reads better), its refocuses a scored token and its local window
    (:func:`local_window`, averaged over the windows; ``None`` for full context)."""

    length: int
    scored: int
    windows: int
    documents: int
    bpb: dict[str, float]
    gain: dict[str, Gain]
    refocuses_per_token: dict[str, float]
    local_window: dict[str, float | None]


def history_text(
    system: MegaContext,
    shipped: FocusPolicy,
    rule: Refocus,
    clock: int,
    held: HeldOut,
    scored: int,
    progress: Callable[[str], None] = lambda line: None,
    others: tuple[FocusPolicy, ...] = (),
) -> HistoryText:
    """:class:`HistoryText` over every window of ``held``: ``shipped`` under ``rule``, truncation refocusing every
    ``clock`` tokens (the run's ``mc.refocus_every``), full context, and each of ``others`` under ``rule`` (which
    part of a policy reads what)."""
    decodings = {
        SHIPPED: partial(teacher_forced_mc, system, refocus=rule, policy=shipped),
        TRUNCATION: partial(teacher_forced_mc, system, refocus=Refocus(clock), policy=RECENCY),
        FULL.name: partial(teacher_forced_full, system.base),
    }
    decodings |= {policy.name: partial(teacher_forced_mc, system, refocus=rule, policy=policy) for policy in others}
    length = held.windows[0].size(1)
    text = generated_text(held, length - scored, decodings, progress)
    return HistoryText(
        length=length,
        scored=scored,
        windows=text.windows,
        documents=text.clusters.documents,
        bpb={name: text.bpb(name) for name in decodings},
        gain={name: text.gain(TRUNCATION, name) for name in decodings if name != TRUNCATION},
        refocuses_per_token={name: text.per_window(name, lambda s: s.refocuses_per_token) for name in decodings},
        local_window={name: mean_local_window(text.stats[name], system.layout.K) for name in decodings},
    )


def mean_local_window(stats: list[GenerationStats], block: int) -> float | None:
    """:func:`local_window` averaged over the windows (``None`` where no window refocused)."""
    each = [w for w in (local_window(s, block) for s in stats) if w is not None]
    return sum(each) / len(each) if each else None


def history_table(result: HistoryText, shipped: str) -> str:
    """The measurement as a markdown table, a row per condition."""
    lines = [
        "| condition | bpb | gain over truncation (paired) | refocuses a token | local window (tokens) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in result.bpb:
        label = {SHIPPED: f"shipped ({shipped})", TRUNCATION: f"truncation ({TRUNCATION})"}.get(name, name)
        gain = result.gain.get(name)
        shown = f"{gain.bpb:+.4f} ± {gain.se:.4f}" if gain else "—"
        local = result.local_window[name]
        lines.append(f"| {label} | {result.bpb[name]:.4f} | {shown} | {result.refocuses_per_token[name]:.3f} | "
                     f"{'—' if local is None else f'{local:.0f}'} |")  # fmt: skip
    lines.append(f"\n{result.windows} windows of {result.length} tokens from {result.documents} documents, the last "
                 f"{result.scored} scored")  # fmt: skip
    return "\n".join(lines)
