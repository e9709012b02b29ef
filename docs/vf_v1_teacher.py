"""A function teacher for docs/vf_v1_reverse.py, written against its messages alone (no verifiers
import: it runs in the trainer's process): the last "Reverse: WORD" reversed, in the answer tags.

    python sft.py --model scratch --env verifiers --env_args "$V" --teacher docs/vf_v1_teacher.py:reverse
"""


def reverse(messages):
    text = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    return f"<answer>{text.rsplit(':', 1)[-1].strip()[::-1]}</answer>"
