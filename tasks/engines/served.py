"""What a generation server says it serves, and whether that can serve the run's target.

SGLang 0.5.14 describes itself on two endpoints (entrypoints/http_server.py):
- /get_model_info: model_path, tokenizer_path, is_generation, preferred_sampling_params,
  weight_version;
- /server_info (older: /get_server_info): its server args (model_path, served_model_name,
  context_length: the --context-length flag, null when the model's own applies), the
  scheduler's max_total_num_tokens and max_req_input_len, and version.
Neither reports a vocabulary size, so the ids of every answer are checked against the target's
vocabulary instead (SGLangEngine); a server that does report one ("vocab_size") is held to it.

What is a hard mismatch, and why:
- a vocabulary size other than the target's: its ids mean other tokens, and every row would be
  dropped later as invalid (or, worse, be wrong);
- `is_generation: false`: an embedding or reward model answers no /generate;
- a context length that leaves more planned prompts without room for sampling.max_new_tokens
  than generate.max_dead_fraction allows: those prompts are certain dead letters, so the run is
  certain to fail (if every shard stayed within the bound, the whole would too), and it would
  fail only after generating everything else. Fewer than that is what the dead-letter bound is
  for, and only noted;
- the model path is not: a server may load the same weights from another folder, a mount or a
  hub id, so a differing path is noted, and the answers' ids decide.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class ServedModel:
    """One server's account of itself; None where it says nothing."""

    url: str  # as shown (credentials redacted)
    model_path: str | None
    context_length: int | None
    vocab_size: int | None
    is_generation: bool | None


def read_served_model(url: str, model_info: dict[str, Any], server_info: dict[str, Any]) -> ServedModel:
    """A ServedModel from the bodies of /get_model_info and /server_info ({} when absent)."""
    nested = server_info.get("server_args")
    info = {**nested, **server_info} if isinstance(nested, dict) else dict(server_info)
    context = _int(info.get("context_length"))
    if context is None and _int(info.get("max_req_input_len")) is not None:
        # No --context-length: the scheduler's longest input is the context length less one.
        context = info["max_req_input_len"] + 1
    path = model_info.get("model_path") or info.get("model_path")
    generation = model_info.get("is_generation")
    return ServedModel(
        url=url,
        model_path=str(path) if path else None,
        context_length=context,
        vocab_size=_int(model_info.get("vocab_size", info.get("vocab_size"))),
        is_generation=generation if isinstance(generation, bool) else None,
    )


@dataclass(frozen=True)
class TargetNeeds:
    """What every server of a run must serve: the target's vocabulary, and room for the planned
    prompts (their token counts, sorted) plus sampling.max_new_tokens."""

    model_path: str
    vocab_size: int
    max_new_tokens: int
    prompt_tokens: tuple[int, ...]
    max_dead_fraction: float

    def overflowing(self, context_length: int) -> int:
        """Planned prompts SGLang refuses on this context (input + max_new_tokens >= context)."""
        return len(self.prompt_tokens) - bisect.bisect_left(
            self.prompt_tokens, context_length - self.max_new_tokens
        )

    def problems(self, served: ServedModel) -> list[str]:
        out = []
        if served.vocab_size is not None and served.vocab_size != self.vocab_size:
            out.append(f"vocabulary of {served.vocab_size} ids, the target's has {self.vocab_size}")
        if served.is_generation is False:
            out.append("it serves an embedding or reward model (is_generation: false)")
        if served.context_length is not None and self.prompt_tokens:
            n, total = self.overflowing(served.context_length), len(self.prompt_tokens)
            if n / total > self.max_dead_fraction:
                out.append(
                    f"context length {served.context_length} tokens: {n} of {total} planned prompts "
                    f"({n / total:.1%}) leave no room for sampling.max_new_tokens ({self.max_new_tokens}), "
                    f"more than generate.max_dead_fraction ({self.max_dead_fraction:.1%}) allows"
                )
        return out

    def notes(self, served: ServedModel) -> list[str]:
        out = []
        if served.model_path is not None and served.model_path != self.model_path:
            out.append(
                f"{served.url} serves {served.model_path!r}, the target is {self.model_path!r} "
                "(the same weights may lie elsewhere: the ids of its answers are checked)"
            )
        if served.context_length is None:
            out.append(f"{served.url} reports no context length; prompts too long for it die as context_overflow")
        elif n := self.overflowing(served.context_length):
            out.append(
                f"{served.url}: {n} of {len(self.prompt_tokens)} planned prompts do not fit its context "
                f"length {served.context_length} with sampling.max_new_tokens {self.max_new_tokens}; "
                "they will be context_overflow dead letters"
            )
        return out

    def refusal(self, served: ServedModel, problems: list[str]) -> str:
        return (
            f"{served.url} cannot serve this run: {'; '.join(problems)}. It serves "
            f"{served.model_path or 'a model it does not name'}; the target is {self.model_path}. "
            "Fix: point engine.endpoints at servers launched with the target (SGLang --model-path) "
            "and a context length that holds the prompts, then rerun"
        )

    def out_of_vocabulary(self, url: str, ids: list[int]) -> str | None:
        """Why an answer's ids cannot be the target's, or None when they can be."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is None:
            return None
        return (
            f"{url} answered token id {bad}, outside the target's vocabulary of {self.vocab_size} "
            f"ids (config.json vocab_size of {self.model_path}): it serves another model. Nothing "
            "of that answer was kept. Fix: point engine.endpoints at servers launched with the "
            "target (SGLang --model-path), then rerun"
        )
