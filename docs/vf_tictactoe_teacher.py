"""
A scripted teacher for the course's Verifiers tic-tac-toe environment (anakin87/llm-rl-environments-lil-course,
environments/tictactoe/tictactoe.py), written against its messages alone: it reads the last board the environment
showed and answers as our scripted minimax player does (env_tictactoe's `minimax`): one move per board, in its
words (a true <think>, then <move>N</move>).

    python sft.py --model scratch --env verifiers --env_args '{"path": "tictactoe.py"}' \
        --teacher docs/vf_tictactoe_teacher.py:play_noisy --keep all ...

`play`: the minimax player's move (of the optimal moves, the one with the best chance against a random opponent: the
same move on the same board, so a student copies one consistent style). `play_noisy`: a random free cell 20% of the
time, as the speedrun's teacher. Its draws come from one seeded stream in the order the games ask for moves, never
from the conversation: a random move that is a function of what the student reads is no noise to the student, which
learns it exactly (docs/VERIFIERS.md: a student taught so lost 27.0% of its games against the optimal opponent, as
its teacher did).
"""
import random
import re

from env_tictactoe import free_cells, player_move, player_reply

ROW = re.compile(r"^(\S) \| (\S) \| (\S)$", re.M)  # the course's board rows: "X | 1 | O"
NOISE = random.Random(0)  # the random moves' draws: reproducible where the games are played in the same order


def board_of(messages):
    """The last board shown to the model, in env_tictactoe's form: 9 characters of X, O and '.' for a free cell."""
    text = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    rows = ROW.findall(text)[-3:]
    return "".join(c if c in "XO" else "." for row in rows for c in row)


def move(messages, random_move_prob):
    board = board_of(messages)
    cell = NOISE.choice(free_cells(board)) if random_move_prob and NOISE.random() < random_move_prob \
        else player_move(board)
    return player_reply(board, cell)


def play(messages):
    return move(messages, 0.0)


def play_noisy(messages):
    return move(messages, 0.2)
