"""Google's Gen AI SDK (google-genai) through holdfast, unmodified but for its base URL (issue 31).

Usage: gemini_sdk.py MODE, HOLDFAST_URL set to holdfast's address (no version: the SDK adds
/v1 or /v1beta itself). Prints one JSON object.

- surface: generate_content, generate_content_stream, count_tokens, embed_content,
  models.list and models.get, each once, on the SDK's default API version; then generate_content again (a
  re-send, answered from the log). Prints the texts, the token count, the embedding's length and the model names.
- beta: generate_content and generate_content_stream with api_version="v1beta".
- retry: generate_content with HttpRetryOptions(attempts=3) and a 1 s timeout (the test makes
  the provider slower than that, or fail once). Prints the text, or the error it raised.
- interrupted: generate_content_stream, collecting the text until the SDK raises.
- quiet: generate_content_stream of a stream with silences (the test pauses the provider):
  the text, or the error the SDK raised.
"""
import json
import os
import sys

from google import genai
from google.genai import errors, types

url = os.environ["HOLDFAST_URL"]
mode = sys.argv[1]
MODEL = "gemini-2.5-flash"


def client(**options):
    return genai.Client(
        api_key="unused-by-holdfast",
        http_options=types.HttpOptions(base_url=url, **options),
    )


out = {}


def read_stream(contents):
    """Collects a generate_content_stream's text into out until its end or until the SDK
    raises, and what it raised."""
    c = client()  # held: a client collected mid-stream closes its connection
    out["text"] = ""
    try:
        for chunk in c.models.generate_content_stream(model=MODEL, contents=contents):
            out["text"] += chunk.text or ""
    except errors.APIError as e:
        out["error"] = {"code": e.code, "status": e.status, "message": e.message}
    except Exception as e:  # the test reports it
        out["error"] = f"{type(e).__name__}: {e}"


if mode == "surface":
    c = client()
    out["text"] = c.models.generate_content(model=MODEL, contents="gemini through holdfast").text
    out["stream_text"] = "".join(
        chunk.text or ""
        for chunk in c.models.generate_content_stream(
            model=MODEL, contents="gemini streaming through holdfast"
        )
    )
    out["total_tokens"] = c.models.count_tokens(
        model=MODEL, contents="count these tokens"
    ).total_tokens
    out["embedding"] = len(
        c.models.embed_content(model="text-embedding-004", contents="embed these").embeddings[0].values
    )
    out["models"] = [m.name for m in c.models.list()]
    out["one_model"] = c.models.get(model="gemini-mock-small").name
    out["again"] = c.models.generate_content(model=MODEL, contents="gemini through holdfast").text
elif mode == "beta":
    c = client(api_version="v1beta")
    out["text"] = c.models.generate_content(model=MODEL, contents="gemini beta").text
    out["stream_text"] = "".join(
        chunk.text or ""
        for chunk in c.models.generate_content_stream(model=MODEL, contents="gemini beta stream")
    )
elif mode == "retry":
    c = client(
        timeout=1000,
        retry_options=types.HttpRetryOptions(attempts=3, initial_delay=0.2, max_delay=0.5),
    )
    try:
        out["text"] = c.models.generate_content(model=MODEL, contents="gemini retry").text
    except Exception as e:  # the test reports it
        out["error"] = f"{type(e).__name__}: {e}"
elif mode == "interrupted":
    read_stream("gemini cut")
elif mode == "quiet":
    read_stream("gemini quiet")
else:
    sys.exit(f"unknown mode {mode}")
print(json.dumps(out))
