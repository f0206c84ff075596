#!/usr/bin/env bash
# One namespace's burst of large request bodies beside another namespace's small calls
# (LC-2b, docs/benchmarks.md "Large bodies beside another tenant"): holdfast on a fresh SQLite
# file (`full`) with namespaces team-a and team-b in front of `holdfast mock-upstream`.
# team-a sends N bodies of MB MiB at once; meanwhile a second process sends team-b's small
# calls one after another; printed: team-b's latency alone and beside the burst, the burst's
# wall time, and holdfast's peak RSS.
#
#   benches/large_bodies.sh [BINARY] [N] [MB]     (defaults: target/release/holdfast 20 30)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/holdfast}
n=${2:-20}
mb=${3:-30}
python=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
dir=$(mktemp -d "${TMPDIR:-/tmp}/holdfast-large.XXXXXX")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mock_port=$(free_port); port=$(free_port)
"$bin" mock-upstream --listen "127.0.0.1:$mock_port" >"$dir/mock.log" 2>&1 &
mock=$!
cat >"$dir/holdfast.toml" <<TOML
listen = "127.0.0.1:$port"
database_url = "sqlite://$dir/holdfast.db"
sqlite_synchronous = "full"

[[backends]]
name = "mock"
kind = "openai"
base_url = "http://127.0.0.1:$mock_port/v1"

[[namespaces]]
name = "team-a"
api_keys = ["key-a"]

[[namespaces]]
name = "team-b"
api_keys = ["key-b"]
TOML
"$bin" serve --config "$dir/holdfast.toml" >"$dir/holdfast.log" 2>&1 &
proxy=$!
trap 'kill $proxy $mock 2>/dev/null || true' EXIT
for _ in $(seq 1 150); do
  curl -s -o /dev/null "http://127.0.0.1:$port/healthz" && break
  sleep 0.2
done
"$python" benches/large_bodies.py "http://127.0.0.1:$port" "$n" "$mb"
echo "holdfast peak RSS: $(sed -n 's/^VmHWM:[[:space:]]*//p' "/proc/$proxy/status") ($dir)"
