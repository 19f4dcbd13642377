"""A tiny JSON HTTP handler base for tests that stand in for a server (e.g. the step-report
endpoint seen from the trainer's side)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


class JSONHandler(BaseHTTPRequestHandler):
    """Quiet handler with :meth:`send_json` and :meth:`read_json`."""

    def log_message(self, *a: Any) -> None:
        pass

    def send_json(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_json(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))
