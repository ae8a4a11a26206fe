"""SGLang's native /generate request and answer format as the stand-in servers speak it: request
validation with SGLang's 400 messages, and answer items with exactly the keys a real SGLang
0.5.14 returns (tests/fixtures/sglang-0.5.14/gen-*.json). The client's side is
tasks/engines/sglang_wire.py."""

from __future__ import annotations

import time
import uuid
from typing import Any

from tasks.engines.base import SamplingParams
from tasks.engines.sglang_wire import is_int
from tasks.standins.backends import BackendInput, BackendOutput, LogprobRequest

# sampling_params keys SGLang's SamplingParams accepts; any other key is a 400, as in SGLang.
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
        "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
        "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "custom_params",
        "stream_interval", "logit_bias", "sampling_seed",
    }
)  # fmt: skip
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params omits it


class RequestError(ValueError):
    """A malformed or unservable request: HTTP 400 with {"error": {"message": ...}}."""


def error_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message}}


def _is_id_list(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(x) and x >= 0 for x in v)


def parse_sampling(raw: Any, where: str) -> tuple[SamplingParams, bool, float, int | None]:
    """SGLang's sampling_params object -> (SamplingParams, ignore_eos, frequency_penalty,
    sampling_seed as sent, None when absent)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"{where} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - SGLANG_SAMPLING_KEYS)
    if unknown:
        raise RequestError(f"{where}: unknown field(s) {unknown}")
    temperature = raw.get("temperature", 1.0)
    top_p = raw.get("top_p", 1.0)
    top_k = raw.get("top_k", -1)
    max_new = raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    seed = raw.get("sampling_seed", 0)
    ignore_eos = raw.get("ignore_eos", False)
    if not isinstance(temperature, int | float) or isinstance(temperature, bool) or temperature < 0:
        raise RequestError(f"{where}.temperature must be a number >= 0, got {temperature!r}")
    if not isinstance(top_p, int | float) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise RequestError(f"{where}.top_p must be in (0, 1], got {top_p!r}")
    if not is_int(top_k) or (top_k < 1 and top_k != -1):
        raise RequestError(f"{where}.top_k must be -1 or an integer >= 1, got {top_k!r}")
    if max_new is None:
        max_new = DEFAULT_MAX_NEW_TOKENS
    if not is_int(max_new) or max_new < 0:
        raise RequestError(f"{where}.max_new_tokens must be an integer >= 0, got {max_new!r}")
    if not is_int(seed):
        raise RequestError(f"{where}.sampling_seed must be an integer, got {seed!r}")
    if not isinstance(ignore_eos, bool):
        raise RequestError(f"{where}.ignore_eos must be true or false, got {ignore_eos!r}")
    penalty = raw.get("frequency_penalty", 0.0)
    if not isinstance(penalty, int | float) or isinstance(penalty, bool) or not -2 <= penalty <= 2:
        raise RequestError(f"frequency_penalty must be in [-2, 2], got {penalty}.")  # SGLang's check and bounds
    params = SamplingParams(float(temperature), float(top_p), top_k, max_new, seed)
    return params, ignore_eos, float(penalty), raw.get("sampling_seed")


def _per_item(body: dict[str, Any], key: str, default: Any, n: int, batched: bool) -> list[Any]:
    """A /generate field given once for every prompt or, in a batch, as a list of one per prompt."""
    value = body.get(key, default)
    if batched and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{key}: expected {n} values, got {len(value)}")
        return list(value)
    return [value] * n


def parse_logprobs(return_logprob: Any, start: Any, top_n: Any, n_input: int) -> LogprobRequest | None:
    """SGLang's return_logprob, logprob_start_len and top_logprobs_num for one prompt."""
    if return_logprob is None or return_logprob is False:
        return None
    if return_logprob is not True:
        raise RequestError(f"return_logprob must be true or false, got {return_logprob!r}")
    if not is_int(start) or start < -1:
        raise RequestError(f"logprob_start_len must be an integer >= -1, got {start!r}")
    if not is_int(top_n) or top_n < 0:
        raise RequestError(f"top_logprobs_num must be an integer >= 0, got {top_n!r}")
    if start >= n_input:
        raise RequestError(f"logprob_start_len ({start}) is higher than the number of input tokens ({n_input}). "
                           "Request with a lower logprob_start_len.")  # fmt: skip
    return LogprobRequest(n_input - 1 if start == -1 else start, top_n)


