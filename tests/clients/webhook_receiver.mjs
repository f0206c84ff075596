// A webhook receiver verifying every delivery with the Standard Webhooks reference library
// (`standardwebhooks` on npm), driven by tests/api/node.rs (SPEC CB-3). The same protocol as
// webhook_receiver.py: prints {"port": N}, then one JSON line per delivery; answers 204 to a
// delivery that verified, 401 otherwise; runs until stdin closes. The secret is WEBHOOK_SECRET.

import http from "node:http";
import standardwebhooks from "standardwebhooks";

const { Webhook } = standardwebhooks;
const hook = new Webhook(process.env.WEBHOOK_SECRET);

function rejected(body, headers) {
  try {
    hook.verify(body, headers);
    return false;
  } catch {
    return true;
  }
}

const server = http.createServer((req, res) => {
  const parts = [];
  req.on("data", (part) => parts.push(part));
  req.on("end", () => {
    const body = Buffer.concat(parts).toString("utf8");
    const headers = {
      "webhook-id": req.headers["webhook-id"],
      "webhook-timestamp": req.headers["webhook-timestamp"],
      "webhook-signature": req.headers["webhook-signature"],
    };
    const report = { id: headers["webhook-id"], path: req.url };
    try {
      const payload = hook.verify(body, headers);
      report.verified = true;
      report.type = payload.type;
      report.data_id = payload.data.id;
      report.data_status = payload.data.status;
    } catch (e) {
      report.verified = false;
      report.error = String(e);
    }
    const tampered = body.replace('"status"', '"statuz"');
    report.tampered_rejected = tampered !== body && rejected(tampered, headers);
    const old = { ...headers, "webhook-timestamp": String(Number(headers["webhook-timestamp"]) - 600) };
    report.old_rejected = rejected(body, old);
    process.stdout.write(JSON.stringify(report) + "\n");
    res.writeHead(report.verified ? 204 : 401, { "content-length": "0" });
    res.end();
  });
});

server.listen(0, "127.0.0.1", () => {
  process.stdout.write(JSON.stringify({ port: server.address().port }) + "\n");
});
process.stdin.on("data", () => {});
process.stdin.on("end", () => {
  server.close();
  process.exit(0);
});
