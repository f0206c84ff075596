"""The calls SDKs make around the logged routes, through holdfast (issue 14).

Usage: sdk_surface.py, HOLDFAST_URL set to holdfast's address (no /v1). Prints one JSON object:
openai-python's models.list() ids, anthropic-python's models.list() ids and
messages.count_tokens() result.
"""
import json
import os

import anthropic
import openai

url = os.environ["HOLDFAST_URL"]
oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
an = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
out = {
    "openai_models": [m.id for m in oa.models.list()],
    "anthropic_models": [m.id for m in an.models.list()],
    "count_tokens": an.messages.count_tokens(
        model="claude-sonnet-4-5",
        messages=[{"role": "user", "content": "how many tokens is this"}],
    ).input_tokens,
}
print(json.dumps(out))
