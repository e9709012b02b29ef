"""A multi-step OpenEnv environment: guess a number from 1 to 8 in 4 guesses (an int Action, played
by tool calls). Its variant ignores the seed and draws from the global `random` at every step."""
import random
from typing import Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

GUESSES = 4


class GuessAction(Action):
    """Guess the number."""
    guess: int


class HintObservation(Observation):
    hint: str
    guesses_left: int


class GuessEnvironment(Environment[GuessAction, HintObservation, State]):
    """Guess a number from 1 to 8: -0.1 a wrong guess, 1 the right one."""

    def __init__(self):
        super().__init__()
        self.secret, self.left, self._state = None, GUESSES, State()

    def reset(self, seed: Optional[int] = None, episode_id=None, **kwargs) -> HintObservation:
        self.secret, self.left, self._state = random.Random(seed).randint(1, 8), GUESSES, State()
        return HintObservation(hint="Guess a number from 1 to 8.", guesses_left=self.left)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> HintObservation:
        self.left -= 1
        self._state.step_count += 1
        if action.guess == self.secret:
            return HintObservation(hint="Right.", guesses_left=self.left, done=True, reward=1.0)
        hint = "Higher." if action.guess < self.secret else "Lower."
        return HintObservation(hint=hint, guesses_left=self.left, done=self.left == 0, reward=-0.1)

    @property
    def state(self) -> State:
        return self._state



class MovingGuess(GuessEnvironment):
    """Ignores the seed: the number comes from the global `random`, and moves after each wrong guess
    (a draw at every step, as an opponent's move would be)."""

    def reset(self, seed=None, episode_id=None, **kwargs) -> HintObservation:
        observation = super().reset(seed, episode_id, **kwargs)
        self.secret = random.randint(1, 8)
        return observation

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> HintObservation:
        observation = super().step(action, timeout_s, **kwargs)
        self.secret = random.randint(1, 8)
        return observation
