"""Stage notifications to Slack (bot token or incoming webhook), or to the log when unconfigured.

Notifying is never allowed to fail a stage: every send error becomes one warning. The token or
webhook URL is a secret, and slack_sdk logs request URLs (the whole webhook URL) at DEBUG, so
slack_sdk gets its own logger whose filter redacts every secret a Notifier knows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from slack_sdk import WebClient
from slack_sdk.webhook import WebhookClient

from tasks.config import SlackConfig
from tasks.redaction import REDACTED, redact_text, register_secret
from tasks.runlog import brief

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5
SECTION_LIMIT = 2900  # Slack rejects a section text over 3000 characters

Level = Literal["info", "success", "warning", "error"]
LEVEL_ICON: dict[str, str] = {
    "info": ":information_source:",
    "success": ":white_check_mark:",
    "warning": ":warning:",
    "error": ":x:",
}


class LoggerLike(Protocol):
    def info(self, msg: str, *args: Any, **kwargs: Any) -> Any: ...
    def warning(self, msg: str, *args: Any, **kwargs: Any) -> Any: ...


class _RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact_text(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info and record.exc_info[1] is not None:
            # A traceback can quote the request URL; keep the type, drop the text.
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


sdk_log = logging.getLogger("eaglescale.notify.slack_sdk")
sdk_log.addFilter(_RedactingFilter())
log.addFilter(_RedactingFilter())


@dataclass(frozen=True)
class SlackCredentials:
    kind: Literal["token", "webhook"]
    secret: str
    channel: str | None
    source: str  # where it came from, for the log (never the value itself)

    def __repr__(self) -> str:
        return f"SlackCredentials(kind={self.kind!r}, source={self.source!r}, secret={REDACTED!r})"


def _load_secret_block(name: str) -> str:
    from prefect.blocks.system import Secret

    return str(Secret.load(name).get())


def credentials_from_value(value: str, channel: str | None, source: str) -> SlackCredentials | None:
    value = value.strip()
    if value.startswith(("https://", "http://")):
        return SlackCredentials("webhook", value, None, source)
    if not channel:
        log.warning("Slack: %s holds a bot token but slack.channel is not set; not sending", source)
        return None
    return SlackCredentials("token", value, channel, source)


def resolve_credentials(cfg: SlackConfig) -> SlackCredentials | None:
    """Bot token + channel from the env, else a webhook URL from the env, else the Secret block."""
    token = os.environ.get(cfg.token_env, "").strip()
    if token:
        register_secret(token)
        creds = credentials_from_value(token, cfg.channel, f"env {cfg.token_env}")
        if creds:
            return creds
    webhook = os.environ.get(cfg.webhook_env, "").strip()
    if webhook:
        register_secret(webhook)
        return SlackCredentials("webhook", webhook, None, f"env {cfg.webhook_env}")
    if cfg.secret_block:
        try:
            value = _load_secret_block(cfg.secret_block)
        except Exception as e:
            log.warning(
                "Slack: could not load Prefect Secret block %r (%s); Slack is not configured",
                cfg.secret_block,
                type(e).__name__,
            )
            return None
        register_secret(value.strip())
        return credentials_from_value(value, cfg.channel, f"secret block {cfg.secret_block!r}")
    return None


def format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def _escape(text: str) -> str:
    """Slack mrkdwn control characters (the only three it asks to escape)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def build_message(
    run_label: str, title: str, fields: Mapping[str, Any], level: Level = "info"
) -> tuple[str, list[dict[str, Any]]]:
    """(text fallback, blocks): the fallback alone must carry the numbers (notifications, logs)."""
    pairs = [(str(k), format_value(v)) for k, v in fields.items()]
    summary = ", ".join(f"{k}: {v}" for k, v in pairs)
    text = f"[{run_label}] {title}" + (f" — {summary}" if summary else "")
    header = f"{LEVEL_ICON.get(level, '')} *{_escape(title)}*\nrun `{_escape(run_label)}`".strip()
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": header}}]
    if pairs:
        body = "\n".join(f"*{_escape(k)}:* {_escape(v)}" for k, v in pairs)
        if len(body) > SECTION_LIMIT:
            body = body[: SECTION_LIMIT - 1] + "…"
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": body}})
    return text, blocks


