"""OpenAI's Responses retrieval protocol through holdfast, with openai-python (SPEC RS-4, RD-3).

Usage: responses_resume.py MODE, HOLDFAST_URL set to holdfast's address (no /v1).
  retrieve  -- create(stream=True), read through sequence_number 10, drop the connection, then
               retrieve(id, stream=True, starting_after=10) to the end
  helper    -- the same, resumed with the responses.stream(response_id=id, starting_after=10)
               helper (which re-reads from the start and filters on the client)
  status    -- retrieve(id) while the stream runs, and after it finished
  cancel    -- cancel(id) while the stream runs; how long it took
Prints one JSON object: the events seen before and after the drop (type, sequence_number,
delta), the final response object's status and text, and what the mode measured.
"""
import json
import os
import sys
import time

import openai

url = os.environ["HOLDFAST_URL"]
mode = sys.argv[1]
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
PROMPT = "resume me through holdfast"


def row(event):
    return {
        "type": event.type,
        "sequence_number": getattr(event, "sequence_number", None),
        "delta": getattr(event, "delta", None) if event.type == "response.output_text.delta" else None,
    }


def text_of(response):
    return "".join(
        part.text
        for item in (response.output or [])
        if getattr(item, "type", None) == "message"
        for part in item.content
        if getattr(part, "type", None) == "output_text"
    )


def start(until):
    """create(stream=True), read through sequence_number `until`, then drop the connection."""
    stream = client.responses.create(model="gpt-4o-mini", input=PROMPT, stream=True)
    before, response_id = [], None
    for event in stream:
        before.append(row(event))
        if event.type == "response.created":
            response_id = event.response.id
        if event.sequence_number >= until:
            break
    stream.close()
    return response_id, before


out = {}
if mode in ("retrieve", "helper"):
    response_id, before = start(10)
    after = []
    if mode == "retrieve":
        for event in client.responses.retrieve(response_id, stream=True, starting_after=10):
            after.append(row(event))
    else:
        with client.responses.stream(response_id=response_id, starting_after=10) as stream:
            for event in stream:
                after.append(row(event))
            out["helper_final_text"] = text_of(stream.get_final_response())
    final = client.responses.retrieve(response_id)
    out.update(id=response_id, before=before, after=after, status=final.status, final_text=text_of(final))
elif mode == "status":
    response_id, before = start(3)
    during = client.responses.retrieve(response_id)
    for _ in client.responses.retrieve(response_id, stream=True, starting_after=3):
        pass
    after = client.responses.retrieve(response_id)
    out.update(id=response_id, during=during.status, after=after.status, final_text=text_of(after))
elif mode == "cancel":
    response_id, before = start(3)
    started = time.monotonic()
    cancelled = client.responses.cancel(response_id)
    out.update(id=response_id, cancelled=cancelled.status, cancel_seconds=time.monotonic() - started)
    out["after"] = client.responses.retrieve(response_id).status
else:
    raise SystemExit(f"unknown mode {mode}")
print(json.dumps(out))
