"""LangChain's ChatOpenAI through holdfast, against a provider slower than its timeout (issue 14).

Usage: langchain_retry.py MODE (invoke | stream), HOLDFAST_URL set to holdfast's address (no
/v1). ChatOpenAI with timeout=1 and max_retries=3 (openai-python's own retries re-send the same
body, which holdfast attaches to the first execution). Prints {"text": ..., "error": ...}.
"""
import json
import os
import sys

from langchain_openai import ChatOpenAI

url = os.environ["HOLDFAST_URL"]
mode = sys.argv[1]
chat = ChatOpenAI(
    model="gpt-4o-mini", base_url=url + "/v1", api_key="unused", timeout=1, max_retries=3
)
out = {"text": "", "error": None}
try:
    if mode == "invoke":
        out["text"] = chat.invoke("LangChain through holdfast").content
    else:
        for chunk in chat.stream("LangChain streaming through holdfast"):
            out["text"] += chunk.content
except Exception as e:  # the test reports it
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
