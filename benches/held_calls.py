"""Driver of benches/held_calls.sh: N calls held at once, then the proxy's CPU while they wait."""

import asyncio
import os
import sys
import time

import httpx


def cpu_seconds(pid: int) -> float:
    """User + system CPU of every thread of `pid`, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main() -> None:
    base, mock, n, kb, seconds, pid = sys.argv[1:7]
    n, kb, seconds, pid = int(n), int(kb), float(seconds), int(pid)
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        prompt = "x" * (kb * 1024)

        async def call(i: int) -> None:
            body = {
                "model": "gpt-4o-mini",
                "messages": [{"role": "user", "content": f"held {time.time_ns()} {i} {prompt}"}],
            }
            try:
                await client.post(f"{base}/v1/chat/completions", json=body)
            except httpx.HTTPError:
                pass

        calls = [asyncio.create_task(call(i)) for i in range(n)]
        deadline = time.monotonic() + 120
        while True:
            held = int((await client.get(f"{mock}/_mock/calls")).json()["calls"])
            if held >= n:
                break
            if time.monotonic() > deadline:
                sys.exit(f"only {held} of {n} calls reached the provider within 120 s")
            await asyncio.sleep(0.2)
        # Let admission's last writes settle before measuring.
        await asyncio.sleep(1)
        before, started = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(seconds)
        used, elapsed = cpu_seconds(pid) - before, time.monotonic() - started
        print(f"{n} calls held ({kb} KiB prompts): holdfast used {used / elapsed:.3f} cores over {elapsed:.1f} s")
        for task in calls:
            task.cancel()


asyncio.run(main())
