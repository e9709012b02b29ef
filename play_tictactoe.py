"""
Play tic-tac-toe against a model in the terminal: the model is X, you are O.

    python play_tictactoe.py --model out/speedrun/rl_best --env_args '{"show_cells": true}'
    python play_tictactoe.py --model DIR --env tictactoe_lab --env_args '{"show_wins": true}'

--env and --env_args as for the model's training: tictactoe (env_tictactoe.py), or tictactoe_lab
(its research options, env_tictactoe_lab.py); the other flags choose the model (policies.py),
greedy unless --temp says otherwise.
"""
import argparse
import importlib
import random

from common import load_env, parse_env_args
from env_tictactoe import free_cells, load_environment
from policies import add_policy_args, policy_from_args
from sample import advance, new_episode


def play_human(policy, env_args, games=None, load=load_environment):
    """Games in the terminal: the policy is X, you are O (input() asks your cells); `games` of them,
    or until you say no. `load`: the game's load_environment, or a variant's built on it."""

    def ask(state):
        free = free_cells(state["board"])
        while True:
            text = input(f"your move (O), one of {free}: ").strip()
            if text.isdigit() and int(text) in free:
                return int(text)
            print("not a free cell, try again")
    env = load(**env_args, opponent=ask)
    played = 0
    while games is None or played < games:
        ep = new_episode(env, env.examples(1, seed=random.randrange(2**31))[0])
        print("\n" + ep["messages"][1]["content"])
        while True:
            reply = policy([ep])[0]
            print(f"[model] {reply}")
            if advance(env, ep, reply):
                break
            print(ep["messages"][-1]["content"])
        print(env.describe(ep["state"]))
        played += 1
        if games is None and input("again? [Y/n] ").strip().lower().startswith("n"):
            return


def main():
    p = add_policy_args(argparse.ArgumentParser(
        description="Play tic-tac-toe against a model in the terminal: the model is X, you are O "
                    "(--env and --env_args as for the model's training: tictactoe, or "
                    "tictactoe_lab)."))
    p.set_defaults(temp=0.0)
    args = p.parse_args()
    # the model's environment: the game, or a variant built on it (--env tictactoe_lab: show_wins
    # and the like); a bad option stops here, in one line
    env_args = parse_env_args(args.env_args)
    env = load_env(args.env, env_args)
    try:
        play_human(policy_from_args(args, env), env_args,
                   load=importlib.import_module(f"env_{args.env}").load_environment)
    except (EOFError, KeyboardInterrupt):
        print("\nbye")


if __name__ == "__main__":
    main()
