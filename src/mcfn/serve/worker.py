"""One decode at a time: a thread that takes requests from a queue in arrival order and runs each through the one
decode loop (:func:`mcfn.inference.generation.decode`), the model never shared across threads.

A request's :class:`Job` carries what to decode and hears what happens as :class:`Event` s (a refocus, a piece of
text, the end), through a callback that may hand them to another thread's event loop. Setting ``job.cancelled`` (a
client that went away) ends its decode before the next token, freeing the worker for the next request.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mcfn.core.cadence import decode_label, resolved_rule
from mcfn.core.focus import REFOCUS_STEPS, WARM_STEPS, Refocus
from mcfn.core.policy import FULL, FocusPolicy
from mcfn.core.system import MegaContext
from mcfn.data.tokenizer import Tokenizer
from mcfn.errors import UserError
from mcfn.inference.contexts import FullContexts, MCContexts
from mcfn.inference.generation import Sampling, decode, mc_contexts, pick_token

COPY_SOURCES = 4  # a copy is drawn where the newest n-gram occurred at most this often before (a distinct one)


@dataclass(frozen=True)
class Event:
    kind: str  # "refocus" | "text" | "done" | "error"
    data: dict[str, Any]


@dataclass
class Job:
    prompt: list[int]  # token ids, BOS first
    max_tokens: int
    sampling: Sampling
    stops: list[str]
    policy: FocusPolicy
    policy_name: str  # as the answer names it: "shipped (lens), refocus copy16", "full"
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class TextStream:
    """The decoded tokens as text, given out as it becomes final: never past a stop sequence (which ends the text,
    left out of it), never a piece that may still turn into one, never half a character."""

    def __init__(self, tok: Tokenizer, stops: list[str]):
        self.tok, self.stops = tok, stops
        self.ids: list[int] = []
        self.given = 0  # characters handed out
        self.stopped = False

    def add(self, token: int) -> str:
        """Read one token; the text that became final (maybe empty). Sets ``stopped`` at a stop sequence."""
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self.take(text[: min(hits)])
        held = max([n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
        final = text[: len(text) - held]
        return self.take(final.rstrip("\ufffd"))  # a character whose bytes are not all decoded yet waits

    def finish(self) -> str:
        """The rest, once no token follows."""
        return "" if self.stopped else self.take(self.tok.decode(self.ids))

    def take(self, final: str) -> str:
        piece = final[self.given :] if len(final) > self.given else ""
        self.given = max(self.given, len(final))
        return piece


class DecodeWorker:
    """The run's model behind a queue. ``submit`` returns at once; the job's events arrive on the thread that runs
    :meth:`serve`: ``train.serve``'s main thread, where the model was loaded, or a thread of the worker's own
    (:meth:`start`, for a server embedded in another program). Decoding where the model was loaded keeps the process
    at one OpenMP team: a second thread's team puts more threads than cores under libgomp, whose helpers then stop
    spinning between the decode's small operations (LABLOG, thirty-eighth session: streamed at 0.71–0.75 of
    ``train.generate``'s tokens/s on 2 cores from a thread of its own, 0.83–0.97 from the main thread)."""

    def __init__(self, system: MegaContext, tok: Tokenizer, device: torch.device, refocus_every: int, compile_fn=None):
        self.system, self.tok, self.device = system, tok, device
        self.refocus_every, self.compile_fn = refocus_every, compile_fn
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread: threading.Thread | None = None

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def start(self) -> DecodeWorker:
        """Serve on a thread of the worker's own."""
        self.thread = threading.Thread(target=self.serve, name="mcfn-decode", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        """End :meth:`serve` once the jobs queued before have been served."""
        self.jobs.put(None)

    def close(self) -> None:
        self.stop()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def serve(self) -> None:
        """Decode the queued jobs in arrival order on the calling thread, until :meth:`stop`."""
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                continue
            try:
                self.run(job)
            except UserError as e:
                job.emit(Event("error", {"status": 400, "message": str(e)}))
            except Exception as e:  # the server keeps serving: the request hears what went wrong
                job.emit(Event("error", {"status": 500, "message": f"{type(e).__name__}: {e}"}))

    def rule(self, policy: FocusPolicy) -> tuple[str, int]:
        return resolved_rule(policy.rule, self.refocus_every)

    def contexts(self, job: Job) -> MCContexts | FullContexts:
        if job.policy is FULL:
            return FullContexts(self.system.base, len(job.prompt) + job.max_tokens, self.device, self.compile_fn)
        on, every = self.rule(job.policy)
        refocus = Refocus(every, REFOCUS_STEPS, WARM_STEPS, on)

        def on_refocus(n: int, layout: str) -> None:
            stats = contexts.stats
            job.emit(Event("refocus", {"history": n, "layout": layout, "refocuses": len(stats.layouts),
                                       "cache_kept": stats.cache_kept}))  # fmt: skip

        contexts = mc_contexts(self.system, job.policy, refocus, self.device, self.compile_fn, on_refocus=on_refocus)
        return contexts

    @torch.no_grad()
    def run(self, job: Job) -> None:
        contexts = self.contexts(job)
        prompt = torch.tensor(job.prompt, dtype=torch.int64, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(job.sampling.seed)
        text = TextStream(self.tok, job.stops)

        def choose(logits: torch.Tensor, i: int) -> torch.Tensor | None:
            if job.cancelled.is_set() or text.stopped:
                return None
            token = pick_token(logits, job.sampling, generator)
            piece = text.add(int(token))
            watch = getattr(contexts, "watch", None)  # MegaContext's refocus watch, set once the prompt is read
            sources = [] if watch is None else watch.copy_sources()
            copy = sources if 0 < len(sources) <= COPY_SOURCES else []
            if text.stopped:
                return None  # the token that completes a stop sequence is not part of the answer
            job.emit(Event("text", {"text": piece, "index": i, "position": len(job.prompt) + i, "copy": copy}))
            return token

        out, stats = decode(contexts, prompt, job.max_tokens, choose)
        rest = text.finish()
        if rest:
            job.emit(Event("text", {"text": rest, "index": out.numel(), "position": -1, "copy": []}))
        finish = "stop" if text.stopped else "length"
        figures = {
            "policy": job.policy_name,
            "tokens_per_s": stats.tokens_per_s,
            "refocuses": len(stats.layouts),
            "refocuses_per_token": stats.refocuses_per_token,
            "cache_kept": stats.cache_kept,
            "prefill_s": stats.prefill_s,
            "decode_s": stats.decode_s,
            "history": len(job.prompt) + out.numel(),
            "block": self.system.layout.K,
        }
        job.emit(Event("done", {"finish_reason": finish, "prompt_tokens": len(job.prompt),
                                "completion_tokens": out.numel(), "figures": figures,
                                "cancelled": job.cancelled.is_set()}))  # fmt: skip

    def policy_label(self, name: str, policy: FocusPolicy) -> str:
        """The policy and the rule it decodes under (a shipped candidate's name says its own already)."""
        return decode_label(name, policy.rule, self.refocus_every, policy is FULL)
