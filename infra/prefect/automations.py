"""Apply deployments/automations/*.yaml to the Prefect server PREFECT_API_URL names.

A notification action names its block by id, which differs on every server, so the files say
`block_document_id: "{{ slack_block }}"` and this script puts in the id of the block named by
--slack-block (TYPE-SLUG/NAME). An automation of the same name is replaced, so re-applying after
an edit leaves one copy. Files without the placeholder are also accepted as they are by
`prefect automation create --from-file FILE`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
PLACEHOLDER = "{{ slack_block }}"
DEFAULT_BLOCK = "slack-webhook/eaglescale-slack"


def load_automations(folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(folder.glob("*.yaml")) + sorted(folder.glob("*.json")):
        data = yaml.safe_load(path.read_text())  # JSON is YAML too
        items = data["automations"] if isinstance(data, dict) and "automations" in data else data
        for item in items if isinstance(items, list) else [items]:
            out.append((path, item))
    return out


def needs_block(automation: dict[str, Any]) -> bool:
    return any(a.get("block_document_id") == PLACEHOLDER for a in automation.get("actions", []))


def with_block(automation: dict[str, Any], block_id: str) -> dict[str, Any]:
    actions = [
        {**a, "block_document_id": block_id} if a.get("block_document_id") == PLACEHOLDER else a
        for a in automation.get("actions", [])
    ]
    return {**automation, "actions": actions}


async def _block_id(client: Any, ref: str) -> str:
    from prefect.exceptions import ObjectNotFound

    slug, _, name = ref.partition("/")
    if not name:
        raise SystemExit(f"--slack-block {ref!r}: expected TYPE-SLUG/NAME, e.g. {DEFAULT_BLOCK}")
    try:
        block = await client.read_block_document_by_name(name=name, block_type_slug=slug)
    except ObjectNotFound:
        raise SystemExit(
            f"notification block {ref!r} not found on {client.api_url}; "
            "create it first, e.g. in Python: "
            "SlackWebhook(url=os.environ['SLACK_WEBHOOK_URL']).save('eaglescale-slack')"
        ) from None
    return str(block.id)


def turn_on_command() -> str:
    """The one command that applies the Slack automations skipped here (and lets the flows of
    deployment runs reach Slack): what `--skip-notifications` prints."""
    return (f"SLACK_WEBHOOK_URL=https://hooks.slack.com/services/... {Path(sys.executable).name} "
            "infra/prefect/automations.py --slack-webhook-from-env")  # fmt: skip


def save_webhook_blocks(url: str, notification_block: bool) -> str:
    """Save the webhook URL as the Secret block the flows read (tasks/notify.py
    DEFAULT_SECRET_BLOCK: deployment runs reach Slack without Slack in the worker's
    environment) and, with `notification_block`, as the SlackWebhook block the automations post
    through. Returns that block's TYPE-SLUG/NAME. The URL is a secret: never printed."""
    from prefect.blocks.notifications import SlackWebhook
    from prefect.blocks.system import Secret

    from tasks.notify import DEFAULT_SECRET_BLOCK

    Secret(value=url).save(DEFAULT_SECRET_BLOCK, overwrite=True)
    print(f"saved the Slack webhook as the Secret block {DEFAULT_SECRET_BLOCK!r}: the flows read it")
    if notification_block:
        SlackWebhook(url=url).save(DEFAULT_SECRET_BLOCK, overwrite=True)
        print(f"saved it as the notification block {DEFAULT_BLOCK!r}: the automations post through it")
    return DEFAULT_BLOCK


async def apply(folder: Path, slack_block: str, skip_notifications: bool = False) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    automations = load_automations(folder)
    if skip_notifications:
        skipped = [a["name"] for _, a in automations if needs_block(a)]
        automations = [(p, a) for p, a in automations if not needs_block(a)]
        if skipped:  # said, not silent: these are the alerts that work when a run's process is gone
            print(f"skipped {', '.join(skipped)}: they post to Slack and no Slack webhook was given. "
                  f"To turn them on:\n  {turn_on_command()}")  # fmt: skip
    async with get_client() as client:
        block_id = None
        if any(needs_block(a) for _, a in automations):
            block_id = await _block_id(client, slack_block)
        created = []
        for path, data in automations:
            if block_id is not None:
                data = with_block(data, block_id)
            try:
                automation = AutomationCore.model_validate(data)
            except ValueError as e:
                raise SystemExit(f"{path}: not a valid automation: {e}") from None
            for old in await client.read_automations_by_name(automation.name):
                await client.delete_automation(old.id)
            created.append(str(await client.create_automation(automation)))
            print(f"applied {automation.name} ({path.name})")
        return created


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="infra/prefect/automations.py",
        description="Create (or replace) the eaglescale automations on the Prefect server "
        "PREFECT_API_URL names.",
    )
    parser.add_argument(
        "--dir", type=Path, default=ROOT / "deployments/automations", help="folder of *.yaml / *.json"
    )
    parser.add_argument(
        "--slack-block",
        default=os.environ.get("EAGLESCALE_SLACK_BLOCK") or None,
        help="notification block for Slack actions, TYPE-SLUG/NAME "
        f"(default: $EAGLESCALE_SLACK_BLOCK or {DEFAULT_BLOCK})",
    )
    parser.add_argument(
        "--skip-notifications",
        action="store_true",
        help="apply only the automations without a Slack action (no block needed); says which it skipped",
    )
    parser.add_argument(
        "--slack-webhook-from-env",
        action="store_true",
        help="save $SLACK_WEBHOOK_URL as the Secret block the flows read and (without an explicit "
        f"--slack-block) as the notification block {DEFAULT_BLOCK}, then apply every automation",
    )
    args = parser.parse_args(argv)
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        # Unset, the client would start a throw-away ephemeral server and apply nothing useful.
        print("automations: PREFECT_API_URL is not set (environment or profile)", file=sys.stderr)
        return 2
    block = args.slack_block or DEFAULT_BLOCK
    if args.slack_webhook_from_env:
        url = os.environ.get("SLACK_WEBHOOK_URL", "").strip()
        if not url:
            print("automations: --slack-webhook-from-env: SLACK_WEBHOOK_URL is not set", file=sys.stderr)
            return 2
        # A block named on the command line is the automations' (the flows still get the Secret).
        saved = save_webhook_blocks(url, notification_block=args.slack_block is None)
        block = args.slack_block or saved
    asyncio.run(apply(args.dir, block, args.skip_notifications and not args.slack_webhook_from_env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
