"""Function teachers for the v1 examples, written against their messages alone (no verifiers
import: they run in the trainer's process).

    python sft.py --model scratch --env verifiers --env_args "$V" --teacher docs/vf_v1_teacher.py:add
"""
import json
import re


def last_user(messages):
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


def add(messages):
    """docs/vf_v1_add.py: "A + B = ?" answered."""
    a, b = map(int, re.findall(r"-?\d+", last_user(messages))[:2])
    return f"<answer>{a + b}</answer>"


def reverse(messages):
    """docs/vf_v1_reverse.py: the last "Reverse: WORD" reversed, in the answer tags."""
    return f"<answer>{last_user(messages).rsplit(':', 1)[-1].strip()[::-1]}</answer>"


def calc(messages):
    """tests/vf_v1/v1_calc.py: call its calculator tool on the expression, then answer its result."""
    if messages[-1]["role"] == "tool":
        return f"<answer>{messages[-1]['content']}</answer>"
    expression = last_user(messages).removeprefix("Compute ").rstrip(".")
    call = {"name": "calculator_evaluate", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"
