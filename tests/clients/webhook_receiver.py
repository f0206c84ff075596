"""A webhook receiver verifying every delivery with the Standard Webhooks reference library
(`standardwebhooks` on PyPI), driven by tests/api/callbacks.rs (SPEC CB-3).

Listens on 127.0.0.1 (a free port), prints {"port": N}, then one JSON line per delivery:
whether it verified unmodified, and whether a tampered body and an old timestamp (ten minutes
earlier) were rejected. Answers 204 to a delivery that verified, 401 otherwise. Runs until
stdin closes. The secret is WEBHOOK_SECRET.
"""

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

hook = Webhook(os.environ["WEBHOOK_SECRET"])
lock = threading.Lock()


def rejected(body, headers):
    try:
        hook.verify(body, headers)
    except WebhookVerificationError:
        return True
    return False


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        headers = {k.lower(): v for k, v in self.headers.items()}
        report = {"id": headers.get("webhook-id"), "path": self.path}
        try:
            payload = hook.verify(body, headers)
            report["verified"] = True
            report["type"] = payload["type"]
            report["data_id"] = payload["data"]["id"]
            report["data_status"] = payload["data"]["status"]
        except (WebhookVerificationError, KeyError, ValueError) as e:
            report["verified"] = False
            report["error"] = repr(e)
        tampered = body.replace(b'"status"', b'"statuz"', 1)
        report["tampered_rejected"] = tampered != body and rejected(tampered, headers)
        old = dict(headers)
        old["webhook-timestamp"] = str(int(headers.get("webhook-timestamp", "0")) - 600)
        report["old_rejected"] = rejected(body, old)
        with lock:
            print(json.dumps(report), flush=True)
        self.send_response(204 if report["verified"] else 401)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(json.dumps({"port": server.server_address[1]}), flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdin.read()
server.shutdown()
