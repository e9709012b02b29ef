"""A single-step OpenEnv environment with a TaskProvider: answer a sum (a text Action). Its
variants have no tasks and ignore the seed: one draws its sum from the global `random` (which
env_openenv seeds), one from the system's entropy, which no seed reaches (refused)."""
import random
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

SPLITS = {"train": [(a, b) for a in range(1, 6) for b in range(1, 6)], "test": [(7, 8), (9, 9)]}


class AnswerAction(Action):
    answer: str


class QuestionObservation(Observation):
    question: str


class SumEnvironment(Environment[AnswerAction, QuestionObservation, State]):
    """Answer a sum: reward 1 for the exact number, else 0."""

    def __init__(self, prefix: str = "What is"):
        super().__init__()
        self.prefix, self.pair, self._state = prefix, None, State()

    def list_splits(self):
        return list(SPLITS)

    def num_tasks(self, split):
        return len(SPLITS[split])

    async def get_task(self, split, index):  # a provider's methods may be async
        return {"id": f"{split}-{index}", "pair": SPLITS[split][index]}

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              split: str = "train", index: int = 0, **kwargs: Any) -> QuestionObservation:
        self.pair, self._state = self.pick(split, index), State(episode_id=episode_id)
        return QuestionObservation(question=f"{self.prefix} {self.pair[0]} + {self.pair[1]}?")

    def pick(self, split, index):
        return SPLITS[split][index]

    def step(self, action: AnswerAction, timeout_s=None, **kwargs) -> QuestionObservation:
        self._state.step_count += 1
        right = action.answer.strip() == str(sum(self.pair))
        return QuestionObservation(question="", done=True, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state


class GlobalRandomSum(SumEnvironment):
    list_splits = num_tasks = get_task = None  # no TaskProvider: its examples differ by seed only

    def pick(self, split, index):
        return random.randint(1, 50), random.randint(1, 50)


class UnseededSum(GlobalRandomSum):
    def pick(self, split, index):
        return random.SystemRandom().randint(1, 50), random.SystemRandom().randint(1, 50)
