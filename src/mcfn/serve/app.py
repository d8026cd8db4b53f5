"""The HTTP app: ``POST /v1/completions`` and ``GET /v1/models`` in the OpenAI protocol, ``GET /v1/mcfn`` (the run's
shapes and policies, for the page) and the page itself at ``/`` (static files, no build step).

Every request is checked before it queues; a bad one is answered with a 4xx and the protocol's error object, and the
server goes on. Decoding happens on one thread (:class:`~mcfn.serve.worker.DecodeWorker`), in arrival order; a
streamed answer is server-sent events (``data: {chunk}``, ending ``data: [DONE]``), and a client that goes away
mid-stream cancels its decode.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from mcfn.core.policy import POLICIES, FocusPolicy, policies
from mcfn.inference.generation import Sampling
from mcfn.serve.protocol import CompletionRequest, ProtocolError, chunk, completion, completion_id, usage
from mcfn.serve.worker import DecodeWorker, Event, Job

STATIC = Path(__file__).parent / "static"
RELAY_S = 0.02  # the most seconds a decoded piece of text waits for the ones after it (:class:`Relay`)


@dataclass(frozen=True)
class Served:
    """What the app serves: the worker, the run's name, the policy it ships, and the limits a request must keep."""

    worker: DecodeWorker
    model_name: str
    shipped: tuple[str, FocusPolicy]
    max_tokens: int = 1024
    max_prompt_tokens: int = 131_072

    def contexts(self) -> list[str]:
        """The focus policies a request may name (``context``): those that generate with this run."""
        return sorted(p.name for p in policies(self.worker.system) if p.generates)


