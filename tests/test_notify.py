"""Notifier against a real HTTP receiver on 127.0.0.1 that records what Slack would get."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.config import SlackConfig
from tasks.notify import (
    Notifier,
    SlackCredentials,
    build_message,
    credentials_from_value,
    format_duration,
    resolve_credentials,
)
from tests.run_support import child_env
from tests.slack_support import Receiver

TOKEN = "xoxb-1111-2222-SECRETTOKENVALUE"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture(autouse=True)
def _no_slack_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLACK_BOT_TOKEN", raising=False)
    monkeypatch.delenv("SLACK_WEBHOOK_URL", raising=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bot_token_posts_chat_message_with_stage_and_numbers(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
    cfg = SlackConfig(channel="#eagle", base_url=f"{receiver.url}/api")
    notifier = Notifier.from_config(cfg, "s3://bucket/runs/r1")
    assert notifier.configured

    assert notifier.stage_completed("generate", {"rows": 83000, "dead": 12}, duration_s=3725, headline="83,000 rows")

    assert len(receiver.requests) == 1
    req = receiver.requests[0]
    assert req["path"] == "/api/chat.postMessage"
    assert req["auth"] == f"Bearer {TOKEN}"
    body = req["json"]
    assert body["channel"] == "#eagle"
    assert body["text"] == (
        "[s3://bucket/runs/r1] generate completed: in 1h 02m 05s; 83,000 rows — rows: 83,000, dead: 12, "
        "duration: 1h 02m 05s"
    )
    blocks = body["blocks"] if isinstance(body["blocks"], list) else json.loads(body["blocks"])
    # Block Kit: a one-line headline, the fields in two columns, the run as context.
    assert [b["type"] for b in blocks] == ["section", "section", "context"]
    assert blocks[0]["text"]["text"] == ":white_check_mark: *generate completed* — in 1h 02m 05s; 83,000 rows"
    assert [f["text"] for f in blocks[1]["fields"]] == ["*rows*\n83,000", "*dead*\n12", "*duration*\n1h 02m 05s"]
    assert blocks[2]["elements"] == [{"type": "mrkdwn", "text": "run `s3://bucket/runs/r1`"}]


def test_webhook_path_sends_text_and_blocks(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLACK_WEBHOOK_URL", f"{receiver.url}/services/T0/B0/hooksecret")
    notifier = Notifier.from_config(SlackConfig(), "runs/r2")
    assert notifier.credentials is not None and notifier.credentials.kind == "webhook"

    assert notifier.stage_failed("discover", "source 'chat' unreadable: /data/x.parquet")
    assert notifier.stalled("generate", 1900, {"shards running": 2})

    assert [r["path"] for r in receiver.requests] == ["/services/T0/B0/hooksecret"] * 2
    failed, stalled = (r["json"] for r in receiver.requests)
    # A short error is the headline itself; a long one is cut there and whole in a field.
    assert failed["text"] == "[runs/r2] discover FAILED: source 'chat' unreadable: /data/x.parquet"
    assert stalled["text"] == (
        "[runs/r2] generate looks stalled: no result for 31m 40s — no result for: 31m 40s, shards running: 2"
    )
    assert stalled["blocks"][0]["text"]["text"] == ":warning: *generate looks stalled* — no result for 31m 40s"
    assert Notifier("r").stage_failed("train", "x" * 300) is False  # unconfigured: logged, not sent
    _, blocks = build_message("r", "train FAILED", {"error": "x" * 300}, "error", "x" * 199 + "…")
    assert blocks[1]["fields"][0]["text"] == "*error*\n" + "x" * 300


def test_http_500_and_invalid_auth_and_refused_never_raise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with Receiver(status=500, body={"ok": False}) as broken:
        webhook = Notifier("r", SlackCredentials("webhook", f"{broken.url}/hook/WEBHOOKPATHSECRET", None, "test"))
        assert webhook.send("hello", {"n": 1}) is False
        token = Notifier(
            "r", SlackCredentials("token", TOKEN, "#c", "test"), base_url=f"{broken.url}/api/"
        )
        assert token.stage_started("generate", {"shards": 3}) is False
    with Receiver(status=200, body={"ok": False, "error": "invalid_auth"}) as denied:
        token = Notifier(
            "r", SlackCredentials("token", TOKEN, "#c", "test"), base_url=f"{denied.url}/api/"
        )
        assert token.send("hi") is False
    port = _closed_port()
    refused = Notifier("r", SlackCredentials("webhook", f"http://127.0.0.1:{port}/x", None, "t"))
    assert refused.send("hi") is False

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4
    assert all(w.startswith("Slack notification failed") for w in warnings)
    assert "HTTP 500" in warnings[0]
    assert "invalid_auth" in warnings[2]
    assert "message was: [r] generate started — shards: 3" in warnings[1]
    # The bot token's failure paths (HTTP 500, invalid_auth) logged at DEBUG and WARNING: no token.
    assert TOKEN not in caplog.text and "SECRETTOKENVALUE" not in caplog.text
    assert "WEBHOOKPATHSECRET" not in caplog.text  # nor the webhook's secret path


def test_secrets_never_reach_logs_at_debug(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    hook_secret = "T000/B000/WEBHOOKSECRETPART"
    monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
    cfg = SlackConfig(channel="#c", base_url=f"{receiver.url}/api")
    assert Notifier.from_config(cfg, "r").send("token path", {"x": 1})
    monkeypatch.delenv("SLACK_BOT_TOKEN")
    monkeypatch.setenv("SLACK_WEBHOOK_URL", f"{receiver.url}/services/{hook_secret}")
    assert Notifier.from_config(SlackConfig(), "r").send("webhook path", {"x": 2})
    with Receiver(status=500) as broken:
        monkeypatch.setenv("SLACK_WEBHOOK_URL", f"{broken.url}/services/{hook_secret}")
        notifier = Notifier.from_config(SlackConfig(), "r")
        assert notifier.send("failing path") is False
        assert "WEBHOOKSECRETPART" not in repr(notifier.credentials)

    assert len(receiver.requests) == 2
    # slack_sdk did log the requests at DEBUG (so the redaction was exercised), with no secret.
    sdk_lines = [r for r in caplog.records if r.name == "eaglescale.notify.slack_sdk"]
    assert any("Sending a request" in r.getMessage() for r in sdk_lines)
    assert any("[redacted]" in r.getMessage() for r in sdk_lines)
    assert TOKEN not in caplog.text
    assert "WEBHOOKSECRETPART" not in caplog.text


def test_no_config_logs_at_info(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("eaglescale.test.flowlogger")
    caplog.set_level(logging.INFO, logger=logger.name)
    notifier = Notifier.from_config(SlackConfig(channel="#c"), "runs/local", logger=logger)
    assert not notifier.configured
    assert notifier.stage_completed("discover", {"prompts": 300}, duration_s=4.2) is False
    records = [r for r in caplog.records if r.name == logger.name]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (
            logging.INFO,
            "notify: [runs/local] discover completed: in 4s — prompts: 300, duration: 4s",
        )
    ]


def test_token_without_channel_is_not_configured(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SLACK_BOT_TOKEN", TOKEN)
    assert resolve_credentials(SlackConfig()) is None
    assert "slack.channel is not set" in caplog.text
    assert TOKEN not in caplog.text


SECRET_BLOCK_SCRIPT = """
import json, logging, sys
from prefect.blocks.system import Secret
from tasks.config import SlackConfig
from tasks.notify import Notifier
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
Secret(value=sys.argv[1]).save("slack-eagle", overwrite=True)
sent = Notifier.from_config(SlackConfig(secret_block="slack-eagle"), "runs/blk").send("via block")
missing = Notifier.from_config(SlackConfig(secret_block="no-such-block"), "runs/blk")
print("RESULT", json.dumps({"sent": sent, "missing_configured": missing.configured}))
"""


def test_prefect_secret_block_holding_a_webhook(receiver: Receiver, tmp_path: Path) -> None:
    """A real Prefect Secret block (ephemeral API in a child process, its own PREFECT_HOME)."""
    hook = f"{receiver.url}/services/BLOCKSECRET"
    env = {
        **child_env(),  # no host Slack/AWS/Prefect values
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": "",
        # A fresh PREFECT_HOME migrates its database first: ~25 s on a 2-core box, over the 20 s
        # default (make test sets the same; a bare pytest run does not).
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SECRET_BLOCK_SCRIPT, hook],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result == {"sent": True, "missing_configured": False}
    assert [r["path"] for r in receiver.requests] == ["/services/BLOCKSECRET"]
    assert receiver.requests[0]["json"]["text"] == "[runs/blk] via block"
    assert "could not load Prefect Secret block 'no-such-block'" in proc.stdout
    assert "BLOCKSECRET" not in proc.stdout + proc.stderr


def test_secret_values_pick_token_or_webhook() -> None:
    token = credentials_from_value("xoxb-from-block", "#c", "test")
    hook = credentials_from_value(" https://hooks.slack.com/services/A/B/C ", "#c", "test")
    assert token is not None and (token.kind, token.channel) == ("token", "#c")
    assert hook is not None and (hook.kind, hook.channel, hook.secret) == (
        "webhook",
        None,
        "https://hooks.slack.com/services/A/B/C",
    )
    assert credentials_from_value("xoxb-no-channel", None, "test") is None


def test_message_formatting_escapes_and_limits() -> None:
    text, blocks = build_message("r<1>", "gate & promote", {"note": "a<b>", "rate": 12.3456, "gone": None})
    assert text == "[r<1>] gate & promote — note: a<b>, rate: 12.35"  # None is left out, not printed
    assert blocks[0]["text"]["text"] == ":information_source: *gate &amp; promote*"
    assert [f["text"] for f in blocks[1]["fields"]] == ["*note*\na&lt;b&gt;", "*rate*\n12.35"]
    assert blocks[2]["elements"][0]["text"] == "run `r&lt;1&gt;`"
    _, long_blocks = build_message("r", "t", {"error": "x" * 5000})
    assert len(long_blocks[1]["fields"][0]["text"]) == 1900  # Slack refuses a field over 2,000
    _, many = build_message("r", "t", {f"k{i}": i for i in range(23)})
    assert [len(b["fields"]) for b in many if "fields" in b] == [10, 10, 3]  # ten per section at most
    # Values as people read them: no repr, 4 significant digits, CIs, sizes, shares.
    text, _ = build_message("r", "t", {"dead_classes": {}, "ci": [0.6851852549722078, 1.3755248221309815],
                                       "speedup": 0.8389377069980071, "total_bytes": 2889476,
                                       "finish_length_rate": 0.8667, "splits": {"train": 54, "eval": 6}})  # fmt: skip
    assert text == ("[r] t — dead classes: none, ci: [0.685, 1.38], speedup: 0.8389, total bytes: 2.89 MB, "
                    "finish length rate: 86.7%, splits: train 54, eval 6")  # fmt: skip
    assert format_duration(59.6) == "1m 00s"
    assert format_duration(7322) == "2h 02m 02s"


def test_child_processes_get_no_host_slack_aws_or_prefect_settings(tmp_path: Path) -> None:
    from tests.run_support import HOST_ENV, clean_child_env, cli_env

    host = {"SLACK_BOT_TOKEN": "xoxb-host", "AWS_PROFILE": "prod", "PREFECT_API_URL": "http://prod:4200/api"}
    environ = {**host, "PATH": "/bin", "AWS_ACCESS_KEY_ID": "testing"}  # moto's, set by a fixture
    assert clean_child_env(environ, host) == {"PATH": "/bin", "AWS_ACCESS_KEY_ID": "testing"}
    # A value a test set over the host's own is the test's: passed on.
    assert clean_child_env({"SLACK_BOT_TOKEN": "xoxb-test"}, host) == {"SLACK_BOT_TOKEN": "xoxb-test"}
    env = cli_env(tmp_path)
    assert all(env.get(k) != v for k, v in HOST_ENV.items() if k.startswith(("SLACK_", "AWS_")))
    assert "PREFECT_API_URL" not in env and env["PREFECT_HOME"] == str(tmp_path / "prefect-home")


def _stored_logs(api: str) -> list[dict]:
    """Every log record the Prefect API stored, page by page."""
    import httpx

    logs: list[dict] = []
    while page := httpx.post(f"{api}/logs/filter", json={"offset": len(logs), "limit": 200}, timeout=30).json():
        logs += page
    return logs


def test_a_debug_run_with_a_failing_slack_leaks_the_bot_token_nowhere(
    tmp_path: Path, tiny_target_dir: Path
) -> None:
    """The whole flow through the CLI at DEBUG, SLACK_BOT_TOKEN set and Slack failing every
    post: the token is used (the receiver saw it) and is in no CLI output, no file of the run
    folder and no log record the Prefect API stored."""
    from tests.prefect_support import prefect_server
    from tests.run_support import cli_env, start_cli, write_params

    with Receiver(status=500, body={"ok": False, "error": "internal_error"}) as slack:
        params = write_params(
            tmp_path,
            tiny_target_dir,
            str(tmp_path / "run"),
            discover={"total_prompts": 30},
            sampling={"max_new_tokens": 8},
            generate={"shard_size": 15},
            slack={"channel": "#eagle", "base_url": f"{slack.url}/api"},
            stages=["discover", "generate"],
        )
        with prefect_server(tmp_path / "prefect-server-home") as api:
            env = cli_env(
                tmp_path,
                PREFECT_API_URL=api,
                PREFECT_LOGGING_LEVEL="DEBUG",
                # Every other logger at DEBUG too (logging.yml's root), the project's own (the
                # notifier's, slack_sdk's) to Prefect's console and API handlers.
                PREFECT_LOGGING_ROOT_LEVEL="DEBUG",
                PREFECT_LOGGING_EXTRA_LOGGERS="eaglescale,tasks,flows",
                SLACK_BOT_TOKEN=TOKEN,
            )
            log = tmp_path / "cli.log"
            rc = start_cli(["run", "--params", str(params)], env, log).wait(600)
            output = log.read_text()
            assert rc == 0, output[-3000:]  # a failing Slack never fails the run
            stored = _stored_logs(api)
        posts = list(slack.requests)

    assert posts and all(p["auth"] == f"Bearer {TOKEN}" for p in posts)
    # DEBUG was on and the failure paths ran: slack_sdk's request lines and the warnings.
    assert "Sending a request" in output and "Slack notification failed" in output
    assert "'Authorization': '(redacted)'" in output  # the request line that carried the token
    assert any(r["level"] == logging.DEBUG for r in stored)
    assert any("Slack notification failed" in r["message"] for r in stored)
    secrets = (TOKEN, "SECRETTOKENVALUE")
    assert not [s for s in secrets if s in output]
    assert not [r["message"] for r in stored if any(s in r["message"] for s in secrets)]
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len(files) > 10 and not [p for p in files if b"SECRETTOKENVALUE" in p.read_bytes()]
