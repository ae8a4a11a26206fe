"""A local HTTP receiver that records what Slack (API or incoming webhook) would get."""

from __future__ import annotations

import json
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