def check_context(n_input: int, max_new: int, context_length: int) -> None:
    """SGLang's two length checks, with its wording (both name the context length)."""
    if n_input >= context_length:
        raise RequestError(
            f"The input ({n_input} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    if n_input + max_new >= context_length:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {n_input + max_new} tokens: "
            f"{n_input} tokens from the input messages and {max_new} tokens for the completion. "
            f"Please reduce the number of tokens in the input messages or the completion to fit "
            f"within the limit."
        )


def parse_generate(body: Any, tokenize: Any, context_length: int) -> tuple[list[BackendInput], bool]:
    """A /generate body -> (inputs, batched). `tokenize(text)` serves requests sent as text."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    input_ids = body.get("input_ids")
    text = body.get("text")
    if input_ids is None and text is None:
        raise RequestError("Either text or input_ids should be provided.")
    if input_ids is not None and text is not None:
        raise RequestError("Either text or input_ids should be provided, not both.")
    if input_ids is not None:
        if _is_id_list(input_ids) and input_ids:
            prompts, batched = [input_ids], False
        elif isinstance(input_ids, list) and input_ids and all(_is_id_list(x) and x for x in input_ids):
            prompts, batched = list(input_ids), True
        else:
            raise RequestError(
                "input_ids must be a non-empty list of token ids (integers >= 0) or a non-empty "
                "list of such lists"
            )
    elif isinstance(text, str):
        prompts, batched = [tokenize(text)], False
    elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        prompts, batched = [tokenize(t) for t in text], True
    else:
        raise RequestError("text must be a string or a non-empty list of strings")
    n = len(prompts)

    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif not batched and isinstance(rid, str):
        rids = [rid]
    elif batched and isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
        rids = list(rid)
    else:
        want = f"a list of {n} strings" if batched else "a string"
        raise RequestError(f"rid must be {want}, got {rid!r}")
    if len(set(rids)) != n:
        raise RequestError("rid: duplicate request ids in one batch")

    raw_sp = body.get("sampling_params")
    if batched and isinstance(raw_sp, list):
        if len(raw_sp) != n:
            raise RequestError(f"sampling_params: expected {n} objects, got {len(raw_sp)}")
        sps = [parse_sampling(sp, f"sampling_params[{i}]") for i, sp in enumerate(raw_sp)]
    else:
        sps = [parse_sampling(raw_sp, "sampling_params")] * n

    logprobs = zip(_per_item(body, "return_logprob", False, n, batched), _per_item(body, "logprob_start_len", -1, n, batched),
                   _per_item(body, "top_logprobs_num", 0, n, batched), strict=True)  # fmt: skip
    items = []
    for ids, r, (sp, ignore_eos, penalty, seed), lp in zip(prompts, rids, sps, logprobs, strict=True):
        check_context(len(ids), sp.max_new_tokens, context_length)
        items.append(BackendInput(r, ids, sp, ignore_eos, penalty, parse_logprobs(*lp, len(ids)), seed))
    return items, batched


def response_item(item: BackendInput, out: BackendOutput, e2e_latency: float, with_text: bool = True) -> dict[str, Any]:
    """One /generate answer item with exactly the keys a real SGLang 0.5.14 returns
    (tests/fixtures/sglang-0.5.14/gen-*.json); a speculative backend's spec_* fields come before
    response_sent_to_client_ts, as there. Without a tokenizer (--skip-tokenizer-init) there is
    no "text"."""
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(item.input_ids),
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        # SGLang reports where cached tokens came from, and null when none were cached.
        "cached_tokens_details": {"device": out.cached_tokens, "host": 0} if out.cached_tokens else None,
        "dp_rank": None,
        "e2e_latency": e2e_latency,
        **out.meta_extra,
        "response_sent_to_client_ts": time.time(),
    }
    answer: dict[str, Any] = {"text": out.text} if with_text else {}
    return {**answer, "output_ids": out.output_ids, "meta_info": meta}


def abort_item(item: BackendInput, message: str, status_code: int, e2e_latency: float, with_text: bool = True) -> dict[str, Any]:
    """An aborted request as SGLang reports it: HTTP 200, finish_reason type "abort"."""
    out = BackendOutput([], "", {"type": "abort", "message": message, "status_code": status_code})
    return response_item(item, out, e2e_latency, with_text)
