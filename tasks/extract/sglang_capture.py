"""Hidden-state capture through SGLang's in-process engine, for production targets on GPU nodes.

NOT RUN AGAINST A REAL SGLANG: sglang is an optional extra (`pip install 'eaglescale[sglang]'`)
and was never installed where this was written. Tested here: the engine arguments, the
request, the capture-draft check, the layer-id mapping, and the parsing of the response shape
below (recorded from SGLang's tests and source, served by a stand-in engine). Untested: that
a real Engine accepts these arguments, returns these shapes, and fits two copies of a target.

What SGLang's source says (Engine API, versions 0.4.x-0.5.x):
- `sglang.Engine(..., enable_return_hidden_states=True)` and
  `engine.generate(input_ids=[[...]], sampling_params=..., return_hidden_states=True)`
  return one dict per request whose `meta_info["hidden_states"]` is a list: the prefill's
  states first, one row per input token, then one entry per decoded token.
- Which states: its LogitsProcessor stores `torch.cat(aux_hidden_states, -1)` ([T, 3H])
  when the target model captures aux states, else the final hidden states after the final
  norm ([T, H]). A target captures aux states only when the engine runs EAGLE3 speculation:
  the model runner then calls `set_eagle3_layers_to_capture(<the draft config's
  eagle_aux_hidden_state_layer_ids>)`. Hence two engines: one in EAGLE3 mode with a
  "capture draft" (any EAGLE-3 draft of this target whose eagle_config names the aux ids; its
  weights are not used for the states) for aux, one plain for last. Some builds return both
  at once ([T, 4H], aux then final); that width is accepted too.
- A prefix-cache hit returns states only for the uncached suffix: radix cache is disabled.
  Chunked prefill is disabled so a sequence's states come from one extend.
The production alternative SpecForge uses (SGLang's ModelRunner driven in-process, calling
`set_eagle3_layers_to_capture` directly, one copy of the target) is internal API: not done.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tasks.extract.capture import AUX_LAYER_COUNT, CapturedStates, sglang_layers_to_capture

SGLANG_MISSING = (
    "extract.engine=sglang needs SGLang, an optional extra for GPU nodes: "
    "pip install 'eaglescale[sglang]' there (it pins its own torch and CUDA), or use "
    "extract.engine=local"
)


def import_sglang() -> Any:
    try:
        import sglang
    except ImportError as e:
        raise RuntimeError(SGLANG_MISSING) from e
    return sglang


def engine_kwargs(
    model_path: str,
    role: str,
    *,
    capture_draft_path: str | None = None,
    tp_size: int = 1,
    dtype: str = "bfloat16",
    context_length: int | None = None,
    mem_fraction_static: float = 0.4,
) -> dict[str, Any]:
    """`sglang.Engine` arguments for the aux (EAGLE3 capture) or last (plain) engine."""
    if role not in ("aux", "last"):
        raise ValueError(f"role must be 'aux' or 'last', got {role!r}")
    kwargs: dict[str, Any] = {
        "model_path": model_path,
        "skip_tokenizer_init": True,
        "enable_return_hidden_states": True,
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "tp_size": tp_size,
        "dtype": dtype,
        "mem_fraction_static": mem_fraction_static,
    }
    if context_length is not None:
        kwargs["context_length"] = context_length
    if role == "aux":
        if not capture_draft_path:
            raise ValueError(
                "the aux engine needs capture_draft_path: an EAGLE-3 draft of this target whose "
                "eagle_config names the aux layer ids (SGLang captures aux states only in EAGLE3 mode)"
            )
        # All three speculative sizes set (docs/DESIGN.md §7); topk 1 keeps the draft's work minimal.
        kwargs.update(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=capture_draft_path,
            speculative_num_steps=1,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=2,
            disable_cuda_graph=True,
        )
    return kwargs


def check_capture_draft(draft_dir: str | Path, model_type: str, aux_layer_ids: list[int]) -> None:
    """Refuse a capture draft whose config would make SGLang capture other layers."""
    path = Path(draft_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"capture draft {draft_dir}: no config.json") from None
    archs = config.get("architectures") or []
    if not any("Eagle3" in a for a in archs):
        raise ValueError(f"capture draft {path}: architectures {archs} name no Eagle3 model")
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids != list(aux_layer_ids):
        raise ValueError(
            f"capture draft {path}: eagle_config.eagle_aux_hidden_state_layer_ids is {ids}, "
            f"extraction needs {list(aux_layer_ids)} (SGLang would capture layer inputs "
            f"{sglang_layers_to_capture(model_type, ids or [])} instead of "
            f"{sglang_layers_to_capture(model_type, aux_layer_ids)})"
        )


def generate_request(sequences: list[list[int]]) -> dict[str, Any]:
    """One prefill per sequence; the single sampled token is discarded."""
    return {
        "input_ids": [list(s) for s in sequences],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True,
    }


def parse_hidden_states(response: dict[str, Any], n_tokens: int, index: int = 0) -> torch.Tensor:
    """The first `n_tokens` rows of a response's hidden states, as float32 [n_tokens, W]."""
    try:
        parts = response["meta_info"]["hidden_states"]
    except (KeyError, TypeError):
        raise ValueError(
            f"SGLang response {index}: no meta_info.hidden_states (was the engine started with "
            "enable_return_hidden_states=True?)"
        ) from None
    rows = []
    for part in parts:
        t = torch.as_tensor(part, dtype=torch.float32)
        rows.append(t.unsqueeze(0) if t.dim() == 1 else t)
    states = torch.cat(rows) if rows else torch.zeros(0, 0)
    if states.dim() != 2 or states.shape[0] < n_tokens:
        raise ValueError(
            f"SGLang response {index}: hidden states of shape {tuple(states.shape)} cover fewer "
            f"than the {n_tokens} input tokens (prefix cache or chunked prefill on?)"
        )
    return states[:n_tokens]


