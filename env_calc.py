"""
Arithmetic with a calculator tool: a tool-calling environment in one file.

    python eval.py --env calc --model oracle -n 2 --show 2        # scripted player, with the tool
    python eval.py --env calc --model guess -n 200                 # no-tool baseline: at a glance
    python eval.py --env calc --model out/calc/rl -n 200 --temp 0  # a trained model, with the tool
    python eval.py --env calc --env_args '{"tools": false}' --model out/calc/rl -n 200 --temp 0

(the last: the same model without the tool). A task is an integer expression that a small model
cannot work out in its head ("What is 4821 * 37 - 906?"), drawn from the example's seed, with its
exact answer. The system prompt describes the tool (a Python function with a JSON-schema
description, `TOOLS`); the model calls it inside a reply, in the Hermes/Qwen3 format

    <tool_call>{"name": "calculator", "arguments": {"expression": "4821 * 37 - 906"}}</tool_call>

and the environment answers with the result as the next message, in the tool role (a dict
{"role": "tool", "content": ...}: the contract's one extension, see the README). A bad call gets an
error message instead: a wasted turn, never a crash. The episode ends with a reply holding
<answer>N</answer>, or after `max_turns` replies.

The calculator never evaluates model text as code: the expression is parsed with `ast` and only
numbers, + - * /, unary signs and parentheses are evaluated, exactly (fractions), with bounds on its
length, its size and every number's size.

Rewards: `correct` (weight 1), `format` (0.1: share of well-formed replies), `tool_calls` (-0.05
each: call once, then answer). Metrics: accuracy (`correct`), `used_tool`, `n_tool_calls`, `format`.
"""
import ast
import json
import random
import re
from fractions import Fraction

# the tool's JSON-schema description: shown to the model in TOOL_PROMPT
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression exactly: integers and decimals, + - * / and "
                   "parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {
                       "type": "string", "description": "e.g. 12 * (3 + 4)"}},
                   "required": ["expression"]}}}]

# the system prompt; TOOL_PROMPT is appended when the calculator is offered
SYSTEM_PROMPT = ("Answer the arithmetic question with the exact integer inside "
                 "<answer>...</answer>, for example:\n<answer>42</answer>")
TOOL_PROMPT = """
You can use a calculator. Call it alone in a reply, like this:
<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>
Its result comes back as the next message. Tools: """ + json.dumps(TOOLS)

# the calculator's bounds (expression length, AST size, |number|): no reply can make it slow or huge
MAX_CHARS, MAX_NODES, MAX_NUMBER = 200, 64, 10**15
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)  # a call's JSON, Hermes/Qwen3 format
ANSWER = re.compile(r"<answer>\s*(-?\d{1,30})\s*</answer>")  # the final answer: an integer
# a well-formed reply: an optional think, then exactly one tool call or one answer
WELL_FORMED = re.compile(r"\s*(<think>[^<]*</think>\s*)?"
                         r"(<tool_call>[^<]*</tool_call>|<answer>-?\d{1,30}</answer>)\s*")


class CalcError(ValueError):
    pass


def calculate(expression):
    """The exact value (a Fraction) of an arithmetic expression, or CalcError saying what is wrong.
    Never runs the text: only numbers, + - * /, signs and parentheses of its parse are evaluated."""
    if not isinstance(expression, str):
        raise CalcError("the expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise CalcError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"the expression has more than {MAX_NODES} parts")

    def bounded(x):
        if abs(x.numerator) > MAX_NUMBER ** 2 or x.denominator > MAX_NUMBER:
            raise CalcError("a number is too large")
        return x

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            if node.value != node.value or abs(node.value) > MAX_NUMBER:  # NaN, inf, or too large
                raise CalcError("a number is too large")
            return (Fraction(str(node.value)) if isinstance(node.value, float)
                    else Fraction(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            return value(node.operand) if isinstance(node.op, ast.UAdd) else -value(node.operand)
        if (isinstance(node, ast.BinOp)
                and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div))):
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and b == 0:
                raise CalcError("division by zero")
            return bounded({ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(node.op)]
                           if not isinstance(node.op, ast.Div) else a / b)
        raise CalcError("only numbers, + - * / and parentheses are allowed")
    return value(tree.body)


def show_number(x):
    """A Fraction as the calculator prints it: an integer, else a decimal with up to 6 places."""
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.6f}".rstrip("0")


