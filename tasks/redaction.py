"""Secrets out of everything eaglescale writes: one marker, three ways a secret shows up.

- in a URL, as `user:password@` (an engine endpoint, an s3:// source): `redact_url`;
- as the value of a secret-looking key in a mapping (a server's `api_key`, an `HF_TOKEN` in a
  launch environment) before it goes into a report: `redact_secret_keys`;
- as a known value inside free text (the Slack token or webhook URL in a log line or an
  exception): `register_secret` once, then `redact_text`.

No heavy imports: the status command, the client and the notifier all use it.
"""

from __future__ import annotations

import re
import threading
from typing import Any

REDACTED = "[redacted]"

_CREDENTIALS = re.compile(r"//[^/@\s]+@")
# Word-wise, so api_key and HF_TOKEN match but tokenizer_path and max_prefill_tokens do not.
_SECRET_WORDS = frozenset({"key", "token", "secret", "password", "credential", "credentials"})

_secrets: set[str] = set()
_secrets_lock = threading.Lock()


def redact_url(url: str) -> str:
    """The URL with any `user:password@` shown as `***@` (that there was one stays visible)."""
    return _CREDENTIALS.sub("//***@", url)


def is_secret_key(key: Any) -> bool:
    return bool(_SECRET_WORDS & set(re.split(r"[^a-z0-9]+", str(key).lower())))


def _may_hold_a_secret(value: Any) -> bool:
    # A number is never a credential: `baseline_token: 27068` in a gate report is a token id (the
    # gate once reported its divergences' token ids as [redacted], BENCHMARKS P9).
    return bool(value) and not isinstance(value, bool | int | float)


def redact_secret_keys(obj: Any) -> Any:
    """A copy with the (non-empty, not numeric) values of secret-looking keys replaced, at any depth."""
    if isinstance(obj, dict):
        return {k: REDACTED if is_secret_key(k) and _may_hold_a_secret(v) else redact_secret_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_secret_keys(v) for v in obj]
    return obj


def register_secret(value: str) -> None:
    """Make `value` redacted by every later `redact_text` (and so from the notifier's logs)."""
    if value:
        with _secrets_lock:
            _secrets.add(value)


def redact_text(text: str) -> str:
    """`text` with every registered secret replaced (longest first: no partial leftovers)."""
    with _secrets_lock:
        known = sorted(_secrets, key=len, reverse=True)
    for secret in known:
        text = text.replace(secret, REDACTED)
    return text
