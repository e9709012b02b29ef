"""env_add.py rewritten as a Verifiers v1 environment (verifiers 0.4): add two numbers, the sum
inside <answer> tags; correct (weight 1) + 0.2 x format, as env_add scores it. Trained end to end in
docs/VERIFIERS.md:

    python sft.py --model scratch --env verifiers --teacher docs/vf_v1_teacher.py:add \\
        --env_args '{"path": "docs/vf_v1_add.py", "python": ".venv-vf04/bin/python"}' ...
"""
import random
import re

import verifiers.v1 as vf

ANSWER = re.compile(r"<answer>\s*(-?\d{1,9})\s*</answer>")  # at most 9 digits: int() never fails


class AddData(vf.TaskData):
    a: int
    b: int


class AddTask(vf.Task[AddData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = ANSWER.search(trace.last_reply or "")
        return float(found is not None and int(found.group(1)) == self.data.a + self.data.b)

    @vf.reward(weight=0.2)
    async def format(self, trace: vf.Trace) -> float:
        return float(ANSWER.search(trace.last_reply or "") is not None)


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    max_value: int = 9


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        rng, top = random.Random(0), self.config.max_value
        system = "Add the two numbers. Reply with the sum inside <answer>...</answer>."
        pairs = [(rng.randint(0, top), rng.randint(0, top)) for _ in range(self.config.num_tasks)]
        return [AddTask(AddData(prompt=f"{a} + {b} = ?", system_prompt=system, a=a, b=b))
                for a, b in pairs]


__all__ = ["AddTaskset"]
