"""DeepSeek-V4 (served by SGLang only here).

SGLang (`deepseek_v4.py`, read from its source, not run here) captures after layer i returns,
so it applies no + 1, and it has no default: explicit ids are required. The ids still name
outputs, so the tensor is the same, but its mHC residual is collapsed before capture by code we
have not seen run, so eaglescale picks no default ids for it (tasks/extract/capture.py refuses).
"""

from __future__ import annotations

from tasks.target.families.base import TargetFamily

DEEPSEEK_V4 = TargetFamily(model_type="deepseek_v4", sglang_capture="after_layer")
FAMILIES = (DEEPSEEK_V4,)
