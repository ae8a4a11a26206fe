"""SGLang's native /generate answers as a client reads them (the request side is plain JSON the
client builds), and the JSON codec both sides use.

Field names, the finish_reason objects and the error messages follow SGLang's tokenizer manager
and HTTP server (see DESIGN.md §4); the stand-ins write the same (tasks/standins/server_format.py),
and tests/test_sglang_recorded.py reads real 0.5.14 answers with this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

try:  # orjson (a dependency of prefect) is several times faster; the stdlib is the fallback
    import orjson

    loads = orjson.loads

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover
    loads = json.loads

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class MalformedResponse(ValueError):
    """A 200 answer that is not SGLang's /generate shape (treated as a transport failure)."""


@dataclass(frozen=True)
class GenerateReply:
    """One /generate response item as the client reads it."""

    finish: str  # "stop" | "length" | "abort"
    output_ids: list[int]
    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int
    e2e_latency: float | None
    abort_message: str = ""
    abort_status: int | None = None
    # The whole meta_info, for fields only some readers need (a speculative server's spec_*).
    meta: dict[str, Any] = field(default_factory=dict)


def _reply_item(data: Any, body: bytes) -> GenerateReply:
    """One response item; finish_reason may be SGLang's object or a string. "text" is absent
    when the server runs with --skip-tokenizer-init (read as "")."""
    try:
        meta = data["meta_info"]
        reason = meta["finish_reason"]
        finish = reason["type"] if isinstance(reason, dict) else reason
        output_ids = [int(t) for t in data["output_ids"]]
        e2e = meta.get("e2e_latency")
        reply = GenerateReply(
            finish=finish,
            output_ids=output_ids,
            text=str(data.get("text", "")),
            prompt_tokens=int(meta["prompt_tokens"]) if "prompt_tokens" in meta else None,
            completion_tokens=int(meta["completion_tokens"]) if "completion_tokens" in meta else None,
            cached_tokens=int(meta.get("cached_tokens") or 0),
            e2e_latency=float(e2e) if isinstance(e2e, int | float) else None,
            meta=dict(meta),
        )
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise MalformedResponse(f"malformed /generate response ({type(e).__name__}: {e}): {body[:200]!r}") from None
    if finish == "abort":
        status = reason.get("status_code") if isinstance(reason, dict) else None
        message = str(reason.get("message") or "aborted") if isinstance(reason, dict) else "aborted"
        return GenerateReply(**{**reply.__dict__, "abort_message": message,
                                "abort_status": status if is_int(status) else None})
    if finish not in ("stop", "length"):
        raise MalformedResponse(f"unexpected finish_reason {reason!r}")
    return reply


def _load(body: bytes) -> Any:
    try:
        return loads(body)
    except ValueError as e:
        raise MalformedResponse(f"malformed /generate response (not JSON: {e}): {body[:200]!r}") from None


def read_generate_reply(body: bytes) -> GenerateReply:
    """Parse a single-request /generate answer (a one-item list is accepted too)."""
    data = _load(body)
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    return _reply_item(data, body)


def read_generate_replies(body: bytes) -> list[GenerateReply]:
    """Parse a batched /generate answer: a list with one item per prompt, in request order."""
    data = _load(body)
    if not isinstance(data, list) or not data:
        raise MalformedResponse(f"a batched /generate answer must be a non-empty list: {body[:200]!r}")
    return [_reply_item(item, body) for item in data]


def error_message(body: bytes) -> str:
    """The text of an error body: SGLang's {"error": {"message"}}, FastAPI's "detail", or raw text."""
    try:
        data = loads(body)
    except ValueError:
        return body[:500].decode(errors="replace").strip()
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:2000]
    return body[:500].decode(errors="replace")
