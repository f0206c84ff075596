"""openai-python with max_retries=0 while the provider fails twice with 500.

holdfast retries on its own (SPEC LC-5), so the SDK's single try succeeds. Prints
{"content", "holdfast_request_id"} as JSON.
"""
import json
import os

import openai

client = openai.OpenAI(base_url=os.environ["HOLDFAST_BASE_URL"], api_key="unused", max_retries=0)
raw = client.chat.completions.with_raw_response.create(
    model="gpt-4o-mini",
    messages=[{"role": "user", "content": "fail twice then answer"}],
)
completion = raw.parse()
print(json.dumps({
    "content": completion.choices[0].message.content,
    "holdfast_request_id": raw.headers["holdfast-request-id"],
}))
