"""Checks an `holdfast requests export --format openai-chat` file against OpenAI's chat
fine-tuning format (SPEC EX-5): each line one JSON object `{"messages": [...]}` (plus `tools`),
roles system/user/assistant/tool, string content (null only beside tool calls), tool calls with
ids, `function` names and JSON-string arguments, every tool message answering an earlier call,
and the last message the assistant's. The checks follow OpenAI's own format validation for
fine-tuning data (the cookbook's "Data preparation and analysis for chat model fine-tuning").

usage: finetune_format.py FILE EXPECTED_JSON
EXPECTED_JSON holds a list: the expected text of each line's last (assistant) message, in order.
Standard library only.
"""

import json
import sys

ROLES = {"system", "user", "assistant", "tool"}
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "weight"}
EXAMPLE_KEYS = {"messages", "tools", "parallel_tool_calls"}


def fail(n, why):
    sys.exit(f"line {n}: {why}")


def check_tool_calls(n, calls, known):
    if not isinstance(calls, list) or not calls:
        fail(n, "tool_calls must be a non-empty list")
    for call in calls:
        if set(call) - {"id", "type", "function"}:
            fail(n, f"unexpected tool call keys {sorted(set(call))}")
        if not isinstance(call.get("id"), str) or not call["id"]:
            fail(n, "a tool call without an id")
        if call.get("type") != "function":
            fail(n, "a tool call whose type is not function")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            fail(n, "a tool call without a function name")
        if not isinstance(fn.get("arguments"), str):
            fail(n, "tool call arguments must be a JSON string")
        json.loads(fn["arguments"])
        known.add(call["id"])


def check(n, example):
    if not isinstance(example, dict):
        fail(n, "not a JSON object")
    if set(example) - EXAMPLE_KEYS:
        fail(n, f"unexpected keys {sorted(set(example) - EXAMPLE_KEYS)}")
    messages = example.get("messages")
    if not isinstance(messages, list) or not messages:
        fail(n, "missing messages list")
    for tool in example.get("tools", []):
        if tool.get("type") != "function" or not isinstance(tool.get("function", {}).get("name"), str):
            fail(n, f"a tool that is not a named function: {tool}")
    known = set()
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            fail(n, f"message without a role: {m}")
        if set(m) - MESSAGE_KEYS:
            fail(n, f"unrecognised message keys {sorted(set(m) - MESSAGE_KEYS)}")
        if m["role"] not in ROLES:
            fail(n, f"unrecognised role {m['role']!r}")
        content = m.get("content")
        if "tool_calls" in m:
            if m["role"] != "assistant":
                fail(n, "tool_calls on a message that is not the assistant's")
            check_tool_calls(n, m["tool_calls"], known)
            if content is not None and not isinstance(content, str):
                fail(n, "assistant content must be text or null")
        elif not isinstance(content, str):
            fail(n, f"missing text content in a {m['role']} message")
        if m["role"] == "tool":
            if m.get("tool_call_id") not in known:
                fail(n, f"a tool message answering no earlier call: {m.get('tool_call_id')!r}")
    if messages[-1]["role"] != "assistant":
        fail(n, "the last message is not the assistant's")
    if not any(m["role"] == "assistant" for m in messages):
        fail(n, "example missing an assistant message")
    return messages[-1]


def main():
    path, expected_path = sys.argv[1], sys.argv[2]
    with open(expected_path, encoding="utf-8") as f:
        expected = json.load(f)
    with open(path, encoding="utf-8") as f:
        raw = [line for line in f.read().split("\n") if line]
    if len(raw) != len(expected):
        sys.exit(f"{len(raw)} lines, expected {len(expected)}")
    for n, (line, want) in enumerate(zip(raw, expected), start=1):
        last = check(n, json.loads(line))
        if last.get("content") != want:
            fail(n, f"the assistant's answer {last.get('content')!r} is not the whole "
                    f"streamed text {want!r}")
    print(f"{len(raw)} examples ok")


if __name__ == "__main__":
    main()
