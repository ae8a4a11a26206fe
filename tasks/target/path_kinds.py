"""What a target setting's string is, read from the string alone: `target.model_path` as a hub
id rather than a path, `target.chat_template` as template text rather than a file.

The lowest module of the target package: the configuration's path resolution reads the same
answers as the loaders (so a value is resolved as a path exactly when a loader would open it as
one), and it imports nothing.
"""

from __future__ import annotations

import re

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def looks_like_hub_id(value: str) -> bool:
    """`org/name`: a model_path that tasks/target/model_dir.py looks up in the local HF cache when
    no such folder exists. `./x/y` and `.hidden/y` are paths (hub names never start with a dot)."""
    return bool(_HUB_ID.match(value)) and not value.startswith(".")


def is_template_text(chat_template: str) -> bool:
    """target.chat_template holds a Jinja template itself, not the path of a file holding one."""
    return "{{" in chat_template or "{%" in chat_template
