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


async def apply(folder: Path, slack_block: str, skip_notifications: bool = False) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    automations = load_automations(folder)
    if skip_notifications:
        automations = [(p, a) for p, a in automations if not needs_block(a)]
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
        default=os.environ.get("EAGLESCALE_SLACK_BLOCK", DEFAULT_BLOCK),
        help="notification block for Slack actions, TYPE-SLUG/NAME "
        f"(default: $EAGLESCALE_SLACK_BLOCK or {DEFAULT_BLOCK})",
    )
    parser.add_argument(
        "--skip-notifications",
        action="store_true",
        help="apply only the automations without a Slack action (no block needed)",
    )
    args = parser.parse_args(argv)
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        # Unset, the client would start a throw-away ephemeral server and apply nothing useful.
        print("automations: PREFECT_API_URL is not set (environment or profile)", file=sys.stderr)
        return 2
    asyncio.run(apply(args.dir, args.slack_block, args.skip_notifications))
    return 0


if __name__ == "__main__":
    sys.exit(main())