def error_response(error: ProtocolError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def job_of(served: Served, body: CompletionRequest, emit: Callable[[Event], None]) -> Job:
    """A checked request as the worker's job; a :class:`ProtocolError` saying what is wrong otherwise."""
    worker, tok = served.worker, served.worker.tok
    text = body.prompt_text()
    if not text.strip():
        raise ProtocolError(400, "prompt: an empty prompt has nothing to continue", "prompt")
    if not 1 <= body.max_tokens <= served.max_tokens:
        raise ProtocolError(400, f"max_tokens: between 1 and {served.max_tokens}, got {body.max_tokens}", "max_tokens")
    stops = body.stops()
    generating = served.contexts()
    if body.context is None:
        name, policy = served.shipped
        name = f"shipped ({name})"
    elif body.context in generating:
        name, policy = body.context, POLICIES[body.context]
    else:
        known = ", ".join(generating)
        raise ProtocolError(400, f"context: unknown focus policy {body.context!r} (one of {known})", "context")
    ids = [tok.bos_id, *tok.encode(text)]
    if len(ids) > served.max_prompt_tokens:
        raise ProtocolError(413, f"prompt: {len(ids)} tokens, over this server's {served.max_prompt_tokens}", "prompt")
    sampling = Sampling(body.temperature, 0, body.seed if body.seed is not None else 0, body.top_p)
    label = worker.policy_label(name, policy)
    return Job(ids, body.max_tokens, sampling, stops, policy, label, emit)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def streamed(
    served: Served, job: Job, events: asyncio.Queue[Event], ident: str, started: float, with_usage: bool
) -> AsyncIterator[str]:
    """The answer as server-sent events: a chunk a piece of text, one a refocus (its layout under ``mcfn``), the last
    with the finish reason and the figures, the usage where asked, then ``[DONE]``; the events that arrived together
    (:class:`Relay`) in one write."""
    try:
        finished = False
        while not finished:
            batch = [await events.get()]
            while not events.empty():
                batch.append(events.get_nowait())
            written = []
            for event in batch:
                written.append(event_sse(served, event, ident, started, with_usage))
                if finished := event.kind in ("done", "error"):
                    break
            yield "".join(written)
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # a client gone mid-stream (the generator closed early) frees the decoder


def event_sse(served: Served, event: Event, ident: str, started: float, with_usage: bool) -> str:
    """One event as server-sent events (the last event and the usage, where asked, together)."""
    model = served.model_name
    if event.kind == "text":
        copy = {"copy": event.data["copy"], "position": event.data["position"]}
        return sse(chunk(ident, model, event.data["text"], None, copy))
    if event.kind == "refocus":
        return sse(chunk(ident, model, "", None, {"refocus": event.data}))
    if event.kind == "error":
        return sse(ProtocolError(event.data["status"], event.data["message"]).body())
    done = event.data
    figures = {**done["figures"], "seconds": time.perf_counter() - started}
    last = sse(chunk(ident, model, "", done["finish_reason"], {"figures": figures}))
    if with_usage:
        empty = {**chunk(ident, model, "", None), "choices": []}
        last += sse({**empty, "usage": usage(done["prompt_tokens"], done["completion_tokens"])})
    return last


class Relay:
    """A job's events from the decode thread to the request's event loop: text at most :data:`RELAY_S` apart, held
    in between, any other event at once with what is held. A loop wakeup and an HTTP write a token cost the decode
    about a tenth of its tokens/s on 2 cores (LABLOG, thirty-eighth session); 50 writes a second still read as a
    stream. Called on the decode thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Event], clock=time.perf_counter):
        self.loop, self.events, self.clock = loop, events, clock
        self.held: list[Event] = []
        self.last = -RELAY_S  # when the last batch left: the first token goes at once

    def __call__(self, event: Event) -> None:
        self.held.append(event)
        now = self.clock()
        if event.kind == "text" and now - self.last < RELAY_S:
            return
        batch, self.held, self.last = self.held, [], now
        self.loop.call_soon_threadsafe(self.put, batch)

    def put(self, batch: list[Event]) -> None:
        for event in batch:
            self.events.put_nowait(event)


async def answered(served: Served, events: asyncio.Queue[Event], ident: str, started: float) -> dict:
    """The whole answer, once the decode is done."""
    pieces = []
    while (event := await events.get()).kind not in ("done", "error"):
        if event.kind == "text":
            pieces.append(event.data["text"])
    if event.kind == "error":
        raise ProtocolError(event.data["status"], event.data["message"])
    done = event.data
    figures = {**done["figures"], "seconds": time.perf_counter() - started}
    used = usage(done["prompt_tokens"], done["completion_tokens"])
    return completion(ident, served.model_name, "".join(pieces), done["finish_reason"], used, figures)


def build_app(served: Served) -> FastAPI:
    app = FastAPI(title="mcfn", description="A MegaContext run in the OpenAI completions protocol")

    @app.exception_handler(ProtocolError)
    async def refused(_: Request, error: ProtocolError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return error_response(ProtocolError(400, f"the body is not valid JSON: {first.get('msg')}"))
        return error_response(ProtocolError(400, f"{where or 'body'}: {first.get('msg')}", where or None))

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": served.model_name, "object": "model", "created": 0, "owned_by": "mcfn"}
        return {"object": "list", "data": [entry]}

    @app.get("/v1/mcfn")
    async def about() -> dict:
        layout, (name, policy) = served.worker.system.layout, served.shipped
        return {"model": served.model_name, "W": layout.W, "T": layout.T, "K": layout.K, "L": layout.L,
                "shipped": served.worker.policy_label(name, policy), "contexts": served.contexts(),
                "max_tokens": served.max_tokens, "max_prompt_tokens": served.max_prompt_tokens}  # fmt: skip

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        job = job_of(served, body, Relay(loop, events))
        ident, started = completion_id(), time.perf_counter()
        served.worker.submit(job)
        if body.stream:
            with_usage = bool((body.stream_options or {}).get("include_usage"))
            stream = streamed(served, job, events, ident, started, with_usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await answered(served, events, ident, started)

    app.mount("/", StaticFiles(directory=STATIC, html=True), name="page")
    return app
