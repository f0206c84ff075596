"""Every route's usage, from the official SDKs' calls through holdfast (docs/usage.md).

Usage: usage_routes.py, HOLDFAST_URL set to holdfast's address (no /v1). Makes one call per
route and mode (chat streamed with stream_options.include_usage, and not; completions;
embeddings; responses streamed and not; messages streamed and not) and prints the
Holdfast-Request-Id of each, keyed by a name, as one JSON object.
"""
import json
import os

import anthropic
import openai

url = os.environ["HOLDFAST_URL"]
oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
an = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
ids = {}


def drain(raw):
    for _ in raw.parse():
        pass
    return raw.headers["holdfast-request-id"]


r = oa.chat.completions.with_raw_response.create(
    model="gpt-4o-mini", messages=[{"role": "user", "content": "usage, chat"}]
)
ids["chat"] = r.headers["holdfast-request-id"]
with oa.chat.completions.with_streaming_response.create(
    model="gpt-4o-mini",
    messages=[{"role": "user", "content": "usage, chat stream"}],
    stream=True,
    stream_options={"include_usage": True},
) as r:
    ids["chat_stream"] = drain(r)
r = oa.completions.with_raw_response.create(model="gpt-4o-mini", prompt="usage, completions")
ids["completions"] = r.headers["holdfast-request-id"]
r = oa.embeddings.with_raw_response.create(model="text-embedding-3-small", input="usage, embeddings")
ids["embeddings"] = r.headers["holdfast-request-id"]
r = oa.responses.with_raw_response.create(model="gpt-4o-mini", input="usage, responses")
ids["responses"] = r.headers["holdfast-request-id"]
with oa.responses.with_streaming_response.create(
    model="gpt-4o-mini", input="usage, responses stream", stream=True
) as r:
    ids["responses_stream"] = drain(r)
r = an.messages.with_raw_response.create(
    model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "usage, messages"}]
)
ids["messages"] = r.headers["holdfast-request-id"]
with an.messages.with_streaming_response.create(
    model="claude-sonnet-4-5",
    max_tokens=64,
    messages=[{"role": "user", "content": "usage, messages stream"}],
    stream=True,
) as r:
    ids["messages_stream"] = drain(r)
print(json.dumps(ids))
