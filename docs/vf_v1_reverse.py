"""A single-turn Verifiers v1 environment (verifiers 0.4): reverse a word inside <answer> tags.
Two weighted rewards and a metric, as a user writes them with the library's v1 API."""
import difflib
import random
import re

import verifiers.v1 as vf

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


class ReverseData(vf.TaskData):
    word: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def similarity(self, trace: vf.Trace) -> float:
        m = ANSWER.search(trace.last_reply or "")
        answer = m.group(1).strip() if m else ""
        return difflib.SequenceMatcher(None, answer, self.data.word[::-1]).ratio()

    @vf.reward(weight=0.2)
    async def formatted(self, trace: vf.Trace) -> float:
        return float(bool(re.fullmatch(r"\s*<answer>[^<]*</answer>\s*", trace.last_reply or "")))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 2000
    min_len: int = 3
    max_len: int = 6


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        rng, c = random.Random(0), self.config
        words = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(c.min_len, c.max_len)))
                 for _ in range(c.num_tasks)]
        return [ReverseTask(ReverseData(prompt=f"Reverse: {w}", word=w,
                                        system_prompt="Reply with <answer>the reversed text</answer>."))
                for w in words]


__all__ = ["ReverseTaskset"]
