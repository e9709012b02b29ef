"""An endless Verifiers v1 Taskset (verifiers 0.4), as procedural tasksets are written:
`INFINITE = True` and a `load()` generator that never ends, each task drawn from the global
`random` (unseeded: the adapter seeds it). Task: add two numbers, answer inside <answer>."""
import random
import re

import verifiers.v1 as vf

ANSWER = re.compile(r"<answer>\s*(-?\d{1,9})\s*</answer>")


class SumData(vf.TaskData):
    total: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = ANSWER.search(trace.last_reply or "")
        return float(found is not None and int(found.group(1)) == self.data.total)


class SumConfig(vf.TasksetConfig):
    high: int = 99


def draw(rng, high):
    """A task's two numbers: the test replays them from the same seed."""
    return rng.randint(0, high), rng.randint(0, high)


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    INFINITE = True

    def load(self):
        while True:
            a, b = draw(random, self.config.high)
            yield SumTask(SumData(prompt=f"What is {a} + {b}?", system_prompt="Answer in <answer>.",
                                  total=a + b), self.config.task)


__all__ = ["SumTaskset"]
