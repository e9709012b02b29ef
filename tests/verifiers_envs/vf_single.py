"""A single-turn Verifiers environment (test data for env_verifiers.py): "What is 37 + 45?".

Classic Verifiers style: a `question`/`answer` dataset that Verifiers itself turns into a
`prompt` (system prompt + user message), an XMLParser with <think> and <answer>, and a
Rubric of weighted functions: a reward (async), the parser's format reward and a
weight-0 metric. MultiTurnEnv (which SingleTurnEnv is) adds its own `num_turns` metric.
"""
import random

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = """Add the two numbers. Think step by step, then reply in this format:
<think>
...
</think>
<answer>
...
</answer>"""


async def correct_answer(completion, answer, parser, **kwargs) -> float:
    """1 when the last <answer> equals the `answer` column. Async on purpose: Verifiers
    awaits coroutine reward functions, and the adapter must too."""
    parsed = parser.parse_answer(completion)
    return 1.0 if parsed is not None and parsed.strip() == answer else 0.0


def reply_length(completion, **kwargs) -> float:
    """Characters in the assistant's reply: a metric (weight 0), reported but not rewarded."""
    return float(sum(len(m["content"] or "") for m in completion if m["role"] == "assistant"))


def load_environment(num_examples: int = 50, seed: int = 0, **kwargs) -> vf.Environment:
    """num_examples questions "What is a + b?", drawn from a random.Random(seed) of their own
    (never the global generator, so loading twice gives the same dataset)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        # info rides along so the adapter can be checked for passing it through untouched
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b),
                     "info": {"a": a, "b": b}})
    parser = vf.XMLParser(["think", "answer"], answer_field="answer")
    rubric = vf.Rubric(
        funcs=[correct_answer, parser.get_format_reward_func(), reply_length],
        weights=[1.0, 0.2, 0.0],
        parser=parser,
    )
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), system_prompt=SYSTEM_PROMPT,
                            parser=parser, rubric=rubric, **kwargs)