def run_tool_call(text):
    """The tool's reply to the text inside a <tool_call>: its result, or an error message."""
    try:
        call = json.loads(text) if len(text) <= 2 * MAX_CHARS else None
    except (ValueError, RecursionError):
        call = None
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict):
        return ('error: the tool call must be JSON like '
                '{"name": "calculator", "arguments": {"expression": "1 + 2"}}')
    if call.get("name") != "calculator":
        return f"error: unknown tool {str(call.get('name'))[:40]!r}; the only tool is calculator"
    try:
        return show_number(calculate(call["arguments"].get("expression")))
    except CalcError as e:
        return f"error: {e}"


def make_task(rng):
    """(expression, exact answer): products of 2-4 digit numbers, some with a sum or difference."""
    a, b, c = rng.randint(100, 9999), rng.randint(12, 99), rng.randint(100, 9999)
    expression = rng.choice([f"{a} * {b}", f"{a} * {b} + {c}", f"{a} * {b} - {c}",
                             f"({a} + {c}) * {b}"])
    return expression, int(calculate(expression))


class Calc:
    reward_weights = {"correct": 1.0, "format": 0.1, "tool_calls": -0.05}

    def __init__(self, tools=True, max_turns=4):
        if not isinstance(tools, bool):
            raise ValueError(f"tools={tools!r}: must be true or false")
        if not (isinstance(max_turns, int) and not isinstance(max_turns, bool) and max_turns >= 1):
            raise ValueError(f"max_turns={max_turns!r}: must be a positive integer")
        self.calculator, self.max_turns = tools, max_turns  # not `tools`: that names schemas
        self.system_prompt = SYSTEM_PROMPT + (TOOL_PROMPT if tools else "")

    def examples(self, n, seed=0):
        rng = random.Random(seed)
        rows = []
        for _ in range(n):
            expression, answer = make_task(rng)
            rows.append({"seed": rng.randrange(2**31), "expression": expression, "answer": answer})
        return rows

    def reset(self, example):
        state = {"expression": example["expression"], "target": example["answer"], "answer": None,
                 "turns": 0, "well_formed": 0, "tool_calls": 0, "last_result": None, "done": False}
        return state, f"What is {example['expression']}?"

    def step(self, state, reply):
        reply = reply if isinstance(reply, str) else str(reply)
        state["turns"] += 1
        state["well_formed"] += WELL_FORMED.fullmatch(reply) is not None
        calls, answers = TOOL_CALL.findall(reply), ANSWER.findall(reply)
        if answers and not calls:
            state["answer"], state["done"] = int(answers[-1]), True
            return None
        if state["turns"] >= self.max_turns:
            state["done"] = True
            return None
        if not calls:
            return ("Give the exact answer inside <answer>...</answer>"
                    + (" or call the calculator." if self.calculator else "."))
        if not self.calculator:
            return "No tools are available here: give the answer inside <answer>...</answer>."
        state["tool_calls"] += 1
        state["last_result"] = run_tool_call(calls[0].strip())
        return {"role": "tool", "content": state["last_result"]}

    def rewards(self, state):
        return {"correct": float(state["answer"] == state["target"]),
                "format": state["well_formed"] / max(state["turns"], 1),
                "tool_calls": float(state["tool_calls"])}

    def metrics(self, state):
        return {"correct": float(state["answer"] == state["target"]),
                "used_tool": float(state["tool_calls"] > 0), "n_tool_calls": state["tool_calls"],
                "format": state["well_formed"] / max(state["turns"], 1),
                "cut_off": float(state["answer"] is None)}  # no answer within max_turns

    scripted_players = ("oracle", "guess")

    def scripted_player(self, name):
        """oracle: calls the calculator on the expression, then answers its result (an SFT teacher).
        guess: answers at once from each number's leading digits (the no-tool baseline)."""
        if name == "oracle":
            def oracle(state):
                if state["last_result"] is None and self.calculator:
                    call = {"name": "calculator", "arguments": {"expression": state["expression"]}}
                    return f"<tool_call>{json.dumps(call)}</tool_call>"
                result = state["last_result"]
                return f"<answer>{result if result is not None else state['target']}</answer>"
            return oracle
        if name == "guess":
            def rounded(m):
                digits = m.group(0)
                return digits[:2] + "0" * (len(digits) - 2)
            return lambda state: (
                f"<answer>{int(calculate(re.sub(r'[0-9]+', rounded, state['expression'])))}"
                "</answer>")
        raise ValueError(f"unknown scripted player {name!r} for calc: use 'oracle' or 'guess'")

    def describe(self, state):
        return (f"{state['expression']} = {state['target']}\n"
                f"answer: {state['answer']}, tool calls: {state['tool_calls']}")


def load_environment(tools=True, max_turns=4):
    """tools: offer the calculator (false: the same questions, no tool); max_turns: most replies."""
    return Calc(tools, max_turns)
