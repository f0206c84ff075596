"""Streams once through holdfast with an official SDK and reports whether iteration raised
(SPEC LC-7: a stream the provider did not finish must not look finished to the client).

Usage: truncated_streams.py, with HOLDFAST_ROUTE one of chat, responses, messages and
HOLDFAST_URL holdfast's address (no /v1). Prints {"raised": exception class or null, "text": what arrived}.
"""
import json
import os

import anthropic
import openai

url = os.environ["HOLDFAST_URL"]
route = os.environ["HOLDFAST_ROUTE"]
out = {"raised": None, "text": ""}
try:
    if route == "chat":
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "a stream that will not finish"}],
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out["text"] += chunk.choices[0].delta.content
    elif route == "responses":
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stream = client.responses.create(
            model="gpt-4o-mini", input="a stream that will not finish", stream=True
        )
        for event in stream:
            if event.type == "response.output_text.delta":
                out["text"] += event.delta
    elif route == "messages":
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        stream = client.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=64,
            messages=[{"role": "user", "content": "a stream that will not finish"}],
            stream=True,
        )
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                out["text"] += event.delta.text
    else:
        raise SystemExit(f"unknown route {route}")
except (openai.APIError, anthropic.APIError) as e:
    out["raised"] = type(e).__name__
    out["message"] = str(e)
print(json.dumps(out))
