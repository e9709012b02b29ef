"""
Double-check (two turns): answer a question, get asked "Are you sure?", give the final answer.

    python eval.py --env doublecheck --model oracle -n 2 --show 2  # scripted: always right
    python eval.py --env doublecheck --model hasty -n 200           # wrong 30% at first, then fixed
    python eval.py --env doublecheck --model out/dc/rl -n 200 --temp 0
    python eval.py --env doublecheck --env_args '{"max_value": 999}' --model out/dc/rl -n 200

A question is integer arithmetic drawn from the example's seed ("What is 47 + 85?", "What is
63 - 28?", "What is 7 * 46?"; operands 2..max_value, one single-digit for *), with its exact answer.
After the first reply the environment always asks for a double-check, in the same words whether
that answer was right or wrong; the second reply is the final answer, and only it is scored.

A reply is well-formed when it is an optional <think>...</think> then exactly one <answer>N</answer>
(N an integer), and nothing else but whitespace. The answer of a malformed reply is still read when
it holds exactly one <answer> tag with an integer in it.

Rewards: `correct` (weight 1: the final answer is right), `format` (0.1: the share of the two
replies well-formed). Metrics: `first_correct`, `correct` (final), `kept` (right, then right),
`fixed` (wrong, then right), `broken` (right, then wrong), `format`. Scripted players: `oracle`
(right twice), `hasty` (wrong the first time with probability 0.3, right at the double-check: a
teacher for "fix it when asked"). Pure Python: no torch.
"""
import random
import re

SYSTEM_PROMPT = (  # the answer format, and the double-check to come
    "Answer the arithmetic question with the exact integer. You may think first inside "
    "<think>...</think>,\n"
    "then give the answer inside <answer>...</answer> and nothing after it, for example:\n"
    "<think>47 + 85 = 132.</think>\n"
    "<answer>132</answer>\n"
    "You will then be asked to double-check: check your work and give your final answer the "
    "same way. Only the final\nanswer counts.")
DOUBLE_CHECK = ("Are you sure? Check your answer, then give your final answer inside "
                "<answer>...</answer>.")  # the second message: the same words, right or wrong
MAX_VALUE = 10**9  # the largest max_value: answers stay well inside a tag's 30 digits

ANSWER = re.compile(r"<answer>\s*(-?[0-9]{1,30})\s*</answer>")  # the integer of one answer tag
# an optional think (no tags inside it), then exactly one integer answer, whitespace around
WELL_FORMED = re.compile(r"\s*(?:<think>(?:(?!</?think>|</?answer>).)*</think>\s*)?"
                         r"<answer>-?[0-9]{1,30}</answer>\s*", re.DOTALL)


def as_text(reply):
    """The reply as a string: str() of a non-string, "" where even that raises (str(10**5000))."""
    try:
        return reply if isinstance(reply, str) else str(reply)
    except Exception:
        return ""


def parse_answer(reply):
    """The integer in the reply's only <answer> tag, or None (no tag, several, not an integer)."""
    if reply.count("<answer>") != 1:  # counted first: the regex then tries one place (linear)
        return None
    match = ANSWER.search(reply)
    return int(match.group(1)) if match else None


def make_example(seed, max_value):
    """The row of `seed`: a question drawn from that seed alone (+, - or * on operands 2..max_value,
    one of them single-digit for *), and its exact integer answer."""
    rng = random.Random(seed)
    op = rng.choice("+-*")
    a, b = rng.randint(2, max_value), rng.randint(2, min(9, max_value) if op == "*" else max_value)
    if op == "*" and rng.random() < 0.5:
        a, b = b, a
    return {"seed": seed, "question": f"What is {a} {op} {b}?",
            "answer": {"+": a + b, "-": a - b, "*": a * b}[op]}


class DoubleCheck:
    system_prompt = SYSTEM_PROMPT
    reward_weights = {"correct": 1.0, "format": 0.1}
    max_turns = 2

    def __init__(self, max_value=99):
        if not (isinstance(max_value, int) and not isinstance(max_value, bool)
                and 2 <= max_value <= MAX_VALUE):
            raise ValueError(f"max_value={max_value!r}: must be an integer from 2 to {MAX_VALUE}")
        self.max_value = max_value

    def examples(self, n, seed=0):
        """Rows {"seed", "question", "answer"}, deterministic given `seed`."""
        rng = random.Random(seed)
        return [make_example(rng.randrange(2**31), self.max_value) for _ in range(n)]

    def reset(self, example):
        state = {"question": example["question"], "target": example["answer"],
                 "seed": example["seed"], "first": None, "final": None, "turns": 0,
                 "well_formed": 0, "done": False}
        return state, example["question"]

    def step(self, state, reply):
        """First reply: the double-check request; second: None, the episode is over (then no-op)."""
        if state["done"]:
            return None
        reply = as_text(reply)
        state["turns"] += 1
        state["well_formed"] += WELL_FORMED.fullmatch(reply) is not None
        if state["turns"] == 1:
            state["first"] = parse_answer(reply)
            return DOUBLE_CHECK
        state["final"], state["done"] = parse_answer(reply), True
        return None

    def rewards(self, state):
        return {"correct": float(state["final"] == state["target"]),
                "format": state["well_formed"] / self.max_turns}

    def metrics(self, state):
        first, final = state["first"] == state["target"], state["final"] == state["target"]
        return {"first_correct": float(first), "correct": float(final),
                "kept": float(first and final), "fixed": float(not first and final),
                "broken": float(first and not final),
                "format": state["well_formed"] / self.max_turns}

    scripted_players = ("oracle", "hasty")

    def scripted_player(self, name):
        """oracle: right twice, with a one-line think. hasty: first, with probability 0.3, an answer
        off by 1 or 2 (from the example's seed: reproducible), then right at the double-check."""
        def solved(state, lead=""):
            expression = state["question"].removeprefix("What is ").removesuffix("?")
            return (f"<think>{lead}{expression} = {state['target']}.</think>"
                    f"<answer>{state['target']}</answer>")
        if name == "oracle":
            return solved
        if name == "hasty":
            def hasty(state):
                if state["turns"] > 0:
                    return solved(state, "Checking: ")
                rng = random.Random(state["seed"])
                off = rng.choice((-2, -1, 1, 2)) if rng.random() < 0.3 else 0
                return f"<answer>{state['target'] + off}</answer>"
            return hasty
        raise ValueError(f"unknown scripted player {name!r} for doublecheck: "
                         "use 'oracle' or 'hasty'")

    def describe(self, state):
        return (f"{state['question']} {state['target']}\n"
                f"first answer: {state['first']}, final answer: {state['final']}")


def load_environment(max_value=99):
    """max_value: the largest operand (2 to 10**9; default 99, two-digit questions)."""
    return DoubleCheck(max_value)
