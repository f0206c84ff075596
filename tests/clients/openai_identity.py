"""openai-python's half of the cross-SDK identity test (SPEC ID-1); openai_node.mjs `identity`
is the other half.

One chat completion, with `temperature` from HOLDFAST_TEMPERATURE: "1" sends the int 1 (JSON
`1`), "1.0" the float 1.0 (JSON `1.0`), "none" leaves it out. HOLDFAST_BASE_URL is holdfast's
`/v1` address. Prints {"response": {request_id, replayed}, "content", "bodies"} as JSON, `bodies`
being the raw request bodies the SDK sent.
"""
import json
import os

import openai

try:  # openai >= 3 ships its own fork of httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

bodies = []


class RecordingTransport(httpx.HTTPTransport):
    def handle_request(self, request):
        bodies.append(request.read().decode())
        return super().handle_request(request)


client = openai.OpenAI(
    base_url=os.environ["HOLDFAST_BASE_URL"],
    api_key="unused",
    max_retries=0,
    http_client=httpx.Client(transport=RecordingTransport()),
)
temperature = {"1": 1, "1.0": 1.0, "none": openai.NOT_GIVEN}[os.environ.get("HOLDFAST_TEMPERATURE", "1")]
raw = client.chat.completions.with_raw_response.create(
    model="gpt-4o-mini",
    messages=[{"role": "user", "content": "same logical request"}],
    temperature=temperature,
)
completion = raw.parse()
print(json.dumps({
    "response": {
        "request_id": raw.headers["holdfast-request-id"],
        "replayed": raw.headers["idempotent-replayed"],
    },
    "content": completion.choices[0].message.content,
    "bodies": bodies,
}))
