"""The `local` engine: a transformers model in-process, on CPU or one GPU.

Validation (SGLang's 400s become dead letters), batching by prompt length, a lock around the
model for concurrent callers, and health counters; the decode loop is in `local_decode`.

Output conventions follow SGLang's /generate: `output_ids` are the generated tokens up to and
including the stop (eos) token; `completion_tokens == len(output_ids)`; `text` decodes them
with special tokens skipped (so it never shows the eos). As in SGLang, the length limit is
checked first: a reply whose `max_new_tokens`-th token is eos finishes with "length".
Sampled rows are seeded per request (`GenerationRequest.seed()`), so batching does not change
them; see `local_decode` for how far that holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import torch
from transformers import AutoModelForCausalLM

from tasks.engines.base import (
    DeadLetter,
    EngineUnavailable,
    GenerationRequest,
    GenerationResult,
    Outcome,
    OutcomeSink,
    ServerHealth,
)
from tasks.engines.local_decode import BatchDecoder
from tasks.engines.served import TargetNeeds
from tasks.target.model_dir import context_length_of, read_model_config, resolve_model_dir
from tasks.target.tokenizer import load_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LocalEngine:
    """Engine protocol over a local HF causal LM; thread-safe (one batch on the model at once)."""

    name = "local"

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 8,
        chat_template: str | None = None,
        *,
        context_length: int | None = None,
        revision: str | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        model_dir = resolve_model_dir(model_path, revision)
        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self.tokenizer = load_tokenizer(model_path, chat_template, revision=revision)
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=_DTYPES[dtype], local_files_only=True
            )
            .to(self.device)
            .eval()
        )
        model_context = context_length_of(read_model_config(model_dir))
        if context_length is None and model_context is None:
            raise ValueError(
                f"{model_path}: config.json has no max_position_embeddings; pass context_length"
            )
        self.context_length: int = context_length or model_context
        self.vocab_size: int = self.model.get_input_embeddings().weight.shape[0]
        self.eos_ids = self._eos_ids()
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids, default=0)
        self._decoder = BatchDecoder(self.model, self.pad_id, self.eos_ids)
        self._model_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._in_flight = 0
        self._completed = 0
        self._failures = 0
        self._last_error = ""
        self._closed = False

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list | tuple):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # -- validation ---------------------------------------------------------------------

    def _reject(self, request: GenerationRequest) -> DeadLetter | None:
        """A dead letter for a request that cannot run, mirroring SGLang's 400s."""
        n, s = len(request.input_ids), request.sampling

        def dead(error_class: str, message: str) -> DeadLetter:
            return DeadLetter(request.request_id, error_class, message, server=self.name)

        if n == 0:
            return dead("invalid_input", "input_ids is empty")
        bad = next((t for t in request.input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return dead(
                "invalid_input",
                f"input_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})",
            )
        if s.max_new_tokens < 1:
            return dead("invalid_input", f"max_new_tokens must be >= 1, got {s.max_new_tokens}")
        if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k == 0 or s.top_k < -1:
            return dead(
                "invalid_input",
                f"bad sampling params: temperature={s.temperature} (>= 0), "
                f"top_p={s.top_p} (in (0, 1]), top_k={s.top_k} (-1 or >= 1)",
            )
        if n + s.max_new_tokens > self.context_length:
            return dead(
                "context_overflow",
                f"prompt of {n} tokens + max_new_tokens {s.max_new_tokens} = "
                f"{n + s.max_new_tokens} tokens exceeds the model's context length "
                f"of {self.context_length} tokens",
            )
        return None

    # -- decoding -----------------------------------------------------------------------

    def _decode(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return [
            GenerationResult(
                request_id=row.request.request_id,
                output_ids=row.output_ids,
                text=self.tokenizer.decode(row.output_ids, skip_special_tokens=True),
                finish_reason=row.finish_reason,
                prompt_tokens=len(row.request.input_ids),
                completion_tokens=len(row.output_ids),
                latency_s=0.0,
                server=self.name,
            )
            for row in self._decoder.decode(requests)
        ]

    def _run_batch(self, batch: list[GenerationRequest]) -> list[GenerationResult]:
        with self._stats_lock:
            self._in_flight += len(batch)
        try:
            with self._model_lock:
                if self._closed:
                    raise EngineUnavailable("the local engine is closed")
                start = time.perf_counter()
                try:
                    results = self._decode(batch)
                except (RuntimeError, ValueError) as e:
                    with self._stats_lock:
                        self._failures += 1
                        self._last_error = f"{type(e).__name__}: {e}"
                    raise EngineUnavailable(
                        f"local engine failed on a batch of {len(batch)}: {e}"
                    ) from e
                latency = time.perf_counter() - start
        finally:
            with self._stats_lock:
                self._in_flight -= len(batch)
        for result in results:
            result.latency_s = latency
        with self._stats_lock:
            self._completed += len(results)
        return results

    def _plan(
        self, requests: list[GenerationRequest]
    ) -> tuple[list[tuple[int, DeadLetter]], list[list[tuple[int, GenerationRequest]]]]:
        """Dead letters for requests that cannot run, and batches of the rest.

        Batches group similar prompt lengths (less padding); results are placed by index.
        """
        dead: list[tuple[int, DeadLetter]] = []
        runnable: list[tuple[int, GenerationRequest]] = []
        for index, request in enumerate(requests):
            rejection = self._reject(request)
            if rejection is None:
                runnable.append((index, request))
            else:
                dead.append((index, rejection))
        runnable.sort(key=lambda item: len(item[1].input_ids))
        batches = [
            runnable[i : i + self.batch_size] for i in range(0, len(runnable), self.batch_size)
        ]
        return dead, batches

    # -- Engine protocol ----------------------------------------------------------------

    def generate_batch(self, requests: list[GenerationRequest]) -> list[Outcome]:
        """One outcome per request, in the order of `requests`."""
        if self._closed:
            raise EngineUnavailable("the local engine is closed")
        dead, batches = self._plan(list(requests))
        outcomes: list[Outcome | None] = [None] * len(requests)
        for index, letter in dead:
            outcomes[index] = letter
        for batch in batches:
            for (index, _), result in zip(
                batch, self._run_batch([r for _, r in batch]), strict=True
            ):
                outcomes[index] = result
        return [o for o in outcomes if o is not None]

    def generate(self, requests: Iterable[GenerationRequest], sink: OutcomeSink) -> None:
        if self._closed:
            raise EngineUnavailable("the local engine is closed")
        dead, batches = self._plan(list(requests))
        for _, letter in dead:
            sink(letter)
        for batch in batches:
            # The sink runs outside the model lock so a slow sink never stalls other callers.
            for result in self._run_batch([r for _, r in batch]):
                sink(result)

    def check_servers(self, needs: TargetNeeds) -> list[str]:
        return []  # it runs the target itself

    def health(self) -> list[ServerHealth]:
        with self._stats_lock:
            return [
                ServerHealth(
                    url=f"local://{self.device}",
                    healthy=not self._closed,
                    in_flight=self._in_flight,
                    completed=self._completed,
                    failures=self._failures,
                    last_error=self._last_error,
                    extra={
                        "model_path": self.model_path,
                        "dtype": self.dtype,
                        "batch_size": self.batch_size,
                        "context_length": self.context_length,
                    },
                )
            ]

    def close(self) -> None:
        with self._model_lock:
            if self._closed:
                return
            self._closed = True
            del self.model, self._decoder
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