def split_states(
    states: torch.Tensor, hidden_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(aux [T, 3H] | None, last [T, H] | None) by the width SGLang returned."""
    width = states.shape[1]
    aux_width = AUX_LAYER_COUNT * hidden_size
    if width == aux_width:
        return states, None
    if width == hidden_size:
        return None, states
    if width == aux_width + hidden_size:
        return states[:, :aux_width], states[:, aux_width:]
    raise ValueError(
        f"SGLang hidden states are {width} wide; expected {hidden_size} (final), {aux_width} "
        f"(aux) or {aux_width + hidden_size} (both) for hidden size {hidden_size}"
    )


class SGLangCapture:
    """CaptureBackend over SGLang engines: `aux_engine` in EAGLE3 capture mode, and
    `last_engine` (plain) unless the aux engine already returns the final states."""

    name = "sglang"

    def __init__(
        self,
        hidden_size: int,
        aux_layer_ids: list[int],
        aux_engine: Any,
        last_engine: Any | None = None,
    ) -> None:
        self.hidden_size = hidden_size
        self.aux_layer_ids = list(aux_layer_ids)
        self.aux_engine = aux_engine
        self.last_engine = last_engine

    @classmethod
    def launch(
        cls,
        model_path: str,
        model_type: str,
        aux_layer_ids: list[int],
        hidden_size: int,
        *,
        capture_draft_path: str | None = None,
        dtype: str = "bfloat16",
        context_length: int | None = None,
        tp_size: int = 1,
    ) -> SGLangCapture:
        sglang = import_sglang()
        if capture_draft_path is None:
            raise ValueError(
                "extract.engine=sglang needs a capture draft: an EAGLE-3 draft of this target "
                f"whose eagle_config.eagle_aux_hidden_state_layer_ids is {list(aux_layer_ids)}"
            )
        check_capture_draft(capture_draft_path, model_type, aux_layer_ids)
        common = {"tp_size": tp_size, "dtype": dtype, "context_length": context_length}
        aux = sglang.Engine(
            **engine_kwargs(model_path, "aux", capture_draft_path=capture_draft_path, **common)
        )
        last = sglang.Engine(**engine_kwargs(model_path, "last", **common))
        return cls(hidden_size, aux_layer_ids, aux, last)

    def _states(self, engine: Any, sequences: list[list[int]]) -> list[torch.Tensor]:
        responses = engine.generate(**generate_request(sequences))
        if isinstance(responses, dict):
            responses = [responses]
        if len(responses) != len(sequences):
            raise ValueError(
                f"SGLang returned {len(responses)} responses for {len(sequences)} sequences"
            )
        return [
            parse_hidden_states(r, len(s), i)
            for i, (r, s) in enumerate(zip(responses, sequences, strict=True))
        ]

    def capture(self, sequences: list[list[int]]) -> list[CapturedStates]:
        aux_states = [
            split_states(s, self.hidden_size) for s in self._states(self.aux_engine, sequences)
        ]
        need_last = any(last is None for _, last in aux_states)
        if need_last and self.last_engine is None:
            raise ValueError(
                "the aux engine returned no final hidden states and no last_engine is set"
            )
        lasts = (
            [
                split_states(s, self.hidden_size)[1]
                for s in self._states(self.last_engine, sequences)
            ]
            if need_last
            else [last for _, last in aux_states]
        )
        out = []
        for i, ((aux, _), last) in enumerate(zip(aux_states, lasts, strict=True)):
            if aux is None or last is None:
                raise ValueError(
                    f"sequence {i}: SGLang returned no {'aux' if aux is None else 'final'} states"
                )
            out.append(CapturedStates(aux, last))
        return out

    def close(self) -> None:
        for engine in (self.aux_engine, self.last_engine):
            if engine is not None and hasattr(engine, "shutdown"):
                engine.shutdown()
        self.aux_engine = self.last_engine = None
