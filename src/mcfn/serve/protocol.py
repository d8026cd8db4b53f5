"""The OpenAI completions protocol as this server speaks it: the request (with the ``context`` extension), the answer,
the streamed chunks and the errors, as JSON-ready dicts."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class CompletionRequest(BaseModel):
    """``POST /v1/completions``'s body. Fields this server does not read (``n``, ``logprobs``, ...) are refused rather
    than ignored, except those a client library sends by default, so no request is answered as if they held."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str]
    max_tokens: int = 16
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # mcfn's extension: the focus policy (train.generate's --context names), by default the run's shipped one
    context: str | None = None

    def prompt_text(self) -> str:
        """The one prompt; a list is accepted with exactly one string, as the protocol allows."""
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ProtocolError(400, "prompt: this server completes one prompt a request", "prompt")
            return self.prompt[0]
        return self.prompt

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ProtocolError(400, "stop: at most 4 non-empty strings", "stop")
        return stops


class ProtocolError(Exception):
    """A request this server refuses: its HTTP status and what is wrong, answered as the protocol's error object."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(ident: str, model: str, text: str, finish_reason: str, used: dict[str, int], figures: dict) -> dict:
    """A whole answer (``object: text_completion``), mcfn's figures under ``mcfn`` (clients ignore it)."""
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
    return {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": used, "mcfn": figures}  # fmt: skip


def chunk(ident: str, model: str, text: str, finish_reason: str | None, events: dict | None = None) -> dict:
    """One streamed piece: a choice with the new text (``finish_reason`` on the last), mcfn's events (refocuses,
    copies, figures) under ``mcfn``."""
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
    body = {"id": ident, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}
    return {**body, "mcfn": events} if events else body
