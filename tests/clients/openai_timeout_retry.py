"""openai-python with timeout=1 against a provider that answers after 3 s.

The SDK times out and retries the same body; holdfast must attach the retries to the first
execution (SPEC RS-2). HOLDFAST_BASE_URL: holdfast's address with /v1; SDK_MAX_RETRIES: the
client's max_retries (default 6); TRACEPARENT, when set, a W3C traceparent every send carries
(as a traced app's instrumentation would add it). Prints {"content", "timeouts_seen", "max_retries"} as JSON.
"""
import json
import os

import openai

try:  # openai >= 3 ships its own fork of httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

timeouts = 0
max_retries = int(os.environ.get("SDK_MAX_RETRIES", "6"))


class CountingTransport(httpx.HTTPTransport):
    def handle_request(self, request):
        global timeouts
        try:
            return super().handle_request(request)
        except httpx.TimeoutException:
            timeouts += 1
            raise


client = openai.OpenAI(
    base_url=os.environ["HOLDFAST_BASE_URL"],
    api_key="unused",
    timeout=1.0,
    max_retries=max_retries,
    http_client=httpx.Client(transport=CountingTransport()),
    default_headers=(
        {"traceparent": os.environ["TRACEPARENT"]} if os.environ.get("TRACEPARENT") else None
    ),
)
completion = client.chat.completions.create(
    model="gpt-4o-mini",
    messages=[{"role": "user", "content": "a slow answer, please"}],
)
print(
    json.dumps(
        {
            "content": completion.choices[0].message.content,
            "timeouts_seen": timeouts,
            "max_retries": max_retries,
        }
    )
)
