"""Function teachers for the v1 examples, written against their messages alone (no verifiers
import: they run in the trainer's process).

    python sft.py --model scratch --env verifiers --env_args "$V" --teacher docs/vf_v1_teacher.py:add
"""
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
