"""The draft model's shape, derived from the target's config.json (docs/DESIGN.md §7).

The draft shares the target's token embedding, so its hidden size is the target's. Its aux
layer ids follow SGLang's "output of layer i" convention: `[1, L//2 - 1, L - 4]`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tasks.extract.capture import aux_capture_layers
from tasks.target.model_dir import text_config


def rope_of(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either spelling: 4.x `rope_theta`/`rope_scaling` or
    transformers 5's `rope_parameters`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1:
            return theta, None
        return theta, scaling
    scaling = config.get("rope_scaling")
    return float(config.get("rope_theta", 10000.0)), dict(scaling) if scaling else None


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    target_hidden_size: int = 0
    target_num_layers: int = 0
    target_model_type: str = "llama"
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            problems.append(
                f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}"
            )
        if len(self.aux_layer_ids) != 3:
            problems.append(f"aux_layer_ids must name 3 layers, got {self.aux_layer_ids}")
        if self.target_hidden_size != self.hidden_size:
            problems.append(
                f"target_hidden_size {self.target_hidden_size} differs from hidden_size "
                f"{self.hidden_size}: the draft shares the target's embedding"
            )
        if problems:
            raise ValueError("DraftConfig: " + "; ".join(problems))

    @classmethod
    def from_target(
        cls,
        target_config: dict[str, Any],
        draft_vocab_size: int,
        intermediate_size: int | None = None,
    ) -> DraftConfig:
        cfg = text_config(target_config)
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(f"target config lacks {missing}; cannot size the draft")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg.get("num_attention_heads", max(1, hidden // 128)))
        theta, scaling = rope_of(cfg)
        vocab = int(cfg["vocab_size"])
        model_type = str(target_config.get("model_type", cfg.get("model_type", "llama")))
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size or cfg.get("intermediate_size") or 4 * hidden),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            vocab_size=vocab,
            draft_vocab_size=min(int(draft_vocab_size), vocab),
            aux_layer_ids=aux_capture_layers(model_type, int(cfg["num_hidden_layers"])),
            target_hidden_size=hidden,
            target_num_layers=int(cfg["num_hidden_layers"]),
            target_model_type=model_type,
            hidden_act=str(cfg.get("hidden_act", "silu")),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"DraftConfig: unknown keys {unknown}")
        return cls(**data)
