"""How openai-python's own retry logic meets holdfast's answers.

Usage: sdk_retries.py MODE with HOLDFAST_BASE_URL set (…/v1).
  final     -- a request holdfast already failed: `x-should-retry: false` must stop the SDK
  overload  -- an overload refusal: the SDK waits `retry-after-ms` and tries again
Prints one JSON object, with `sends`: the HTTP requests the SDK sent, its retries included.
"""
import json
import os
import sys
import time

import openai

mode = sys.argv[1]
out = {"sends": 0}


def count_send(request):
    out["sends"] += 1


client = openai.OpenAI(
    base_url=os.environ["HOLDFAST_BASE_URL"],
    api_key="unused",
    max_retries=3,
    http_client=openai.DefaultHttpxClient(event_hooks={"request": [count_send]}),
)
start = time.monotonic()
try:
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": f"sdk retries {mode}"}],
    )
    out["status"] = raw.http_response.status_code
    out["content"] = raw.parse().choices[0].message.content
except openai.APIStatusError as e:
    out["status"] = e.status_code
    out["should_retry"] = e.response.headers.get("x-should-retry")
out["elapsed"] = time.monotonic() - start
print(json.dumps(out))
