"""Streams through holdfast with the official SDKs (SPEC RS-2..RS-4, LC-7).

Usage: sdk_streams.py MODE, with HOLDFAST_URL set to holdfast's address (no /v1).
  openai     -- stream a chat completion twice; print both texts
  anthropic  -- stream a message twice (raw events and the messages.stream helper); print texts
  broken     -- stream a chat completion the provider drops; print the exception class and text
Prints one JSON object.
"""
import json
import os
import sys

import anthropic
import openai

url = os.environ["HOLDFAST_URL"]
mode = sys.argv[1]
out = {}

if mode in ("openai", "broken"):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    texts = []
    for _ in range(1 if mode == "broken" else 2):
        text = ""
        try:
            stream = client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "stream through holdfast"}],
                stream=True,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        except openai.APIError as e:
            out["raised"] = type(e).__name__
            out["message"] = str(e)
        texts.append(text)
    out["texts"] = texts
elif mode == "anthropic":
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    texts = []
    stream = client.messages.create(
        model="claude-sonnet-4-5",
        max_tokens=64,
        messages=[{"role": "user", "content": "stream through holdfast"}],
        stream=True,
    )
    text = ""
    for event in stream:
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
    texts.append(text)
    with client.messages.stream(
        model="claude-sonnet-4-5",
        max_tokens=64,
        messages=[{"role": "user", "content": "stream through holdfast"}],
    ) as s:
        texts.append("".join(s.text_stream))
    message = client.messages.create(
        model="claude-sonnet-4-5",
        max_tokens=64,
        messages=[{"role": "user", "content": "stream through holdfast"}],
    )
    out["non_stream"] = message.content[0].text
    out["texts"] = texts
print(json.dumps(out))
