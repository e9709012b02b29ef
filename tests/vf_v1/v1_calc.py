"""A Verifiers v1 environment with a tool (verifiers 0.4): compute an arithmetic expression with
the `calculator` Toolset's `evaluate` tool, then answer inside <answer>...</answer>. The Toolset
keeps a count of its calls in the episode's shared State (the channel Verifiers syncs around
every tool call), which a reward and a metric read back from the trace. The Toolset is a Task's
(one server per episode), or with args {"task": {"shared": true}} the Taskset's (one per run)."""
import ast
import operator
import random
import re

import verifiers.v1 as vf

ANSWER = re.compile(r"<answer>\s*(-?\d{1,12})\s*</answer>")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate_expression(text):
    """The value of +, -, * over integers of at most 6 digits, or ValueError."""
    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**6:
            return node.value
        raise ValueError("only integers of at most 6 digits, +, - and * are allowed")
    if len(text) > 200:
        raise ValueError("expression too long")
    return value(ast.parse(text, mode="eval").body)


class CalcState(vf.State):
    calls: int = 0


class Calculator(vf.Toolset[vf.ToolsetConfig, CalcState]):
    @vf.tool
    async def evaluate(self, expression: str) -> str:
        """Evaluate an arithmetic expression of integers with +, - and *."""
        self.state.calls += 1
        return str(evaluate_expression(expression))


class CalcData(vf.TaskData):
    answer: int


class CalcTaskConfig(vf.TaskConfig):
    shared: bool = False


class CalcTask(vf.Task[CalcData, CalcState, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [] if config.shared else [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = ANSWER.findall(trace.last_reply or "")
        return float(bool(found) and int(found[-1]) == self.data.answer)

    @vf.reward(weight=-0.05)
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(trace.state.calls)

    @vf.metric
    async def calls(self, trace: vf.Trace) -> float:
        return float(trace.state.calls)


class CalcConfig(vf.TasksetConfig):
    num_tasks: int = 50
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())] if config.task.shared else []

    def load(self):
        rng = random.Random(2)
        tasks = []
        for _ in range(self.config.num_tasks):
            a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(100, 999)
            tasks.append(CalcTask(CalcData(
                prompt=f"Compute {a} * {b} - {c}.", answer=a * b - c,
                system_prompt="Use the calculator tool, then reply <answer>N</answer>."),
                self.config.task))
        return tasks


__all__ = ["CalcTaskset"]


if __name__ == "__main__":  # how Verifiers serves the Toolset: `python -m v1_calc`, a process
    Calculator.run()
