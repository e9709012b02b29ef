"""A tool-calling Verifiers environment (test data for env_verifiers.py): vf.ToolEnv.

Two plain Python tools, add and multiply; Verifiers builds their JSON schemas from the type
hints and docstrings and offers them to the model as `tool_defs` (never in the prompt). The
model calls them with native tool calls (id, name, JSON arguments); Verifiers answers each
with a `tool` message, and the episode ends at the first reply without a tool call
(ToolEnv's no_tools_called) or after max_turns replies. A tool that raises (a wrong
argument) gets its error text back as the tool message: a wasted turn, not a crash.

The dataset has a ready `prompt` column (system + user messages), unlike vf_single.py's
`question`, so both of Verifiers' dataset paths are covered. Rubric: correct_answer (1.0);
Verifiers itself adds the weight-0 metrics total_tool_calls, add_calls, multiply_calls
(ToolEnv's ToolMonitorRubric) and num_turns (MultiTurnEnv's).
"""
import random

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = """Use the tools to compute the result, then reply with the final number only,
inside <answer>...</answer>."""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def correct_answer(completion, answer, parser, **kwargs) -> float:
    """1 when the last <answer> equals the `answer` column."""
    parsed = parser.parse_answer(completion)
    return 1.0 if parsed is not None and parsed.strip() == answer else 0.0


def load_environment(num_examples: int = 20, seed: int = 0, max_turns: int = 4,
                     **kwargs) -> vf.Environment:
    """num_examples questions "What is (a + b) * c?" (two tool calls, then the answer),
    drawn from a random.Random(seed) of their own."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        a, b, c = rng.randint(100, 999), rng.randint(100, 999), rng.randint(11, 99)
        question = f"What is ({a} + {b}) * {c}?"
        rows.append({"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                {"role": "user", "content": question}],
                     "answer": str((a + b) * c), "info": {"a": a, "b": b, "c": c}})
    parser = vf.XMLParser(["answer"], answer_field="answer")
    rubric = vf.Rubric(funcs=[correct_answer], weights=[1.0], parser=parser)
    return vf.ToolEnv(tools=[add, multiply], max_turns=max_turns,
                      dataset=Dataset.from_list(rows), parser=parser, rubric=rubric, **kwargs)
