"""Stage notifications to Slack (bot token or incoming webhook), or to the log when unconfigured.

Notifying is never allowed to fail a stage: every send error becomes one warning. The token or
webhook URL is a secret, and slack_sdk logs request URLs (the whole webhook URL) at DEBUG, so
slack_sdk gets its own logger whose filter redacts every secret a Notifier knows.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from slack_sdk import WebClient
from slack_sdk.webhook import WebhookClient

import tasks.humanize as humanize
from tasks.config import SlackConfig
from tasks.redaction import REDACTED, redact_text, register_secret
from tasks.runlog import brief

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5
# The Secret block a run reads when neither its environment nor slack.secret_block names Slack.
DEFAULT_SECRET_BLOCK = "eaglescale-slack"
FIELD_LIMIT = 1900  # Slack rejects a section field over 2000 characters
FIELDS_PER_SECTION = 10  # and a section of more than ten fields
HEADLINE_CHARS = 200  # a headline longer than this is cut; the whole text goes in a field

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
    """Bot token + channel from the env, else a webhook URL from the env, else the Secret block
    slack.secret_block names, else (in a flow run) the Secret block `eaglescale-slack`."""
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
    return _default_block(cfg.channel)


def _default_block(channel: str | None) -> SlackCredentials | None:
    """The Secret block `make server` saves from $SLACK_WEBHOOK_URL (infra/prefect/automations.py
    --slack-webhook-from-env), so that deployment runs reach Slack although the worker's
    environment has no Slack variable. Read only inside a flow run (its Prefect API is up: a
    unit's process never starts or waits for one), and quietly when there is none."""
    if "prefect" not in sys.modules:
        return None
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return None
    try:
        value = _load_secret_block(DEFAULT_SECRET_BLOCK)
    except Exception:  # no such block: Slack is simply not configured
        return None
    register_secret(value.strip())
    return credentials_from_value(value, channel, f"secret block {DEFAULT_SECRET_BLOCK!r}")


def format_value(value: Any, key: str = "") -> str:
    """A field's value as a person reads it (tasks/humanize.py: no repr, 4 significant digits)."""
    return humanize.value(value, key)


format_duration = humanize.duration  # the name this module's callers and tests know


def _escape(text: str) -> str:
    """Slack mrkdwn control characters (the only three it asks to escape)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def build_message(
    run_label: str, title: str, fields: Mapping[str, Any], level: Level = "info", headline: str = ""
) -> tuple[str, list[dict[str, Any]]]:
    """(text fallback, Block Kit blocks). The fallback alone carries the numbers (phone
    notifications, logs). The blocks: a one-line headline (icon, title, the key figures), the
    fields as a two-column section (ten per section, Slack's limit), the run as context. Field
    values go through tasks/humanize.py by their key; None is left out."""
    pairs = [(humanize.label(k), format_value(v, str(k))) for k, v in fields.items() if v is not None]
    title, headline = _one_line(title), _one_line(headline)
    summary = ", ".join(f"{k}: {v}" for k, v in pairs)
    text = f"[{run_label}] {title}" + (f": {headline}" if headline else "") + (f" — {summary}" if summary else "")
    top = f"{LEVEL_ICON.get(level, '')} *{_escape(title)}*" + (f" — {_escape(headline)}" if headline else "")
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": top.strip()}}]
    cells = [{"type": "mrkdwn", "text": _clip(f"*{_escape(k)}*\n{_escape(v)}", FIELD_LIMIT)} for k, v in pairs]
    for start in range(0, len(cells), FIELDS_PER_SECTION):
        blocks.append({"type": "section", "fields": cells[start : start + FIELDS_PER_SECTION]})
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"run `{_escape(run_label)}`"}]})
    return text, blocks


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
        self, text: str, fields: Mapping[str, Any] | None = None, level: Level = "info", headline: str = ""
    ) -> bool:
        """Post one message; True when Slack accepted it. Unconfigured: log it at INFO."""
        fallback, blocks = build_message(self.run_label, text, fields or {}, level, headline)
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

    def stage_started(self, stage: str, details: Mapping[str, Any] | None = None, headline: str = "") -> bool:
        return self.send(f"{stage} started", details, "info", headline)

    def stage_completed(
        self,
        stage: str,
        key_numbers: Mapping[str, Any] | None = None,
        duration_s: float | None = None,
        headline: str = "",
    ) -> bool:
        """`headline`: the stage's key figures in one line; the duration leads it."""
        fields: dict[str, Any] = dict(key_numbers or {})
        took = ""
        if duration_s is not None:
            fields["duration"] = took = format_duration(duration_s)
        line = "; ".join(p for p in (f"in {took}" if took else "", headline) if p)
        return self.send(f"{stage} completed", fields, "success", line)

    def stage_failed(self, stage: str, error: str) -> bool:
        line = _one_line(error)
        if len(line) <= HEADLINE_CHARS:  # the whole error is the headline
            return self.send(f"{stage} FAILED", {}, "error", line)
        return self.send(f"{stage} FAILED", {"error": error[:1500]}, "error", line[: HEADLINE_CHARS - 1] + "…")

    def stalled(
        self, stage: str, heartbeat_age_s: float, details: Mapping[str, Any] | None = None
    ) -> bool:
        """`details`: the figures a watcher checks first (tasks/status/figures.py)."""
        idle = format_duration(heartbeat_age_s)
        fields = {"no result for": idle, **(details or {})}
        return self.send(f"{stage} looks stalled", fields, "warning", f"no result for {idle}")
