"""Every proxied route through its official SDK method, each twice (SPEC HTTP-1, RS-3).

Prints {route: {"replayed": [first, second], "ids_equal": bool, "summary": str}} as JSON.
"""
import json
import os

import anthropic
import openai

url = os.environ["HOLDFAST_URL"]
oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
ant = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def twice(name, call, summarize):
    results = []
    for _ in range(2):
        raw = call()
        results.append((raw.headers.get("idempotent-replayed"), raw.headers.get("holdfast-request-id"), summarize(raw.parse())))
    out[name] = {
        "replayed": [r[0] for r in results],
        "ids_equal": results[0][1] == results[1][1],
        "same_answer": results[0][2] == results[1][2],
        "summary": results[0][2],
    }


out = {}
twice(
    "openai.chat",
    lambda: oai.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "routes"}]
    ),
    lambda r: r.choices[0].message.content,
)
twice(
    "openai.completions",
    lambda: oai.completions.with_raw_response.create(model="gpt-3.5-turbo-instruct", prompt="routes"),
    lambda r: r.choices[0].text,
)
twice(
    "openai.embeddings",
    lambda: oai.embeddings.with_raw_response.create(model="text-embedding-3-small", input=["routes", "more"]),
    lambda r: [len(d.embedding) for d in r.data],
)
twice(
    "openai.responses",
    lambda: oai.responses.with_raw_response.create(model="gpt-4o-mini", input="routes"),
    lambda r: r.output_text,
)
twice(
    "anthropic.messages",
    lambda: ant.messages.with_raw_response.create(
        model="claude-sonnet-4-5", max_tokens=32, messages=[{"role": "user", "content": "routes"}]
    ),
    lambda r: r.content[0].text,
)

# Streams of the named-event routes.
text = ""
for event in oai.responses.create(model="gpt-4o-mini", input="routes streamed", stream=True):
    if event.type == "response.output_text.delta":
        text += event.delta
out["openai.responses.stream"] = {"summary": text}
text = ""
for chunk in oai.completions.create(model="gpt-3.5-turbo-instruct", prompt="routes streamed", stream=True):
    text += chunk.choices[0].text if chunk.choices else ""
out["openai.completions.stream"] = {"summary": text}
print(json.dumps(out))
