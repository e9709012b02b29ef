"""A stateful tool environment (test data for env_verifiers.py): vf.StatefulToolEnv.

Each example hides a few numbers (info["numbers"], copied into state by setup_state). The
model reads them one at a time with hidden_number(index), then answers their sum in
<answer>...</answer>. The tool's second argument, `numbers`, is hidden from the model: it
is left out of the tool's schema (add_tool(..., args_to_skip=["numbers"])) and injected
from state by update_tool_args, which also counts the reads in state["reads"] (a state
change the rubric sees). A bad index comes back as an error message in the tool reply.

Rubric: correct_sum (1.0) and reads (a weight-0 metric from state); Verifiers adds
total_tool_calls, hidden_number_calls and num_turns (weight 0).
"""
import random

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = """Some numbers are hidden from you. Read them with the hidden_number tool,
one index at a time, then reply with their sum only, inside <answer>...</answer>."""


def hidden_number(index: int, numbers: list[int]) -> int:
    """Read one hidden number.

    Args:
        index: The position of the number to read, from 0.
        numbers: The hidden numbers (filled in by the environment).
    """
    if not 0 <= index < len(numbers):
        raise IndexError(f"index {index} is out of range 0..{len(numbers) - 1}")
    return numbers[index]


class HiddenNumbersEnv(vf.StatefulToolEnv):
    def __init__(self, **kwargs):
        super().__init__(tools=[], **kwargs)
        # added after __init__: StatefulToolEnv rebuilds its tool lists there
        self.add_tool(hidden_number, args_to_skip=["numbers"])

    async def setup_state(self, state: vf.State) -> vf.State:
        state["numbers"] = list(state["info"]["numbers"])
        state["reads"] = 0
        return state

    def update_tool_args(self, tool_name: str, tool_args: dict, messages: vf.Messages,
                         state: vf.State, **kwargs) -> dict:
        if tool_name == "hidden_number":
            state["reads"] += 1
            return {**tool_args, "numbers": state["numbers"]}
        return tool_args


def correct_sum(completion, answer, parser, **kwargs) -> float:
    """1 when the last <answer> equals the `answer` column (the sum of the hidden numbers)."""
    parsed = parser.parse_answer(completion)
    return 1.0 if parsed is not None and parsed.strip() == answer else 0.0


def reads(state, **kwargs) -> float:
    """Tool reads counted by update_tool_args: a metric that only exists in state."""
    return float(state.get("reads", 0))


def load_environment(num_examples: int = 20, seed: int = 0, num_hidden: int = 3,
                     max_turns: int = 5, **kwargs) -> vf.Environment:
    """num_examples sets of num_hidden numbers in 1..50, from a random.Random(seed) of
    their own."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        numbers = [rng.randint(1, 50) for _ in range(num_hidden)]
        rows.append({"question": f"There are {num_hidden} hidden numbers. What is their sum?",
                     "answer": str(sum(numbers)), "info": {"numbers": numbers}})
    parser = vf.XMLParser(["answer"], answer_field="answer")
    rubric = vf.Rubric(funcs=[correct_sum, reads], weights=[1.0, 0.0], parser=parser)
    return HiddenNumbersEnv(max_turns=max_turns, dataset=Dataset.from_list(rows),
                            system_prompt=SYSTEM_PROMPT, parser=parser, rubric=rubric,
                            **kwargs)
