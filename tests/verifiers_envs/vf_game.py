"""A multi-turn Verifiers game (test data for env_verifiers.py): guess the number.

The model guesses in <guess>N</guess>; the environment answers "Higher." or "Lower." (one
user message) until the guess is right, when it sets state["final_env_response"] ("Correct!
..."), which ends the game and is appended to the completion. Three ways an episode ends,
each a Verifiers stop condition the adapter has to reproduce:
  - has_final_env_response (Verifiers'): the env said "Correct!";
  - too_many_invalid (this file's @vf.stop): `max_invalid` unreadable or out-of-range
    guesses; it is checked BEFORE env_response, so the last bad reply gets no answer;
  - max_turns_reached (Verifiers'): `max_turns` replies; the last one is never judged by
    env_response, so a right guess on the last turn does not win.

Example i's secret is drawn in setup_state from info["seed"], between 1 and info["high"];
`num_groups` difficulty buckets cycle over consecutive examples, bucket b having the upper
bound 20 + 10 b (as env_tictactoe.py's skill buckets, which rl.py sets to the examples per
step). Rubric: win (1.0), the parser's format reward (0.2), invalid_guesses (1.0, -0.1 per
invalid guess); Verifiers adds num_turns (weight 0).
"""
import random

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = """We play a game: I think of a whole number, you guess it. Reply with your
guess only, like <guess>7</guess>. I answer "Higher." or "Lower." until you find it."""
INVALID_PENALTY = 0.1


def secret_of(info: dict) -> int:
    """The example's secret: a function of its info alone, so setup_state and a test agree."""
    return random.Random(info["seed"]).randint(1, info["high"])


def read_guess(parser, message, high: int) -> int | None:
    """The guess in one assistant message, or None when it is missing or out of 1..high."""
    text = message["content"] if isinstance(message["content"], str) else ""
    raw = parser.parse(text).guess
    if raw is None or not raw.isdigit() or not 1 <= int(raw) <= high:
        return None
    return int(raw)


def assistant_messages(messages) -> list:
    return [m for m in messages if m["role"] == "assistant"]


class GuessNumberEnv(vf.MultiTurnEnv):
    def __init__(self, max_invalid: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.max_invalid = max_invalid

    async def setup_state(self, state: vf.State) -> vf.State:
        # the secret lives in state, not in the dataset: the adapter must run setup_state
        info = state["info"]
        state["secret"] = secret_of(info)
        state["high"] = info["high"]
        state["won"] = False
        return state

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        guess = read_guess(self.parser, messages[-1], state["high"])
        if guess is None:
            text = f"Invalid guess. Reply like <guess>7</guess>, between 1 and {state['high']}."
        elif guess == state["secret"]:
            state["won"] = True
            final = [vf.UserMessage(content=f"Correct! The number was {guess}. You win.")]
            # Verifiers appends final_env_response to the completion and stops the rollout
            state["final_env_response"] = final
            return final
        else:
            text = "Higher." if guess < state["secret"] else "Lower."
        return [vf.UserMessage(content=text)]

    @vf.stop
    async def too_many_invalid(self, state: vf.State) -> bool:
        # counted from the trajectory, so it fires right after the max_invalid-th bad reply
        replies = [step["completion"][-1] for step in state["trajectory"]]
        bad = [m for m in replies if read_guess(self.parser, m, state["high"]) is None]
        return len(bad) >= self.max_invalid


def win(state, **kwargs) -> float:
    """1 when the environment said "Correct!" (state["won"], set in env_response)."""
    return 1.0 if state.get("won") else 0.0


def invalid_guesses(completion, state, parser, **kwargs) -> float:
    """-0.1 per reply without a readable guess in 1..high: a negative reward, weight 1."""
    replies = assistant_messages(completion)
    bad = sum(read_guess(parser, m, state["high"]) is None for m in replies)
    return -INVALID_PENALTY * bad


def load_environment(num_examples: int = 64, seed: int = 0, num_groups: int = 4,
                     max_turns: int = 6, max_invalid: int = 3, **kwargs) -> vf.Environment:
    """num_examples games; example i in difficulty bucket i % num_groups (upper bound
    20 + 10 * bucket); its seed from a random.Random(seed) of this function's own."""
    if not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive integer, got {num_groups!r}")
    rng = random.Random(seed)
    rows = []
    for i in range(num_examples):
        bucket = i % num_groups
        high = 20 + 10 * bucket
        rows.append({"question": f"I am thinking of a number between 1 and {high}. Guess it.",
                     "info": {"seed": rng.randrange(2**31), "high": high, "bucket": bucket}})
    parser = vf.XMLParser(["guess"], answer_field="guess")
    rubric = vf.Rubric(funcs=[win, parser.get_format_reward_func(), invalid_guesses],
                       weights=[1.0, 0.2, 1.0], parser=parser)
    return GuessNumberEnv(max_invalid=max_invalid, max_turns=max_turns,
                          dataset=Dataset.from_list(rows), system_prompt=SYSTEM_PROMPT,
                          parser=parser, rubric=rubric, **kwargs)
