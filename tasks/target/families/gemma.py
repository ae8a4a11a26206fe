"""Gemma (Gemma, Gemma 2, Gemma 3; Gemma 3's multimodal wrapper keeps its text model under
`text_config`), known only for its norm.

Its RMSNorm scales by 1 + weight, where the draft's scales by its weight, so
train.init_norm_from_target refuses it (tasks/draft/target_heads.py::load_target_norm). How
SGLang captures its EAGLE-3 states has not been read: no default aux ids.
"""

from __future__ import annotations

from tasks.target.families.base import TargetFamily

GEMMA = TargetFamily(
    model_type="gemma",
    aliases=("gemma2", "gemma3", "gemma3_text"),
    norm_plus_one=True,
    text_config_key="text_config",
)
FAMILIES = (GEMMA,)
