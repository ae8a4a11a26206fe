"""Hidden states of a local transformers causal LM, the way an EAGLE-3 draft consumes them.

Two views of the same tensors:
- `LocalCapture.capture`: whole sequences, batched with right padding (extraction). Each
  row's positions start at 0 and padding sits after its last real token, so a causal mask
  keeps a row's states independent of what else is in the batch, up to kernel rounding.
- `decode_capture`: incremental greedy decoding with a KV cache, recording for every
  position the states the target produced at that step: exactly what a local speculative
  engine hands its draft. The extraction tests pin the two against each other.

"aux" states are the OUTPUTS of the decoder layers named by `aux_layer_ids` (forward hooks
on those layers; = HF's `output_hidden_states[i + 1]`), concatenated in id order; "last" is
the final hidden state after the model's final norm. The layer-id convention itself is
`tasks.extract.capture`'s; this module takes explicit ids.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CapturedStates:
    """One sequence's states: aux [T, k·H] (aux layers concatenated in id order, as SGLang
    concatenates them for the draft's fc) and last [T, H] (after the final norm)."""

    aux: torch.Tensor
    last: torch.Tensor


@dataclass
class DecodeCapture:
    """Tokens (prompt + generated) and the states of every position, in order."""

    token_ids: list[int]
    prompt_len: int
    aux: torch.Tensor
    last: torch.Tensor
    finish_reason: str  # "stop" | "length"


def decoder_stack(model: PreTrainedModel) -> tuple[nn.Module, nn.ModuleList]:
    """The decoder (embeddings → layers → final norm) and its layer list."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    if base is None or not hasattr(base, "layers"):
        base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(base, "norm"):
        raise ValueError(
            f"{type(model).__name__}: expected a decoder with .layers and .norm "
            "(a Llama-style causal LM) to capture hidden states from"
        )
    return base, layers


@contextlib.contextmanager
def tap_layer_outputs(
    layers: nn.ModuleList, layer_ids: list[int]
) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks that keep the output of each named layer for the duration of the block.

    Only forwards run by this thread are recorded: a model shared with a generating engine
    (LocalEngine's) may run other forwards on other threads meanwhile.
    """
    store: dict[int, torch.Tensor] = {}
    owner = threading.get_ident()

    def hook_for(layer_id: int):
        def hook(_module: nn.Module, _args: object, output: object) -> None:
            if threading.get_ident() == owner:
                # Decoder layers return a tensor in transformers 5, a tuple in 4.x.
                store[layer_id] = output[0] if isinstance(output, tuple | list) else output

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in layer_ids]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def _cache_kwarg(module: nn.Module) -> str:
    # transformers 5 renamed past_key_values to cache.
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


class LocalCapture:
    """Captures aux and last hidden states of whole sequences on one local model."""

    name = "local"

    def __init__(
        self, model: PreTrainedModel, aux_layer_ids: list[int], batch_size: int = 4, pad_id: int = 0
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model.eval()
        self.base, self.layers = decoder_stack(model)
        bad = [i for i in aux_layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(
                f"aux layer ids {bad} outside the model's {len(self.layers)} decoder layers"
            )
        self.aux_layer_ids = list(aux_layer_ids)
        self.hidden_size: int = self.base.norm.weight.shape[0]
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        # Hooks are registered per call on shared layers: one capture at a time.
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str,
        aux_layer_ids: list[int],
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 4,
    ) -> LocalCapture:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=_DTYPES[dtype], local_files_only=True
        ).to(device)
        pad = model.config.pad_token_id
        return cls(model, aux_layer_ids, batch_size, pad if isinstance(pad, int) else 0)

    @torch.inference_mode()
    def capture(self, sequences: list[list[int]]) -> list[CapturedStates]:
        """States of each sequence, in input order, on the model's device and dtype."""
        empty = [i for i, s in enumerate(sequences) if not s]
        if empty:
            raise ValueError(f"sequences {empty[:5]} are empty; nothing to capture")
        # Longest first, so each batch holds similar lengths (less padding).
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        out: list[CapturedStates | None] = [None] * len(sequences)
        with self._lock:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                for index, states in zip(
                    chunk, self._forward([sequences[i] for i in chunk]), strict=True
                ):
                    out[index] = states
        return [s for s in out if s is not None]

    def _forward(self, batch: list[list[int]]) -> list[CapturedStates]:
        width = max(len(s) for s in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        with tap_layer_outputs(self.layers, self.aux_layer_ids) as store:
            # The decoder alone: the lm_head's [T, vocab] logits are never needed here.
            out = self.base(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
            )
        aux = torch.cat([store[i] for i in self.aux_layer_ids], dim=-1)
        last = out.last_hidden_state
        return [CapturedStates(aux[r, : len(s)], last[r, : len(s)]) for r, s in enumerate(batch)]

    def close(self) -> None:
        self.model = self.base = self.layers = None  # type: ignore[assignment]


@torch.inference_mode()
def decode_capture(
    model: PreTrainedModel,
    prompt_ids: list[int],
    aux_layer_ids: list[int],
    max_new_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
    forced_ids: list[int] | None = None,
) -> DecodeCapture:
    """Greedy decoding one token per step with a KV cache, recording every position's states.

    The prompt is one prefill step; then each new token is fed on its own, the last one
    too: its state is what the draft needs to propose the token after it. `forced_ids`
    feeds those tokens instead of the argmax (teacher forcing through the same cache path).
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    base, layers = decoder_stack(model)
    head = model.get_output_embeddings()
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    cache_kw = _cache_kwarg(base)
    limit = len(forced_ids) if forced_ids is not None else max_new_tokens
    tokens = list(prompt_ids)
    aux_parts: list[torch.Tensor] = []
    last_parts: list[torch.Tensor] = []

    def step(feed: list[int]) -> int:
        start = len(tokens) - len(feed)
        positions = torch.arange(start, start + len(feed), device=device)[None, :]
        with tap_layer_outputs(layers, aux_layer_ids) as store:
            out = base(
                input_ids=torch.tensor([feed], device=device),
                position_ids=positions,
                use_cache=True,
                **{cache_kw: cache},
            )
        aux_parts.append(torch.cat([store[i] for i in aux_layer_ids], dim=-1)[0])
        last_parts.append(out.last_hidden_state[0])
        return int(head(out.last_hidden_state[0, -1:]).argmax(dim=-1))

    next_token = step(tokens)
    finish = "length"
    for k in range(limit):
        token = forced_ids[k] if forced_ids is not None else next_token
        tokens.append(token)
        next_token = step([token])
        # SGLang's order: the length limit wins over a stop token that lands on it.
        if token in eos_ids and forced_ids is None and k + 1 < limit:
            finish = "stop"
            break
    return DecodeCapture(
        tokens, len(prompt_ids), torch.cat(aux_parts), torch.cat(last_parts), finish
    )
