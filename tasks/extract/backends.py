"""Where extraction's states come from: the target's layout and the capture backend."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from tasks.config import EagleScaleConfig
from tasks.extract.capture import CaptureBackend
from tasks.target.model_dir import read_model_config, resolve_model_dir, text_config


@dataclass(frozen=True)
class TargetLayout:
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int


def target_layout(model_path: str, revision: str | None = None) -> TargetLayout:
    config = read_model_config(resolve_model_dir(model_path, revision))
    text = text_config(config)
    return TargetLayout(
        str(text.get("model_type") or config.get("model_type") or ""),
        int(text["num_hidden_layers"]),
        int(text["hidden_size"]),
        int(text["vocab_size"]),
    )


def build_capture_backend(
    cfg: EagleScaleConfig,
    aux_layer_ids: list[int],
    model: PreTrainedModel | None = None,
    capture_draft_path: str | None = None,
) -> CaptureBackend:
    """`local`: the given model (e.g. LocalEngine's) or a fresh one on extract.device/dtype;
    `sglang`: SGLang's in-process engines (GPU nodes, optional extra; see sglang_capture)."""
    ex = cfg.extract
    if ex.engine == "local":
        from tasks.extract.local_capture import LocalCapture

        if model is not None:
            pad = model.config.pad_token_id
            return LocalCapture(
                model, aux_layer_ids, ex.batch_size, pad if isinstance(pad, int) else 0
            )
        model_dir = resolve_model_dir(cfg.target.model_path, cfg.target.revision)
        return LocalCapture.from_pretrained(
            str(model_dir), aux_layer_ids, ex.device, ex.dtype, ex.batch_size
        )
    from tasks.extract.sglang_capture import SGLangCapture

    layout = target_layout(cfg.target.model_path, cfg.target.revision)
    return SGLangCapture.launch(
        str(resolve_model_dir(cfg.target.model_path, cfg.target.revision)),
        layout.model_type,
        aux_layer_ids,
        layout.hidden_size,
        capture_draft_path=capture_draft_path,
        dtype=ex.dtype,
        context_length=ex.max_length,
    )
