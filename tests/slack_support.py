"""A local HTTP receiver that records what Slack (API or incoming webhook) would get."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs


class Receiver:
    def __init__(self, status: int = 200, body: dict[str, Any] | None = None):
        self.status = status
        self.body = body if body is not None else {"ok": True, "ts": "1.0"}
        self.requests: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if "json" in self.headers.get("Content-Type", ""):
                    payload = json.loads(raw)
                else:
                    payload = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
                receiver.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "json": payload}
                )
                out = json.dumps(receiver.body).encode()
                self.send_response(receiver.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


# What a person should never read in a message: a Python repr (None, True, {}, ['a'], {'k': ...},
# Name(field=...)), or a float printed to more than 6 significant digits.
REPR = re.compile(r"\bNone\b|\bTrue\b|\bFalse\b|\{'|\['|\{\}|\[\]|\b[A-Z]\w*\(\w+=")
FLOAT = re.compile(r"(?<![\w.])\d+\.\d+(?:e[-+]?\d+)?")
MAX_SIGNIFICANT = 6


def message_texts(message: dict[str, Any]) -> list[str]:
    """Every text of a posted message: the fallback and each block's (sections, their fields,
    context elements)."""
    blocks = message.get("blocks") or []
    if isinstance(blocks, str):  # the bot token path posts form fields
        blocks = json.loads(blocks)
    texts = [message.get("text") or ""]
    for block in blocks:
        texts += [block["text"]["text"]] if "text" in block else []
        texts += [f["text"] for f in block.get("fields", [])] + [e["text"] for e in block.get("elements", [])]
    return texts


def title(message: dict[str, Any]) -> str:
    """The message's title, as its headline shows it in bold: `generate completed`."""
    return re.search(r"\*(.+?)\*", message_texts(message)[1])[1]


def unreadable(message: dict[str, Any]) -> list[str]:
    """What in a message is not for people: reprs, and floats of more than 6 significant digits."""
    problems = []
    for text in message_texts(message):
        problems += [f"repr {m[0]!r} in {text!r}" for m in REPR.finditer(text)]
        for m in FLOAT.finditer(text):
            if len(m[0].split("e")[0].replace(".", "").lstrip("0")) > MAX_SIGNIFICANT:
                problems.append(f"float {m[0]} in {text!r}")
    return problems
