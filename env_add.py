"""
Add two numbers: the smallest useful environment, one reply per episode (README, "Your first
environment", walks through it).

    python eval.py --env add --model oracle -n 20
    python sft.py --model scratch --env add --max_steps 400 --eval_every 0 --out out/add_sft
    python rl.py --model out/add_sft --env add --batch 64 --group 8 --steps 40 --lr 5e-5 \\
        --max_new_tokens 12 --eval_every 20 --eval_n 500 --out out/add_rl
"""
import random
import re

ANSWER = re.compile(r"<answer>\s*(-?\d{1,9})\s*</answer>")  # at most 9 digits: int() never fails


class Add:
    system_prompt = "Add the two numbers. Reply with the sum inside <answer>...</answer>."
    max_turns = 1  # one reply, then the episode is over
    reward_weights = {"correct": 1.0, "format": 0.2}  # the reward: correct + 0.2 x format
    scripted_players = ("oracle",)  # `--model oracle`; sft.py's default teacher is the first

    def __init__(self, max_value=9):
        self.max_value = max_value

    def examples(self, n, seed=0):
        rng = random.Random(seed)  # the same seed, the same examples: every run can be replayed
        return [{"seed": rng.randrange(2**31), "a": rng.randint(0, self.max_value),
                 "b": rng.randint(0, self.max_value)} for _ in range(n)]

    def reset(self, example):
        state = {"a": example["a"], "b": example["b"], "answer": None, "well_formed": False}
        return state, f"{example['a']} + {example['b']} = ?"

    def step(self, state, reply):  # `reply` is untrusted text: never raise on it
        match = ANSWER.search(reply)
        state["well_formed"], state["answer"] = match is not None, match and int(match.group(1))
        return None  # no next message: the episode is over

    def rewards(self, state):
        return {"correct": float(state["answer"] == state["a"] + state["b"]),
                "format": float(state["well_formed"])}

    def scripted_player(self, name):
        if name != "oracle":
            raise ValueError(f"unknown scripted player {name!r}: use 'oracle'")
        return lambda state: f"<answer>{state['a'] + state['b']}</answer>"


def load_environment(max_value=9):
    return Add(max_value)
