"""The load of benches/callgrind.sh: N chat completions (streamed or not) with unique bodies at
concurrency C against BASE, after a warm-up, between a callgrind zero and a dump of process PID,
so that the dump counts the load alone. Prints what it sent and received.

usage: callgrind_load.py BASE stream|nonstream N C PID
"""

import asyncio
import subprocess
import sys
import time
import uuid

import httpx

base, mode, n, c, pid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
nonce = uuid.uuid4().hex
events = 0


async def one(client, i):
    global events
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"cg {nonce} {i}"}]}
    if mode == "stream":
        body["stream"] = True
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    events += 1
    else:
        r = await client.post(base + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.status_code


async def run(count, tag):
    queue = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(f"{tag}-{i}")

    async def worker(client):
        while not queue.empty():
            await one(client, queue.get_nowait())

    limits = httpx.Limits(max_connections=c)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*[worker(client) for _ in range(c)])


asyncio.run(run(max(c, 20), "warm"))
events = 0
subprocess.run(["callgrind_control", "--zero", pid], check=True, capture_output=True)
started = time.time()
asyncio.run(run(n, "load"))
subprocess.run(["callgrind_control", "--dump=load", pid], check=True, capture_output=True)
print(f"requests={n} events={events} seconds={time.time() - started:.1f}")
