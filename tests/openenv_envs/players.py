"""Scripted players of the three environments, written against the messages the model reads
(`eval.py --model tests/openenv_envs/players.py:bisect`): they run in the trainer's process, with
no openenv."""
import json
import re


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def add(messages):
    """qa.py: the sum asked."""
    a, b = map(int, re.findall(r"\d+", messages[-1]["content"]))
    return str(a + b)


def bisect(messages):
    """guess.py: halve the range on each hint."""
    low, high = 1, 8
    for said, answer in zip(messages, messages[1:]):
        if said["role"] == "assistant" and answer["role"] == "tool":
            guess = json.loads(re.search(r"<tool_call>(.*)</tool_call>", said["content"])[1])
            guess = guess["arguments"]["guess"]
            low, high = ((guess + 1, high) if answer["content"].startswith("hint: Higher.")
                         else (low, guess - 1))
    return call("GuessAction", guess=(low + high) // 2)


def look_up_and_submit(messages):
    """lookup.py: look the key up, then submit its value."""
    if messages[-1]["role"] == "tool":
        return call("submit", value=messages[-1]["content"])
    return call("lookup", key=re.search(r"value of (\w+)", messages[1]["content"])[1])
