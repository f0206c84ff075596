"""The streaming loop every OpenAI example writes, against `holdfast serve --demo`.

Prints the streamed text. Fails (IndexError) if a chunk without choices reaches the client:
the demo asks the provider for the stream's usage (`inject_stream_usage`), and a client that
did not ask must not see that chunk (decision 40).
"""

import os
import sys

from openai import OpenAI

client = OpenAI(base_url=os.environ["HOLDFAST_URL"] + "/v1", api_key="unused-in-demo")
stream = client.chat.completions.create(
    model="gpt-4o-mini",
    messages=[{"role": "user", "content": "stream me a story"}],
    stream=True,
)
text = ""
for chunk in stream:
    text += chunk.choices[0].delta.content or ""
if not text:
    sys.exit("no text streamed")
print(text)
