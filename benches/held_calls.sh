#!/usr/bin/env bash
# What held calls cost a node while they wait (decisions 146, 148; docs/benchmarks.md "Held
# calls"): holdfast on a fresh SQLite file (`full`) in front of `holdfast mock-upstream`, which
# holds every call's answer for ten minutes. N non-stream calls with prompts of KB KiB are sent
# at once; once the mock holds all of them, holdfast's CPU (user + system, every thread) is
# read over SECONDS and printed in cores.
#
#   benches/held_calls.sh [BINARY] [N] [KB] [SECONDS]   (defaults: target/release/holdfast 1000 20 10)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/holdfast}
n=${2:-1000}
kb=${3:-20}
seconds=${4:-10}
python=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
dir=$(mktemp -d "${TMPDIR:-/tmp}/holdfast-held.XXXXXX")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mock_port=$(free_port); port=$(free_port)
"$bin" mock-upstream --listen "127.0.0.1:$mock_port" --hang-before-headers-ms 600000 --hang-first 0 \
  >"$dir/mock.log" 2>&1 &
mock=$!
cat >"$dir/holdfast.toml" <<TOML
listen = "127.0.0.1:$port"
database_url = "sqlite://$dir/holdfast.db"
sqlite_synchronous = "full"

[[backends]]
name = "mock"
kind = "openai"
base_url = "http://127.0.0.1:$mock_port/v1"
TOML
"$bin" serve --config "$dir/holdfast.toml" >"$dir/holdfast.log" 2>&1 &
proxy=$!
trap 'kill $proxy $mock 2>/dev/null || true' EXIT
for _ in $(seq 1 150); do
  curl -s -o /dev/null "http://127.0.0.1:$port/healthz" && break
  sleep 0.2
done
"$python" benches/held_calls.py "http://127.0.0.1:$port" "http://127.0.0.1:$mock_port" "$n" "$kb" "$seconds" "$proxy"
echo "($dir)"
