#!/usr/bin/env bash
# Instructions per proxied event or per request, by thread, under valgrind's callgrind: counts
# that do not depend on what else the machine is doing, so two builds compare in one run each
# even on a busy machine (docs/benchmarks.md, "Instructions"). User space only: the kernel's
# share (syscalls, fsync) is not in them.
#
#   benches/callgrind.sh [BINARY|floor] [stream|nonstream] [N] [C]
#
# BINARY (default target/release/holdfast) runs `serve` on a fresh SQLite file (`full`) in front
# of `holdfast mock-upstream` (20 events 5 ms apart, outside valgrind); `floor` runs the e2e
# bench's floor proxy instead (build it with `cargo bench --bench e2e --no-run`). N requests
# (default 200 streams or 2,000 requests) at concurrency C (16) are sent by callgrind_load.py
# (httpx: .venv from scripts/test, or any python3 with httpx). Output in target/callgrind/.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/holdfast}
mode=${2:-stream}
n=${3:-$([ "$mode" = stream ] && echo 200 || echo 2000)}
c=${4:-16}
target=${CARGO_TARGET_DIR:-target}
holdfast=$([ "$bin" = floor ] && echo "$target/release/holdfast" || echo "$bin")
python=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
for tool in valgrind callgrind_control callgrind_annotate; do
  command -v "$tool" >/dev/null || { echo "callgrind.sh: $tool is missing (apt-get install valgrind)" >&2; exit 1; }
done
dir=$(mktemp -d "${TMPDIR:-/tmp}/holdfast-callgrind.XXXXXX")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mock_port=$(free_port); port=$(free_port)
"$holdfast" mock-upstream --listen "127.0.0.1:$mock_port" --chunks 20 --chunk-delay-ms 5 >"$dir/mock.log" 2>&1 &
mock=$!
cat >"$dir/holdfast.toml" <<TOML
listen = "127.0.0.1:$port"
database_url = "sqlite://$dir/holdfast.db"
sqlite_synchronous = "full"

[workers]
concurrency = 1100

[[backends]]
name = "mock"
kind = "openai"
base_url = "http://127.0.0.1:$mock_port/v1"
TOML
out="$dir/callgrind.out.%p"
if [ "$bin" = floor ]; then
  exe=$(ls -t "$target"/release/deps/e2e-* | grep -v '\.d$' | head -1)
  HOLDFAST_BENCH_FLOOR="$port $mock_port" valgrind --tool=callgrind --separate-threads=yes \
    --callgrind-out-file="$out" "$exe" >"$dir/proxy.log" 2>&1 &
else
  valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out" \
    "$bin" serve --config "$dir/holdfast.toml" >"$dir/proxy.log" 2>&1 &
fi
proxy=$!
trap 'kill $proxy $mock 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -s -o /dev/null "http://127.0.0.1:$port/_mock/calls" && break
  sleep 0.2
done
summary=$("$python" benches/callgrind_load.py "http://127.0.0.1:$port" "$mode" "$n" "$c" "$proxy")
kill $proxy; wait $proxy 2>/dev/null || true
echo "$bin, $mode: $summary ($dir)"
per=$n
[ "$mode" = stream ] && per=$(sed -n 's/.*events=\([0-9]*\).*/\1/p' <<<"$summary")
total=0
for f in "$dir"/callgrind.out.*.1-*; do
  ir=$(sed -n 's/^summary: //p' "$f")
  [ "${ir:-0}" -gt 0 ] || continue
  top=$(callgrind_annotate --inclusive=yes --threshold=100 "$f" 2>/dev/null)
  # The thread's own loop is the first of these in the inclusive listing (by cost); with
  # link-time optimisation the functions around them are inlined away.
  case "$(grep -m1 -o -E 'worker::Context::run_task|sqlite::writer::write_loop|sqlite::writer::checkpoint_loop|sqlite3WalCheckpoint' <<<"$top")" in
    *run_task) name="tokio worker" ;;
    *write_loop) name="sqlite writer" ;;
    *checkpoint_loop | *sqlite3WalCheckpoint) name="wal checkpoint" ;;
    *) name="other" ;;
  esac
  printf '%-16s %12d instructions, %8d per %s\n' "$name" "$ir" $((ir / per)) "$([ "$mode" = stream ] && echo event || echo request)"
  total=$((total + ir))
done
printf '%-16s %12d instructions, %8d per %s\n' "all threads" "$total" $((total / per)) "$([ "$mode" = stream ] && echo event || echo request)"
