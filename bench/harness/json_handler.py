"""The request handler base of the benchmarks' small HTTP peers (transformers behind http.server): a JSON
reply with its length, and no line logged per request (the peers serve thousands in a timed window)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JsonHandler(BaseHTTPRequestHandler):
    def read_json(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def send_json(self, payload: object) -> None:
        reply = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
        pass
