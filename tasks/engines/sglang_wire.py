"""SGLang's native /generate answers as a client reads them (the request side is plain JSON the
client builds), and the JSON codec both sides use.

Field names, the finish_reason objects and the error messages follow SGLang's tokenizer manager
and HTTP server (see docs/DESIGN.md §7); the stand-ins write the same (tasks/standins/server_format.py),
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
class TokenLogprob:
    """One `[logprob, token_id, text]` entry of SGLang's logprob fields (text is null unless the
    request asks for return_text_in_logprobs; it is not kept)."""

    logprob: float | None
    token_id: int


@dataclass(frozen=True)
class ReplyLogprobs:
    """The logprob fields of a /generate answer to a request with return_logprob, as SGLang's
    scheduler and tokenizer manager fill them (0.5.x):

    - `input_token`: one entry per input token from logprob_start_len on; entry j is the token at
      input position start + j with its logprob given the input before it, except entry 0, whose
      logprob is null (SGLang computes the distributions at positions start..end-1, each for the
      token after it, and pads the first entry);
    - `input_top`: the same positions' top_logprobs_num best tokens, best first (entry 0 null);
      empty when the request asked for no top logprobs (SGLang then omits the field);
    - `output_token`, `output_top`: the same for each generated token.
    """

    input_token: list[TokenLogprob]
    input_top: list[list[TokenLogprob] | None]
    output_token: list[TokenLogprob]
    output_top: list[list[TokenLogprob] | None]


LOGPROB_FIELDS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs")


def _entry(v: Any, where: str, null_logprob: bool) -> TokenLogprob:
    if not isinstance(v, list | tuple) or len(v) != 3:
        raise MalformedResponse(f"{where} must be [logprob, token_id, text], got {v!r}")
    logprob, token, text = v
    if logprob is None and not null_logprob:
        raise MalformedResponse(f"{where}: logprob is null")
    if logprob is not None and (isinstance(logprob, bool) or not isinstance(logprob, int | float) or logprob > 1e-6):
        raise MalformedResponse(f"{where}: logprob must be a number <= 0, got {logprob!r}")
    if not is_int(token) or token < 0:
        raise MalformedResponse(f"{where}: token_id must be an integer >= 0, got {token!r}")
    if text is not None and not isinstance(text, str):
        raise MalformedResponse(f"{where}: text must be a string or null, got {text!r}")
    return TokenLogprob(None if logprob is None else float(logprob), token)


def _entries(v: Any, where: str, first_null: bool) -> list[TokenLogprob]:
    if not isinstance(v, list):
        raise MalformedResponse(f"{where} must be a list, got {type(v).__name__}")
    return [_entry(x, f"{where}[{i}]", first_null and i == 0) for i, x in enumerate(v)]


def _tops(v: Any, where: str, first_null: bool) -> list[list[TokenLogprob] | None]:
    if not isinstance(v, list):
        raise MalformedResponse(f"{where} must be a list, got {type(v).__name__}")
    out: list[list[TokenLogprob] | None] = []
    for i, x in enumerate(v):
        if x is None and first_null and i == 0:
            out.append(None)
            continue
        top = _entries(x, f"{where}[{i}]", False)
        if any(a.logprob < b.logprob for a, b in zip(top, top[1:], strict=False)):  # type: ignore[operator]
            raise MalformedResponse(f"{where}[{i}]: not sorted best first: {x!r}")
        out.append(top)
    return out


def read_logprobs(meta: dict[str, Any]) -> ReplyLogprobs | None:
    """The logprob fields of a meta_info, strictly: None when the answer has none; a field of
    the wrong shape is a MalformedResponse naming it and the entry."""
    if "input_token_logprobs" not in meta and "output_token_logprobs" not in meta:
        return None
    for have, lack in (LOGPROB_FIELDS[:2], LOGPROB_FIELDS[1::-1]):
        if lack not in meta:
            raise MalformedResponse(f"meta_info has {have} but no {lack}")
    has_top = "input_top_logprobs" in meta or "output_top_logprobs" in meta
    if has_top and not ("input_top_logprobs" in meta and "output_top_logprobs" in meta):
        raise MalformedResponse("meta_info has one of input_top_logprobs and output_top_logprobs without the other")
    logprobs = ReplyLogprobs(
        input_token=_entries(meta["input_token_logprobs"], "meta_info.input_token_logprobs", True),
        input_top=_tops(meta["input_top_logprobs"], "meta_info.input_top_logprobs", True) if has_top else [],
        output_token=_entries(meta["output_token_logprobs"], "meta_info.output_token_logprobs", False),
        output_top=_tops(meta["output_top_logprobs"], "meta_info.output_top_logprobs", False) if has_top else [],
    )
    if has_top and len(logprobs.input_top) != len(logprobs.input_token):
        raise MalformedResponse(f"meta_info.input_top_logprobs has {len(logprobs.input_top)} positions, "
                                f"input_token_logprobs {len(logprobs.input_token)}")
    if has_top and len(logprobs.output_top) != len(logprobs.output_token):
        raise MalformedResponse(f"meta_info.output_top_logprobs has {len(logprobs.output_top)} positions, "
                                f"output_token_logprobs {len(logprobs.output_token)}")
    return logprobs


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
    stop_token: int | None = None  # the token id a "stop" finish matched (SGLang's finish_reason.matched)
    # The whole meta_info, for fields only some readers need (a speculative server's spec_*).
    meta: dict[str, Any] = field(default_factory=dict)
    logprobs: ReplyLogprobs | None = None  # with return_logprob (read_logprobs)


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
            stop_token=reason.get("matched") if isinstance(reason, dict) and is_int(reason.get("matched")) else None,
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
    logprobs = read_logprobs(reply.meta)
    return reply if logprobs is None else GenerateReply(**{**reply.__dict__, "logprobs": logprobs})


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