class Notifier:
    """Posts stage events for one run. Thread-safe; sending never raises."""

    def __init__(
        self,
        run_label: str,
        credentials: SlackCredentials | None = None,
        base_url: str | None = None,
        logger: LoggerLike | None = None,
        timeout_s: float = SEND_TIMEOUT_S,
    ):
        self.run_label = run_label
        self.logger: LoggerLike = logger or log
        self.credentials = credentials
        self._client: WebClient | None = None
        self._webhook: WebhookClient | None = None
        if credentials is None:
            return
        register_secret(credentials.secret)
        if credentials.kind == "token":
            kwargs: dict[str, Any] = {}
            if base_url:
                # WebClient joins method names onto the base URL, which must end with '/'.
                kwargs["base_url"] = base_url.rstrip("/") + "/"
            self._client = WebClient(
                token=credentials.secret, timeout=int(timeout_s), logger=sdk_log, **kwargs
            )
        else:
            self._webhook = WebhookClient(
                credentials.secret, timeout=int(timeout_s), logger=sdk_log
            )

    @classmethod
    def from_config(
        cls, cfg: SlackConfig, run_label: str, logger: LoggerLike | None = None
    ) -> Notifier:
        return cls(run_label, resolve_credentials(cfg), cfg.base_url, logger)

    @property
    def configured(self) -> bool:
        return self.credentials is not None

    def send(
        self, text: str, fields: Mapping[str, Any] | None = None, level: Level = "info"
    ) -> bool:
        """Post one message; True when Slack accepted it. Unconfigured: log it at INFO."""
        fallback, blocks = build_message(self.run_label, text, fields or {}, level)
        if self.credentials is None:
            # One line, not a page: a stage's key numbers can run to kilobytes.
            self.logger.info("notify: %s", brief(fallback))
            return False
        try:
            self._post(fallback, blocks)
        except Exception as e:
            self.logger.warning(
                "Slack notification failed (%s: %s); message was: %s",
                type(e).__name__,
                redact_text(str(e))[:300],
                redact_text(fallback),
            )
            return False
        return True

    def _post(self, text: str, blocks: list[dict[str, Any]]) -> None:
        if self._client is not None:
            # chat_postMessage raises SlackApiError on ok=false (invalid_auth, channel_not_found).
            self._client.chat_postMessage(
                channel=self.credentials.channel, text=text, blocks=blocks
            )
            return
        assert self._webhook is not None
        resp = self._webhook.send(text=text, blocks=blocks)
        if resp.status_code != 200:
            raise RuntimeError(f"webhook answered HTTP {resp.status_code}: {resp.body[:200]}")

    def stage_started(self, stage: str, details: Mapping[str, Any] | None = None) -> bool:
        return self.send(f"{stage} started", {"stage": stage, **(details or {})}, "info")

    def stage_completed(
        self,
        stage: str,
        key_numbers: Mapping[str, Any] | None = None,
        duration_s: float | None = None,
    ) -> bool:
        fields: dict[str, Any] = {"stage": stage, **(key_numbers or {})}
        if duration_s is not None:
            fields["duration"] = format_duration(duration_s)
        return self.send(f"{stage} completed", fields, "success")

    def stage_failed(self, stage: str, error: str) -> bool:
        return self.send(f"{stage} FAILED", {"stage": stage, "error": error[:1500]}, "error")

    def stalled(
        self, stage: str, heartbeat_age_s: float, details: Mapping[str, Any] | None = None
    ) -> bool:
        fields = {"stage": stage, "no heartbeat for": format_duration(heartbeat_age_s)}
        return self.send(f"{stage} looks stalled", {**fields, **(details or {})}, "warning")
