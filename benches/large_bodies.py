"""The load of benches/large_bodies.sh: BASE N MB, or BASE small SECONDS STOP_FILE (the child)."""
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

base = sys.argv[1]


def small_calls(seconds, stop_file):
    """team-b's small calls, one after another, until `stop_file` exists or `seconds` pass."""

    async def run():
        nonce, latencies = os.urandom(4).hex(), []
        async with httpx.AsyncClient(timeout=120) as client:
            deadline = time.time() + seconds
            while time.time() < deadline and not os.path.exists(stop_file):
                body = {"model": "gpt-4o-mini",
                        "messages": [{"role": "user", "content": f"small {nonce} {len(latencies)}"}]}
                start = time.perf_counter()
                r = await client.post(f"{base}/v1/chat/completions", json=body,
                                      headers={"authorization": "Bearer key-b"})
                latencies.append((time.perf_counter() - start) * 1000)
                assert r.status_code == 200, r.text
        latencies.sort()
        k = len(latencies)
        print(f"n={k} p50 {latencies[k // 2]:.1f} p90 {latencies[int(k * .9)]:.1f} "
              f"p99 {latencies[int(k * .99)]:.1f} max {latencies[-1]:.1f} ms")

    asyncio.run(run())


def burst(n, mb):
    """team-a's N bodies of MB MiB at once, beside a child process sending team-b's calls."""
    nonce, pad = os.urandom(4).hex(), "x" * (mb << 20)
    bodies = [json.dumps({"model": "gpt-4o-mini",
                          "messages": [{"role": "user", "content": f"large {nonce} {i} {pad}"}]}).encode()
              for i in range(n)]
    stop_file = os.path.join(tempfile.mkdtemp(), "stop")
    me = [sys.executable, __file__, base, "small"]
    alone = subprocess.run(me + ["2", stop_file], capture_output=True, text=True, check=True)
    print(f"team-b alone:             {alone.stdout.strip()}")
    child = subprocess.Popen(me + ["300", stop_file], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)

    async def send(body):
        async with httpx.AsyncClient(timeout=300) as client:
            r = await client.post(f"{base}/v1/chat/completions", content=body,
                                  headers={"authorization": "Bearer key-a",
                                           "content-type": "application/json"})
            return r.status_code

    async def all_of_them():
        start = time.perf_counter()
        statuses = await asyncio.gather(*(send(b) for b in bodies))
        return statuses, time.perf_counter() - start

    statuses, wall = asyncio.run(all_of_them())
    open(stop_file, "w").close()
    beside = child.communicate()[0].strip()
    print(f"team-b beside the burst:  {beside}")
    print(f"team-a: {n} bodies of {mb} MiB in {wall:.2f} s, statuses {sorted(set(statuses))}")


if sys.argv[2] == "small":
    small_calls(float(sys.argv[3]), sys.argv[4])
else:
    burst(int(sys.argv[2]), int(sys.argv[3]))
