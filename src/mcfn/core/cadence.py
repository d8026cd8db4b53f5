"""When a stream refocuses: on a clock, or when a copy starts (issue 90).

A refocus every ``R`` tokens reads the far past only as often as the clock ticks, and a copy becomes legible a few
tokens before it is read (LABLOG): ``match`` reads a quarter of full attention's gain over truncation at ``R = 16``
and more than half at ``R = 4``. The **copy** rule refocuses when the newest tokens ask for it, and at the latest
every ``R`` tokens (``R`` stays the budget's reserve: a cut is chosen within ``W - R`` entries):

* after each new token ``t``, its n-gram (the :data:`~mcfn.core.match.NGRAM` tokens ending at ``t``) is looked up
  among the earlier ones. Each earlier occurrence ``p`` is a copy that would read ``p + 1`` next, and weighs
  ``1 / (the occurrences)`` (``match`` votes at the newest alone; this rule was measured with the shared weight);
* the **evidence** is the weight of the occurrences whose continuation ``p + 1`` the context does not show raw (not a
  LOD0 entry of the last refocus's cut, nor a token read after it) and that the last refocus did not already see
  (its newest token's n-gram did not match at the same distance ``t - p``: that copy was in ``match``'s view then,
  and refocusing again for it would choose the same cut);
* a refocus is due when the evidence reaches the rule's ``threshold``, or ``R`` tokens have been read since the last.

Everything read lies at or before the newest token (I11). The check is incremental: an index from each n-gram to
its positions grows by one entry per token, and each token reads only its own n-gram's occurrences (the newest
:data:`LOOKUPS`), never the whole history. :class:`RefocusWatch` is the one decider: generation
(:class:`~mcfn.inference.contexts.MCContexts`) and the evaluation (:mod:`mcfn.evaluation.refocused`) both feed it
their tokens and ask it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from mcfn.core.context import WorkingContext
from mcfn.core.match import NGRAM

CLOCK = "clock"  # a refocus every R tokens
COPY = "copy"  # a refocus when a copy starts, and at the latest every R tokens
RULES = (CLOCK, COPY)
COPY_THRESHOLD = 1.0  # the copy evidence that makes a refocus due (chosen on validation: LABLOG)
LOOKUPS = 64  # the newest occurrences of an n-gram a token reads: its weight stays 1 / (all occurrences)


def rule_name(on: str, every: int) -> str:
    """A rule as the flags and the reports spell it: ``16`` (the clock) or ``copy16`` (the copy event, at the latest
    every 16 tokens)."""
    return str(every) if on == CLOCK else f"{on}{every}"


def decode_label(name: str, rule: str | None, run_every: int, reads_whole: bool = False) -> str:
    """A decoding policy as reports name it: ``name@rule`` under the run's clock ``run_every``; as it is where its name
    says its own rule already (a shipped candidate's, ``rule`` set) or it reads the whole text (``reads_whole``)."""
    return name if reads_whole or rule is not None else f"{name}@{rule_name(CLOCK, run_every)}"


def parse_rule(text: str) -> tuple[str, int]:
    """``rule_name``'s inverse: ``"16"`` → (clock, 16), ``"copy16"`` → (copy, 16); ``ValueError`` otherwise."""
    for on in RULES[1:]:
        if text.startswith(on) and text[len(on) :].isdigit():
            return on, int(text[len(on) :])
    if text.isdigit():
        return CLOCK, int(text)
    raise ValueError(f"a refocus rule is a number of tokens (16) or {', '.join(RULES[1:])} and one (copy16): {text!r}")


class RefocusWatch:
    """One stream's refocus decider. ``tokens``: the history so far (ids); :meth:`refocused` after every refocus,
    with the context it chose; :meth:`due` after each new token."""

    def __init__(self, on: str, every: int, threshold: float, tokens: Iterable[int] = ()):
        if on not in RULES:
            raise ValueError(f"unknown refocus rule {on!r}: one of {', '.join(RULES)}")
        self.on, self.every, self.threshold = on, every, threshold
        self.tokens: list[int] = []
        self.positions: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> the positions it ends at
        self.since = 0  # tokens read since the last refocus
        self.horizon = -1  # the newest token at the last refocus
        self.raw: frozenset[int] = frozenset()  # the positions its cut shows at LOD0
        for token in tokens:
            self._append(token)

    def _append(self, token: int) -> tuple[int, ...] | None:
        """Add a token to the history and the index; its n-gram (None before the first whole one)."""
        self.tokens.append(token)
        t = len(self.tokens) - 1
        gram = self._gram(t)
        if gram is not None:
            self.positions[gram].append(t)
        return gram

    def _gram(self, t: int) -> tuple[int, ...] | None:
        return tuple(self.tokens[t - NGRAM + 1 : t + 1]) if t >= NGRAM - 1 else None

    def refocused(self, context: WorkingContext) -> None:
        """A refocus over the history so far chose ``context`` (``[1, m]``, absolute starts)."""
        self.since, self.horizon = 0, len(self.tokens) - 1
        valid = context.valid[0] & (context.lod[0] == 0)
        self.raw = frozenset(context.start[0][valid].tolist())

    def evidence(self, t: int, gram: tuple[int, ...]) -> float:
        """The copy evidence of token ``t`` (see the module docstring): the weight of its n-gram's earlier
        occurrences whose continuation is hidden and new since the last refocus."""
        earlier = self.positions[gram][:-1]  # the last is t itself
        if not earlier:
            return 0.0
        seen = self._gram(self.horizon)
        hidden = 0
        for p in earlier[-LOOKUPS:]:
            shown = p + 1 > self.horizon or p + 1 in self.raw
            # The last refocus's newest n-gram matched at the same distance: that copy was in its view already.
            old = (
                seen is not None and self.horizon - (t - p) >= NGRAM - 1 and self._gram(self.horizon - (t - p)) == seen
            )
            hidden += not (shown or old)
        return hidden / len(earlier)

    def copy_sources(self) -> list[int]:
        """Where a copy that the newest tokens make would read next: ``p + 1`` for each earlier occurrence ``p`` of the
        newest n-gram (its newest :data:`LOOKUPS`), oldest first; none before the first whole n-gram."""
        gram = self._gram(len(self.tokens) - 1)
        return [] if gram is None else [p + 1 for p in self.positions[gram][:-1][-LOOKUPS:]]

    def due(self, token: int) -> bool:
        """Read a new token; whether a refocus is due before the next prediction."""
        gram = self._append(token)
        self.since += 1
        if self.since >= self.every:
            return True
        if self.on == CLOCK or gram is None:
            return False
        return self.evidence(len(self.tokens) - 1, gram) >= self.threshold


def resolved_rule(own: str | None, run_every: int, on: str | None = None, every: int | None = None) -> tuple[str, int]:
    """The rule a decode runs under (``on``, ``every``): the flags where given, else the policy's ``own`` rule (the
    one a run ships with), else the run's clock ``run_every``."""
    own_on, own_every = parse_rule(own) if own else (CLOCK, run_every)
    return on or own_on, every or own_every
