"""A multi-turn Verifiers v1 environment (verifiers 0.4): guess a number from 1 to `high`; the
Env plays the user ("higher" / "lower") through an interaction, a @vf.stop ends the episode once
the guess is right, the seat's max_turns cuts it off otherwise."""
import random
import re

import verifiers.v1 as vf

NUMBER = re.compile(r"-?\d{1,9}")  # at most 9 digits: int() never fails


def last_guess(text):
    found = NUMBER.findall(text or "")
    return int(found[-1]) if found else None


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    @vf.stop
    async def guessed(self, trace: vf.Trace) -> bool:
        return last_guess(trace.last_reply) == self.data.secret

    @vf.reward(weight=1.0)
    async def found(self, trace: vf.Trace) -> float:
        return float(last_guess(trace.last_reply) == self.data.secret)

    @vf.reward(weight=-0.1)
    async def turns_used(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 50
    high: int = 8


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        rng, high = random.Random(1), self.config.high
        return [GuessTask(GuessData(prompt=f"Guess my number from 1 to {high}.",
                                    system_prompt="Reply with one number.",
                                    secret=rng.randint(1, high)))
                for _ in range(self.config.num_tasks)]


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(max_turns=5)


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            while not segment.terminated:
                guess = last_guess(segment.last_reply)
                hint = ("Not a number." if guess is None else
                        "Higher." if guess < task.data.secret else "Lower.")
                segment = await chat.turn(hint)


__all__ = ["GuessTaskset", "GuessEnv"]
