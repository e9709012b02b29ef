"""Tests for env_tictactoe: the solver, the seeded opponent, the scripted players, rewards and untrusted replies.

CPU only, deterministic (fixed seeds everywhere, hypothesis derandomized), a few seconds in all.
"""
import copy
import json
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import env_tictactoe as ttt  # noqa: E402

EMPTY = "." * 9
CORNERS = {0, 2, 6, 8}

# ----------------------------------------------------------------------------- an independent game + solver
# Written from scratch here (lines generated, bottom-up dynamic programming over positions), sharing nothing
# with the module but the board encoding ('.', 'X', 'O', row by row).

MY_LINES = ([[3 * r + c for c in range(3)] for r in range(3)] + [[3 * r + c for r in range(3)] for c in range(3)]
            + [[0, 4, 8], [2, 4, 6]])


def my_winner(board):
    for line in MY_LINES:
        marks = {board[i] for i in line}
        if len(marks) == 1 and "." not in marks:
            return marks.pop()
    return "draw" if board.count(".") == 0 else None


def to_move(board, first):
    """The player to move on `board` in a game that `first` started."""
    second = "O" if first == "X" else "X"
    return first if board.count(first) == board.count(second) else second


def enumerate_positions(first):
    """Every position reachable from the empty board with `first` moving first, play stopping at a terminal."""
    seen, frontier = {EMPTY}, [EMPTY]
    while frontier:
        nxt = []
        for board in frontier:
            if my_winner(board) is not None:
                continue
            p = to_move(board, first)
            for i, c in enumerate(board):
                if c == ".":
                    child = board[:i] + p + board[i + 1:]
                    if child not in seen:
                        seen.add(child)
                        nxt.append(child)
        frontier = nxt
    return seen


def solve(positions, first):
    """{board: value for the player to move} by backward induction (most pieces first)."""
    val = {}
    for board in sorted(positions, key=lambda b: -sum(c != "." for c in b)):
        w = my_winner(board)
        p = to_move(board, first)
        if w == "draw":
            val[board] = 0
        elif w is not None:
            val[board] = 1 if w == p else -1
        else:
            val[board] = max(-val[board[:i] + p + board[i + 1:]] for i, c in enumerate(board) if c == ".")
    return val


def my_best_moves(board, first, val):
    p = to_move(board, first)
    scores = {i: -val[board[:i] + p + board[i + 1:]] for i, c in enumerate(board) if c == "."}
    top = max(scores.values())
    return sorted(i for i, s in scores.items() if s == top)


POS_X = enumerate_positions("X")
POS_O = enumerate_positions("O")
VAL_X = solve(POS_X, "X")
VAL_O = solve(POS_O, "O")


# ----------------------------------------------------------------------------- 1. exhaustive solver checks

def test_reachable_position_counts():
    assert len(POS_X) == 5478
    terminal = [b for b in POS_X if my_winner(b) is not None]
    assert len(terminal) == 958
    outcome = Counter(my_winner(b) for b in terminal)
    assert outcome == {"X": 626, "O": 316, "draw": 16}
    # the module's winner() agrees with the independent one everywhere
    assert all(ttt.winner(b) == my_winner(b) for b in POS_X | POS_O)


def test_number_of_games():
    games = {}
    for board in sorted(POS_X, key=lambda b: -sum(c != "." for c in b)):
        if my_winner(board) is not None:
            games[board] = 1
        else:
            p = to_move(board, "X")
            games[board] = sum(games[board[:i] + p + board[i + 1:]] for i, c in enumerate(board) if c == ".")
    assert games[EMPTY] == 255168


def test_solver_known_facts():
    assert ttt.value(EMPTY, "X") == 0 == VAL_X[EMPTY]
    assert sorted(ttt.best_moves(EMPTY, "X")) == list(range(9))
    centre = ttt.play(EMPTY, 4, "X")
    assert sorted(ttt.best_moves(centre, "O")) == [0, 2, 6, 8]
    for corner in (0, 2, 6, 8):
        assert ttt.best_moves(ttt.play(EMPTY, corner, "X"), "O") == [4]
    # an edge opening: O's non-losing replies (known: centre, the two adjacent corners, the opposite edge)
    assert sorted(ttt.best_moves(ttt.play(EMPTY, 1, "X"), "O")) == [0, 2, 4, 7]
    assert ttt.best_moves("XXX" + "OO." + "...", "O") == []  # terminal: no move


@pytest.mark.parametrize("first", ["X", "O"])
def test_best_moves_match_independent_solver_everywhere(first):
    positions, val = (POS_X, VAL_X) if first == "X" else (POS_O, VAL_O)
    checked = 0
    for board in positions:
        p = to_move(board, first)
        if my_winner(board) is not None:
            assert ttt.best_moves(board, p) == []
            continue
        assert ttt.value(board, p) == val[board], board
        assert sorted(ttt.best_moves(board, p)) == my_best_moves(board, first, val), (board, p)
        checked += 1
    assert checked == 5478 - 958


# ----------------------------------------------------------------------------- 2. the minimax player never loses

class _Branch(Exception):
    def __init__(self, cells):
        self.cells = cells


def play_line(player, seed, model_first, script):
    """Play one game whose opponent replies follow `script`; raise _Branch when the script runs out."""
    moves = iter(script)

    def opponent(state):
        try:
            return next(moves)
        except StopIteration:
            raise _Branch(ttt.free_cells(state["board"])) from None

    env = ttt.load_environment(opponent=opponent)
    state, msg = env.reset({"seed": seed, "random_move_prob": 0.0, "model_first": model_first})
    while msg is not None:
        msg = env.step(state, player(state))
    return state


def all_lines(player, seed, model_first):
    """Final states of every game the player can face, branching over every opponent reply."""
    finals, stack = [], [[]]
    while stack:
        script = stack.pop()
        try:
            finals.append(play_line(player, seed, model_first, script))
        except _Branch as b:
            stack.extend(script + [c] for c in b.cells)
    return finals


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_minimax_player_never_loses_any_line(seed):
    env = ttt.load_environment()
    player = env.scripted_player("minimax")
    total = Counter()
    for model_first in (True, False):
        finals = all_lines(player, seed, model_first)
        results = Counter(s["winner"] for s in finals)
        assert results["O"] == 0, f"minimax player lost {results['O']} lines (model_first={model_first})"
        assert all(s["done"] and not s["cut_off"] and s["invalid_moves"] == 0 for s in finals)
        assert all(s["well_formed"] == s["turns"] for s in finals)
        assert set(results) <= {"X", "draw"}
        total.update(results)
    # the opponent's every line was explored: moving second there are 9 openings alone, and many games
    assert sum(total.values()) > 100
    assert total["X"] > 0 and total["draw"] > 0


def test_exhaustive_line_search_catches_a_losing_player():
    """The harness above can fail: the random player loses some line."""
    env = ttt.load_environment()
    finals = all_lines(env.scripted_player("random"), 0, True)
    assert any(s["winner"] == "O" for s in finals)


# ----------------------------------------------------------------------------- 3. the opponent's tie-breaking

def chi_square(counts, cells):
    n = sum(counts[c] for c in cells)
    e = n / len(cells)
    return sum((counts[c] - e) ** 2 / e for c in cells)


# 0.1% critical values of chi-square: a fair opponent passes these fixed seeds; a biased one would not.
CHI2_999 = {3: 16.27, 7: 24.32, 8: 26.12}


def opponent_reply_after_centre(env, seed, p):
    state, _ = env.reset({"seed": seed, "random_move_prob": p, "model_first": True})
    env.step(state, "<move>4</move>")
    return next(i for i, c in enumerate(state["board"]) if c == "O")


def test_opponent_tie_breaking_is_uniform_among_optimal_replies():
    env = ttt.load_environment()
    seeds = [ex["seed"] for ex in env.examples(4000, seed=2024)]
    counts = Counter(opponent_reply_after_centre(env, s, 0.0) for s in seeds)
    assert set(counts) == CORNERS  # only optimal replies at random_move_prob 0
    for c in CORNERS:
        assert abs(counts[c] / 4000 - 0.25) < 0.03, counts
    assert chi_square(counts, sorted(CORNERS)) < CHI2_999[3], counts


def test_opponent_opening_is_uniform_over_all_cells():
    env = ttt.load_environment()
    counts = Counter()
    for ex in env.examples(4500, seed=7):
        state, msg = env.reset({"seed": ex["seed"], "random_move_prob": 0.0, "model_first": False})
        (cell,) = [i for i, c in enumerate(state["board"]) if c == "O"]
        assert state["board"].count(".") == 8 and f"took cell {cell}" in msg
        counts[cell] += 1
    assert set(counts) == set(range(9))
    for c in range(9):
        assert abs(counts[c] / 4500 - 1 / 9) < 0.025, counts
    assert chi_square(counts, range(9)) < CHI2_999[8], counts


def test_random_opponent_is_uniform_over_free_cells():
    env = ttt.load_environment()
    seeds = [ex["seed"] for ex in env.examples(4000, seed=99)]
    counts = Counter(opponent_reply_after_centre(env, s, 1.0) for s in seeds)
    free = [0, 1, 2, 3, 5, 6, 7, 8]
    assert set(counts) == set(free)
    for c in free:
        assert abs(counts[c] / 4000 - 1 / 8) < 0.025, counts
    assert chi_square(counts, free) < CHI2_999[7], counts


def test_partly_random_opponent_mixes_in_suboptimal_moves():
    env = ttt.load_environment()
    seeds = [ex["seed"] for ex in env.examples(2000, seed=5)]
    edges = sum(opponent_reply_after_centre(env, s, 0.5) not in CORNERS for s in seeds)
    # P(edge) = 0.5 * 4/8 = 0.25
    assert abs(edges / 2000 - 0.25) < 0.04


# ----------------------------------------------------------------------------- 4. seeding stable across processes

GAMES_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import env_tictactoe as t
env = t.load_environment()
player = env.scripted_player("minimax", random_move_prob=0.5)
out = []
for ex in env.examples(60, seed=31337):
    state, msg = env.reset(ex)
    transcript = [ex, msg]
    while msg is not None:
        reply = player(state)
        msg = env.step(state, reply)
        transcript += [reply, msg]
    transcript += [state, env.rewards(state), env.metrics(state)]
    out.append(transcript)
print(json.dumps(out))
"""


def play_games_in_process():
    ns = {}
    exec(compile(GAMES_SCRIPT.replace("print(json.dumps(out))", "").replace(
        "sys.path.insert(0, sys.argv[1])", ""), "<games>", "exec"), ns)
    return json.loads(json.dumps(ns["out"]))


def test_games_identical_across_processes_and_hash_seeds():
    here = play_games_in_process()
    assert len({json.dumps(t[-3]["board"]) for t in here}) > 10  # the games really vary
    for hash_seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run([sys.executable, "-c", GAMES_SCRIPT, str(ROOT)], capture_output=True, text=True,
                              env=env, timeout=60, check=True)
        assert json.loads(proc.stdout) == here


def test_same_position_gets_same_reply_across_rollouts():
    """Transpositions: X 0 then X 8 vs X 8 then X 0 reach the same position whenever O's first replies agree."""
    env = ttt.load_environment()
    found = 0
    for ex in env.examples(400, seed=3):
        ex = {**ex, "random_move_prob": 0.7, "model_first": True}
        boards = []
        for order in ((0, 8), (8, 0)):
            state, _ = env.reset(ex)
            msg = env.step(state, f"<move>{order[0]}</move>")
            if msg is None or state["board"][order[1]] != ".":
                break
            before = state["board"]
            msg = env.step(state, f"<move>{order[1]}</move>")
            boards.append((ttt.play(before, order[1], "X"), state["board"]))
        if len(boards) == 2 and boards[0][0] == boards[1][0]:
            found += 1
            assert boards[0][1] == boards[1][1], boards
    assert found >= 30
    # and a rollout replayed from a copied state gets the same reply as the original
    for ex in env.examples(50, seed=4):
        ex = {**ex, "model_first": True}
        a, _ = env.reset(ex)
        b = copy.deepcopy(a)
        env.step(a, "<move>2</move>")
        env.step(b, "<move>2</move>")
        assert a == b


def test_opponent_depends_on_the_seed():
    env = ttt.load_environment()
    replies = {opponent_reply_after_centre(env, s, 0.0) for s in range(40)}
    assert len(replies) == 4


# ----------------------------------------------------------------------------- 5. stratification

@pytest.mark.parametrize("a,b,k", [(0.0, 1.0, 8), (0.2, 0.7, 5), (0.0, 0.3, 3), (0.5, 0.5, 4), (0.0, 1.0, 1)])
def test_examples_are_stratified(a, b, k):
    env = ttt.load_environment(min_random_move_prob=a, max_random_move_prob=b, num_groups=k)
    n = 40 * k
    rows = env.examples(n, seed=11)
    assert len(rows) == n
    assert all(set(r) >= {"seed", "random_move_prob"} for r in rows)
    assert all(isinstance(r["seed"], int) for r in rows)
    width = (b - a) / k
    tol = 1e-6  # random_move_prob is rounded to 6 decimals
    for start in range(0, n, k):
        window = rows[start:start + k]
        for j, r in enumerate(window):
            p = r["random_move_prob"]
            assert a <= p <= b
            assert a + width * j - tol <= p <= a + width * (j + 1) + tol, (start, j, p)
    # deterministic given the seed, different for another seed
    assert env.examples(n, seed=11) == rows
    other = env.examples(n, seed=12)
    assert [r["seed"] for r in other] != [r["seed"] for r in rows]
    if b > a:
        assert [r["random_move_prob"] for r in other] != [r["random_move_prob"] for r in rows]
    assert env.examples(5, seed=11) == rows[:5]


def test_probabilities_spread_within_buckets():
    env = ttt.load_environment(num_groups=2)
    ps = [r["random_move_prob"] for r in env.examples(400, seed=1)]
    low, high = ps[0::2], ps[1::2]
    assert max(low) <= 0.5 <= min(high)
    assert min(low) < 0.05 and max(low) > 0.45 and min(high) < 0.55 and max(high) > 0.95


def test_model_first_is_about_half():
    env = ttt.load_environment()
    rows = env.examples(2000, seed=8)
    firsts = [env.reset(r)[0]["model_first"] for r in rows]
    assert 0.40 < sum(firsts) / len(firsts) < 0.60
    # and the decision is a function of the example's seed, stable across resets
    assert firsts[:50] == [env.reset(r)[0]["model_first"] for r in rows[:50]]
    # an explicit model_first overrides it
    assert all(env.reset({**r, "model_first": True})[0]["board"] == EMPTY for r in rows[:50])
    assert all(env.reset({**r, "model_first": False})[0]["board"].count("O") == 1 for r in rows[:50])


# ----------------------------------------------------------------------------- 6. rewards, metrics, invalid replies

def scripted_game(model_moves, opponent_moves, model_first=True, max_turns=8, **env_args):
    moves = iter(opponent_moves)
    env = ttt.load_environment(max_turns=max_turns, opponent=lambda state: next(moves), **env_args)
    state, msg = env.reset({"seed": 1, "random_move_prob": 0.0, "model_first": model_first})
    msgs = [msg]
    for m in model_moves:
        reply = m if isinstance(m, str) else f"<think>move</think><move>{m}</move>"
        msgs.append(env.step(state, reply))
        if msgs[-1] is None:
            break
    return env, state, msgs


def total_reward(env, state):
    return sum(env.reward_weights[k] * v for k, v in env.rewards(state).items())


def test_win_reward():
    env, state, msgs = scripted_game([0, 1, 2], [3, 4])
    assert state["done"] and state["winner"] == "X" and msgs[-1] is None
    assert env.rewards(state) == {"win": 1.0, "format": 1.0, "invalid": 0.0}
    m = env.metrics(state)
    assert (m["win"], m["draw"], m["loss"], m["cut_off"], m["n_turns"]) == (1.0, 0.0, 0.0, 0.0, 3)
    assert total_reward(env, state) == pytest.approx(1.2)


def test_loss_reward():
    env, state, msgs = scripted_game([6, 7, 3], [0, 1, 2])
    assert state["winner"] == "O" and state["board"] == "OOOX..XX." and msgs[-1] is None
    assert env.rewards(state) == {"win": 0.0, "format": 1.0, "invalid": 0.0}
    assert env.metrics(state)["loss"] == 1.0 and env.metrics(state)["win"] == 0.0


def test_draw_reward():
    # X O X / X O O / O X X
    env, state, msgs = scripted_game([0, 2, 3, 7, 8], [1, 4, 6, 5])
    assert state["board"] == "XOXXOOOXX"
    assert state["winner"] == "draw" and msgs[-1] is None
    assert env.rewards(state)["win"] == 0.5
    assert env.metrics(state)["draw"] == 1.0 and env.metrics(state)["loss"] == 0.0


def test_loss_penalty_scores_lost_and_cut_off_games_below_zero_only():
    games = {"win": ([0, 1, 2], [3, 4], {}), "draw": ([0, 2, 3, 7, 8], [1, 4, 6, 5], {}),
             "loss": ([6, 7, 3], [0, 1, 2], {}), "cut off": (["<move>9</move>"] * 5, [], {"max_turns": 5})}
    for penalty, expected in [(0.0, {"win": 1.0, "draw": 0.5, "loss": 0.0, "cut off": 0.0}),
                              (1.5, {"win": 1.0, "draw": 0.5, "loss": -1.5, "cut off": -1.5})]:
        for name, (model_moves, opponent_moves, args) in games.items():
            env, state, _ = scripted_game(model_moves, opponent_moves, loss_penalty=penalty, **args)
            assert state["done"] and env.rewards(state)["win"] == expected[name], (penalty, name)


def test_optimal_reward_scores_the_share_of_minimax_optimal_replies():
    """optimal_reward: the share of the model's replies that keep the position's value (a missed block is not one,
    nor an invalid reply), weighted into the total; off (no "optimal" component) by default."""
    # X 0, O 4, X 8 (the draw kept), O 2 threatens 6, X 1 misses the block, O 6 wins: 2 optimal replies of 3
    env, state, _ = scripted_game([0, 8, 1], [4, 2, 6], optimal_reward=0.5)
    assert state["winner"] == "O" and env.rewards(state)["optimal"] == pytest.approx(2 / 3)
    assert total_reward(env, state) == pytest.approx(0.0 + 0.2 * 1.0 + 0.5 * 2 / 3)
    # the same with the block (a fork: 3 and 7), O 3, an invalid reply, X 7 wins: 4 optimal replies of 5
    env, state, _ = scripted_game([0, 8, 6, "junk", 7], [4, 2, 3], optimal_reward=0.5)
    assert state["winner"] == "X" and state["turns"] == 5
    assert env.rewards(state)["optimal"] == pytest.approx(4 / 5)
    assert env.reward_weights["optimal"] == 0.5 and "optimal" not in ttt.load_environment().reward_weights
    env, state, _ = scripted_game([0, 8, 1], [4, 2, 6])
    assert "optimal" not in env.rewards(state)


def test_cut_off_game():
    env, state, msgs = scripted_game(["<move>9</move>"] * 20, [], max_turns=5)
    assert len(msgs) == 6 and msgs[-1] is None and all(m is not None for m in msgs[:-1])
    assert state["board"] == EMPTY and state["cut_off"] and state["done"] and state["winner"] is None
    assert state["turns"] == 5 and state["invalid_moves"] == 5
    assert env.rewards(state) == {"win": 0.0, "format": 0.0, "invalid": -0.1}
    m = env.metrics(state)
    assert m["cut_off"] == 1.0 and m["invalid"] == 1.0 and m["n_invalid_moves"] == 5 and m["loss"] == 1.0
    assert total_reward(env, state) == pytest.approx(-0.1)
    with pytest.raises(RuntimeError):
        env.step(state, "<move>4</move>")


def test_format_fraction_and_invalid_penalty():
    env, state, _ = scripted_game(["<move>0</move>", "<think>a</think><move>0</move>", 1, "junk", 2], [3, 4])
    assert state["winner"] == "X" and state["turns"] == 5 and state["invalid_moves"] == 2
    assert env.rewards(state) == {"win": 1.0, "format": pytest.approx(3 / 5), "invalid": -0.1}
    assert env.metrics(state)["format"] == pytest.approx(0.6)
    assert total_reward(env, state) == pytest.approx(1.0 + 0.2 * 0.6 - 0.1)
    # a heavier penalty (an RL option): still once per game, however many invalid moves
    env, state, _ = scripted_game(["<move>0</move>", "<think>a</think><move>0</move>", 1, "junk", 2], [3, 4], invalid_penalty=0.5)
    assert env.rewards(state)["invalid"] == -0.5 and total_reward(env, state) == pytest.approx(1.0 + 0.2 * 0.6 - 0.5)


def test_invalid_reply_leaves_board_and_uses_a_turn():
    env, state, msgs = scripted_game([4], [0], max_turns=30)
    board = state["board"]
    cases = [("<move>0</move>", "already taken"), ("<move>4</move>", "already taken"), ("nothing", "no <move>"),
             ("<move>9</move>", "not between 0 and 8"), ("<move>-1</move>", "not between 0 and 8"),
             ("<move>4.0</move>", "not a whole number"), ("<move>1</move><move>2</move>", "more than one"),
             ("<move>four</move>", "not a whole number")]
    for i, (reply, why) in enumerate(cases, start=2):
        msg = env.step(state, reply)
        assert state["board"] == board and state["turns"] == i and state["invalid_moves"] == i - 1
        assert msg.startswith("Invalid move:") and why in msg and "unchanged" in msg, msg
        assert msg.endswith("Your move.") and not state["done"]


def test_weighted_total_always_in_range():
    rng = random.Random(0)
    replies = ["<move>4</move>", "<think>x</think><move>{c}</move>", "<move>{c}</move>", "garbage", "<move>9</move>"]
    totals = []
    for ex in ttt.load_environment().examples(300, seed=6):
        env = ttt.load_environment(max_turns=rng.choice([1, 3, 8]))
        state, msg = env.reset(ex)
        while msg is not None:
            c = rng.choice(ttt.free_cells(state["board"]))
            msg = env.step(state, rng.choice(replies).format(c=c))
        t = total_reward(env, state)
        assert -0.1 - 1e-12 <= t <= 1.2 + 1e-12
        totals.append(t)
    assert min(totals) < 0 and max(totals) > 1.0  # both ends are reached


def test_messages_show_board_and_free_cells():
    env, state, msgs = scripted_game([4], [0])
    assert msgs[0].startswith("New game. You are X and move first.")
    assert "0|1|2\n3|4|5\n6|7|8" in msgs[0] and "Free cells: 0 1 2 3 4 5 6 7 8." in msgs[0]
    assert msgs[1].startswith("You took cell 4. The opponent took cell 0.")
    assert "O|1|2\n3|X|5\n6|7|8" in msgs[1] and "Free cells: 1 2 3 5 6 7 8." in msgs[1]
    assert ttt.render("XO.......") == "X|O|2\n3|4|5\n6|7|8"
    assert "cut off" in env.describe({**state, "winner": None})
    assert "You (X)" not in msgs[0] + msgs[1]  # the cell lists are opt-in (show_cells)


def test_show_cells_lists_each_sides_cells_and_survives_an_invalid_move():
    env, state, msgs = scripted_game([4, 0, 8], [0, 2], show_cells=True)
    assert msgs[0].endswith("6|7|8\nYou (X): none. Opponent (O): none.\nFree cells: 0 1 2 3 4 5 6 7 8. Your move.")
    assert "O|1|2\n3|X|5\n6|7|8\nYou (X): 4. Opponent (O): 0.\nFree cells: 1 2 3 5 6 7 8." in msgs[1]
    assert msgs[2].startswith("Invalid move: cell 0 is already taken.") and "You (X): 4. Opponent (O): 0.\n" in msgs[2]
    assert "You (X): 4 8. Opponent (O): 0 2.\nFree cells: 1 3 5 6 7." in msgs[3]


def test_show_wins_states_where_each_side_could_complete_a_line():
    env, state, msgs = scripted_game([4, 8, 1], [0, 2, 3], show_cells=True, show_wins=True)
    assert msgs[0].endswith("6|7|8\nYou (X): none. Opponent (O): none.\nWins now: you none, opponent none.\n"
                            "Free cells: 0 1 2 3 4 5 6 7 8. Your move.")
    assert "You (X): 4 8. Opponent (O): 0 2.\nWins now: you none, opponent 1.\nFree cells: 1 3 5 6 7." in msgs[2]
    assert "You (X): 1 4 8. Opponent (O): 0 2 3.\nWins now: you 7, opponent 6.\n" in msgs[3]
    board = "O.X.X...X"  # two lines for X, through 5 and 6; the message says what the teacher's check says
    assert ttt.wins_check(board, "X") == "Wins: me 5 6, opponent none."
    only_wins = ttt.load_environment(show_wins=True)._show({"board": board})
    assert only_wins.endswith("6|7|X\nWins now: you 5 6, opponent none.\nFree cells: 1 3 5 6 7. Your move.")
    assert "Wins now" not in ttt.load_environment(show_cells=True)._show({"board": board})  # opt-in


def test_opening_starts_from_a_reachable_position_with_the_moves_listed():
    """opening=k: up to k rounds of the scripted player's X and the example's own O before the model's first
    turn; the listed moves replay to the board, X's are the player's moves, and the game is never over."""
    env = ttt.load_environment(show_cells=True, opening=3)
    plain = ttt.load_environment(show_cells=True)
    player, rounds = env.scripted_player("minimax", random_move_prob=0.0), Counter()
    for ex in env.examples(600, seed=5):
        state, msg = env.reset(ex)
        assert env.reset(ex) == (state, msg)  # seeded: the same example, the same start
        m = re.match(r"New game, from a position: the moves so far were ([XO \d,]+)\.\n", msg)
        if m is None:  # no opening round: the plain start of the same example
            assert (state, msg) == plain.reset(ex)
            rounds[0] += 1
            continue
        moves = [(mv[0], int(mv[2])) for mv in m.group(1).split(", ")]
        board = EMPTY
        for who, cell in moves:
            if who == "X":
                # the minimax player's move (test_minimax_player_takes_immediate_wins_... checks it against the solver)
                assert f"<move>{cell}</move>" in player({"board": board, "seed": ex["seed"]})
            board = board[:cell] + who + board[cell + 1:]
            assert my_winner(board) is None
        assert board == state["board"] and "." in board and not state["done"]
        assert moves[0][0] == ("X" if state["model_first"] else "O") and state["turns"] == 0
        assert msg.endswith(plain._show(state))
        rounds[sum(who == "X" for who, _ in moves)] += 1
    assert set(rounds) == {0, 1, 2, 3} and min(rounds.values()) > 60
    with pytest.raises(ValueError, match="opening"):
        ttt.load_environment(opening=-1)


def test_random_opening_plays_random_free_cells_for_x():
    """opening_player="random" (the rules recipe's SFT): the opening's X moves are random free cells, not the
    minimax player's, the game is never over, and the message is the one a minimax opening writes."""
    env = ttt.load_environment(show_cells=True, opening=3, opening_player="random")
    player, x_moves, not_minimax = env.scripted_player("minimax", random_move_prob=0.0), 0, 0
    for ex in env.examples(300, seed=5):
        state, msg = env.reset(ex)
        m = re.match(r"New game, from a position: the moves so far were ([XO \d,]+)\.\n", msg)
        if m is None:
            continue
        board = EMPTY
        for who, cell in [(mv[0], int(mv[2])) for mv in m.group(1).split(", ")]:
            assert board[cell] == "."
            if who == "X":
                x_moves += 1
                not_minimax += f"<move>{cell}</move>" not in player({"board": board, "seed": ex["seed"]})
            board = board[:cell] + who + board[cell + 1:]
        assert board == state["board"] and my_winner(board) is None and not state["done"]
    assert x_moves > 200 and not_minimax / x_moves > 0.5
    with pytest.raises(ValueError, match="opening_player"):
        ttt.load_environment(opening_player="perfect")


@pytest.mark.parametrize("kind", ["block", "win", "threat"])
def test_puzzles_start_where_random_play_first_demands_the_kind_and_end_after_puzzle_turns(kind):
    """puzzles=p: about that share of the examples start where a line of legal moves first reached a position, X to
    move, that demands `kind` (block: O threatens one line, X has no win, and blocking is the only move that keeps
    the game's value; win: X has a win; threat: either), the moves listed as an opening's; the rest are the plain
    environment's examples; a puzzle is cut off after puzzle_turns replies, an ordinary game is not."""
    env = ttt.load_environment(show_cells=True, puzzles=0.5, puzzle_kind=kind, puzzle_turns=1)
    plain = ttt.load_environment(show_cells=True)
    examples, kinds = env.examples(400, seed=7), Counter()
    for ex, plain_ex in zip(examples, plain.examples(400, seed=7)):
        assert {k: ex[k] for k in plain_ex} == plain_ex  # seed and opponent as without puzzles
        state, msg = env.reset(ex)
        if "position" not in ex:
            assert (state, msg) == plain.reset(ex) and state["max_turns"] == 8
            continue
        m = re.match(r"New game, from a position: the moves so far were ([XO \d,]+)\.\n", msg)
        board, seen = EMPTY, []
        for who, cell in [(mv[0], int(mv[2])) for mv in m.group(1).split(", ")]:
            assert board[cell] == "." and my_winner(board) is None
            if who == "X":
                seen.append(board)
            board = board[:cell] + who + board[cell + 1:]
        assert board == state["board"] and not state["done"] and state["turns"] == 0
        wins, their_wins, best = ttt.threats(board, "X"), ttt.threats(board, "O"), ttt.best_moves(board, "X")
        if wins:
            kinds["win"] += 1
            assert set(wins) <= set(best)
        else:
            kinds["block"] += 1
            assert len(their_wins) == 1 and list(best) == their_wins and ttt.value(board, "X") > -1
        assert not any(ttt.demands(b, kind) for b in seen)  # the first such position of its line
        # one reply (a legal move that does not win) and the puzzle is over, cut off
        cell = ([c for c in ttt.free_cells(board) if c not in wins] or wins)[0]
        assert env.step(state, f"<think>a</think><move>{cell}</move>") is None and state["done"]
        assert state["cut_off"] or state["winner"] is not None
    assert 150 < sum(kinds.values()) < 250
    assert set(kinds) == {"block": {"block"}, "win": {"win"}, "threat": {"block", "win"}}[kind]
    for bad in ({"puzzles": 1.5}, {"puzzles": -0.1}, {"puzzle_kind": "fork"}, {"puzzle_turns": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ttt.load_environment(**bad)


def test_opening_puzzles_are_first_and_second_moves_that_can_lose_and_a_list_draws_a_kind_per_puzzle():
    """puzzle_kind="opening": X's first or second move of a random line (each about as often), where some move loses
    the position's value; a list of kinds draws one per puzzle, each about as often, and a one-kind list is that
    kind."""
    positions = [ex["position"] for ex in ttt.load_environment(puzzles=1.0, puzzle_kind="opening").examples(600, seed=3)]
    for board in positions:
        assert board.count("O") - board.count("X") in (0, 1) and my_winner(board) is None and board.count("X") <= 1
        assert len(ttt.best_moves(board, "X")) < len(ttt.free_cells(board))  # a move that loses the value
    stones = Counter(9 - b.count(".") for b in positions)
    assert set(stones) == {1, 2, 3} and stones[1] > 150 and stones[2] > 150 and stones[3] > 100  # first moves: 1 stone
    env = ttt.load_environment(puzzles=1.0, puzzle_kind=["block", "opening"])
    openings = sum(ttt.demands(ex["position"], "opening") and not ttt.demands(ex["position"], "block")
                   for ex in env.examples(400, seed=3))
    assert 150 < openings < 250
    assert all(ttt.demands(ex["position"], "block") or ttt.demands(ex["position"], "opening") for ex in env.examples(400, seed=3))
    one = ttt.load_environment(puzzles=0.5, puzzle_kind=["threat"]).examples(100, seed=3)
    assert one == ttt.load_environment(puzzles=0.5, puzzle_kind="threat").examples(100, seed=3)
    for bad in ([], ["fork"], ["block", "fork"], "fork", ("block",)):
        with pytest.raises(ValueError, match="puzzle_kind"):
            ttt.load_environment(puzzle_kind=bad)


def test_second_puzzles_are_second_moves_that_can_lose_after_an_optimal_first_move():
    """puzzle_kind="second": X's second move, where some move loses the position's value, on a line whose X move
    was optimal (O's random): the positions a good first move leads to, a centre reply to a corner opening among
    them, which "opening" puzzles (their X move random) rarely reach."""
    examples = ttt.load_environment(puzzles=1.0, puzzle_kind="second").examples(600, seed=3)
    centre_after_corner = 0
    for ex in examples:
        board, replies = ex["position"], ex["replies"]
        assert board.count("X") == 1 and board.count("O") == 2 - ex["model_first"] and my_winner(board) is None
        assert len(ttt.best_moves(board, "X")) < len(ttt.free_cells(board))  # a move that loses the value
        before = EMPTY if ex["model_first"] else EMPTY[:replies[EMPTY]] + "O" + EMPTY[replies[EMPTY] + 1:]
        x = board.index("X")
        assert x in ttt.best_moves(before, "X")  # the first move was optimal
        assert replies[before[:x] + "X" + before[x + 1:]] == [c for c in range(9) if board[c] == "O" and before[c] == "."][0]
        centre_after_corner += not ex["model_first"] and x == 4 and replies[EMPTY] in ttt.CORNERS
    opening = ttt.load_environment(puzzles=1.0, puzzle_kind="opening").examples(600, seed=3)
    centre_after_corner_opening = sum(not ex["model_first"] and ex["position"].count("X") == 1 and ex["position"][4] == "X"
                                      and ex["replies"][EMPTY] in ttt.CORNERS for ex in opening)
    assert centre_after_corner > 100 and centre_after_corner > 5 * centre_after_corner_opening


def test_start_puzzles_are_a_games_first_two_replies_against_a_random_opponent():
    """puzzle_kind="start": no position; the game's own messages from the empty board, the opponent uniformly
    random, cut off after X's second reply (not before), each side starting about as often."""
    env = ttt.load_environment(show_cells=True, puzzles=1.0, puzzle_kind="start", optimal_reward=1.0)
    examples = env.examples(200, seed=5)
    assert all("position" not in ex and "replies" not in ex and ex["random_move_prob"] == 1.0 for ex in examples)
    assert 70 < sum(ex["model_first"] for ex in examples) < 130
    for ex in examples[:20]:
        state, msg = env.reset(ex)
        assert msg.startswith("New game.") and state["board"].count("O") == 1 - ex["model_first"]
        optimal = []
        for turn in range(2):
            board, cell = state["board"], ttt.free_cells(state["board"])[0]
            optimal.append(cell in ttt.best_moves(board, "X"))
            assert (env.step(state, f"<think>a</think><move>{cell}</move>") is None) == (turn == 1) == state["done"]
        assert state["cut_off"] or state["winner"] == "O"  # moving second, O's third move may win first
        assert env.rewards(state)["optimal"] == sum(optimal) / 2
    # a uniformly random opponent: its first moves cover the board
    openings = Counter(env.reset(ex)[0]["board"].index("O") for ex in examples if not ex["model_first"])
    assert set(openings) == set(range(9))


def test_certificate_and_evaluation_ignore_puzzles():
    """The certificate (and so the exploiter) plays every line from the empty board whatever the puzzles share, and
    the standard evaluations play full games."""
    player = ttt.load_environment().scripted_player("random")
    policy = lambda episodes: [player(ep["state"]) for ep in episodes]
    summary, _, replays = ttt.load_environment(show_cells=True).exploit(policy)
    assert ttt.load_environment(show_cells=True, puzzles=1.0).exploit(policy) == (summary, _, replays)
    assert all(opts["puzzles"] == 0.0 for opts in ttt.EVAL_SETTINGS.values())


def test_exploit_rank_random_wins_prefers_the_policy_that_wins_more_against_a_weak_opponent():
    """exploit_rank="random_wins": of two policies that never lose, the one that wins more against the random
    opponent ranks first, whatever their mistaken decisions; lost lines still rank before anything."""
    def player(pick):
        return lambda episodes: [f"<think>a</think><move>{pick(ep['state']['board'])}</move>" for ep in episodes]
    minimax = player(ttt.player_move)  # never loses, wins what it can
    # never loses either, but it plays the first value-keeping cell, so it sets fewer traps for a weak opponent
    plain = player(lambda board: ttt.best_moves(board, "X")[0])
    first_free = player(lambda board: board.index("."))  # loses lines
    ranks = {}
    for rank in ttt.EXPLOIT_RANKS:
        env = ttt.load_environment(exploit_rank=rank)
        ranks[rank] = {name: env.exploit(p)[1] for name, p in (("minimax", minimax), ("plain", plain), ("first", first_free))}
    by_mistakes, by_wins = ranks["mistakes"], ranks["random_wins"]
    assert by_mistakes["minimax"] == by_mistakes["plain"] == (0, 0) and by_mistakes["first"][0] > 0
    assert by_wins["minimax"] < by_wins["plain"] < by_wins["first"]
    assert by_wins["minimax"][0] == by_wins["plain"][0] == 0 and -1 < by_wins["minimax"][1] < by_wins["plain"][1] < 0
    with pytest.raises(ValueError, match="exploit_rank"):
        ttt.load_environment(exploit_rank="wins")


@pytest.mark.parametrize("first", [True, False])
def test_exploit_replays_from_the_mistake_start_at_its_position(first):
    """replay_from="mistake": each of the exploit hook's replays starts at the board where the policy erred, X to
    move, its moves so far listed; those moves are the line's (the same board reached by replaying from the empty
    board with replay_from="start"), and the opponent goes on with the line's replies then optimal play."""
    from_start = ttt.load_environment(show_cells=True)
    from_mistake = ttt.load_environment(show_cells=True, replay_from="mistake")
    player = from_start.scripted_player("random")
    policy = lambda episodes: [player(ep["state"]) for ep in episodes]
    _, _, starts = from_start.exploit(policy)
    _, _, replays = from_mistake.exploit(policy)
    assert len(replays) == len(starts) > 50
    checked = 0
    for start, replay in zip(starts, replays):
        if replay["model_first"] != first:
            continue
        assert "position" not in start and {**start, "position": replay["position"]} == replay
        state, msg = from_mistake.reset({"seed": 7, **replay})
        assert state["board"] == replay["position"] and not state["done"] and state["turns"] == 0
        listed = re.search(r"moves so far were ([XO \d,]+)\.", msg)
        if listed is None:  # a mistake at the model's first move: the plain start of the line
            assert replay["position"].count("X") == 0 and (state, msg) == from_start.reset({"seed": 7, **start})
            continue
        # the same board by the line from the empty board: its X moves played, the replies' O moves answering
        other, _ = from_start.reset({"seed": 7, **start})
        for mv in listed.group(1).split(", "):
            if mv[0] == "X":
                from_start.step(other, f"<move>{mv[2]}</move>")
        assert other["board"] == state["board"]
        checked += 1
    assert checked > 20
    with pytest.raises(ValueError, match="replay_from"):
        ttt.load_environment(replay_from="middle")


def test_replay_explore_forces_other_moves_at_the_mistake():
    """replay_explore: the exploit hook's replays carry the mistake's board; there, the odd rollouts of a group
    get a forced reply (in the named player's words, a true check, each free cell in turn from one the seed picks),
    the even ones and every other board none; without replay_explore the replays are as before."""
    env = ttt.load_environment(show_cells=True, show_wins=True, replay_explore="rules_wins")
    player = env.scripted_player("random")
    policy = lambda episodes: [player(ep["state"]) for ep in episodes]
    _, _, replays = env.exploit(policy)
    _, _, plain = ttt.load_environment(show_cells=True, show_wins=True).exploit(policy)
    assert len(replays) == len(plain) > 50
    assert all(r == {**p, "explore": r["explore"]} for r, p in zip(replays, plain)) and not any("explore" in p for p in plain)
    replay = next(r for r in replays if r["explore"].count(".") == 6)  # X's second move
    state, _ = env.reset({"seed": 11, **replay})
    while state["board"] != replay["explore"]:  # play the line up to the mistake: X's first move on it
        assert env.forced_reply(state, 1) is None
        x = next(c for c in ttt.free_cells(state["board"]) if ttt.cells_of(replay["explore"], "X") == [c])
        env.step(state, f"<move>{x}</move>")
    free = ttt.free_cells(state["board"])
    assert all(env.forced_reply(state, r) is None for r in (0, 2, 4, 6))
    forced = [env.forced_reply(state, r) for r in range(1, 2 * len(free), 2)]
    cells = [ttt.parse_move(f, state["board"])[0] for f in forced]
    assert sorted(cells) == free and cells[0] == free[11 % len(free)]
    assert all(ttt.is_well_formed(f) and ttt.states_the_wins(f, state["board"]) for f in forced)
    assert forced[0] == ttt.scripted_reply("rules_wins", state["board"], cells[0])
    env.step(state, forced[0])
    assert env.forced_reply(state, 1) is None
    with pytest.raises(ValueError, match="replay_explore"):
        ttt.load_environment(replay_explore="teacher")


# ----------------------------------------------------------------------------- 7. bad input fuzz

PIECES = ["<move>", "</move>", "<think>", "</think>", "<move>", "</move>", "<Move>", "< move>", "<move", "move>",
          "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "-1", "9", "4.0", " 4 ", "04", "1e0", "+4", "0x4",
          "٤", "４", "߄", "\u00a0", "\u2003", "\n", "\t", " ", "", "\x00", "\x7f", "\ufffd", "\ud800", "💥",
          "<move><move>", "</move></move>", "<think><think>", "<think><move>3</move></think>", "four", "null",
          "<", ">", "/", "\\", "'", '"', "<move>4</move>", "<think>ok</think>", "<move>\n7\n</move>"]


def random_reply(rng):
    if rng.random() < 0.05:  # binary junk
        return bytes(rng.randrange(256) for _ in range(rng.randrange(40))).decode("latin-1")
    return "".join(rng.choice(PIECES) for _ in range(rng.randrange(13)))


def expected_cell(reply, board):
    """Independent oracle for the documented parse: the only <move>...</move> pair, stripped, a digit 0-8 naming a
    free cell. Returns a cell, None (invalid) or 'either' for non-canonical integers ('04', '-0')."""
    if reply.count("<move>") != 1:
        return None
    start = reply.index("<move>") + len("<move>")
    end = reply.find("</move>", start)
    if end < 0:
        return None
    text = reply[start:end].strip()
    if len(text) == 1 and text in "012345678":
        return int(text) if board[int(text)] == "." else None
    if re.fullmatch(r"-?[0-9]+", text, re.ASCII) and int(text) in range(9):
        return "either"
    return None


def structurally_well_formed(reply):
    s = reply.strip()
    return (s.startswith("<think>") and s.endswith("</move>") and s.count("<think>") == 1 and s.count("</think>") == 1
            and s.count("<move>") == 1 and s.count("</move>") == 1 and s.index("</think>") < s.index("<move>"))


def check_step(env, state, reply):
    before = copy.deepcopy(state)
    expect = expected_cell(reply, before["board"])
    msg = env.step(state, reply)
    b0, b1 = before["board"], state["board"]
    assert state["turns"] == before["turns"] + 1
    assert state["well_formed"] - before["well_formed"] == int(ttt.is_well_formed(reply))
    if ttt.is_well_formed(reply):
        assert structurally_well_formed(reply), repr(reply)
    changed = [i for i in range(9) if b0[i] != b1[i]]
    if b0 == b1:
        assert state["invalid_moves"] == before["invalid_moves"] + 1
        assert expect in (None, "either"), repr(reply)
        assert msg is None or msg.startswith("Invalid move:")
    else:
        assert state["invalid_moves"] == before["invalid_moves"]
        assert all(b0[i] == "." for i in changed)
        xs = [i for i in changed if b1[i] == "X"]
        os_ = [i for i in changed if b1[i] == "O"]
        assert len(xs) == 1 and len(os_) <= 1 and len(changed) == len(xs) + len(os_)
        assert expect == "either" or expect == xs[0], repr(reply)
        assert len(os_) == 1 or ttt.winner(b1) is not None  # the opponent answers unless X ended the game
        if msg is not None:
            assert msg.startswith(f"You took cell {xs[0]}. The opponent took cell {os_[0]}.")
    assert (msg is None) == state["done"]
    if state["done"]:
        assert state["winner"] == ttt.winner(b1) and (state["winner"] is not None or state["cut_off"])
        assert state["cut_off"] == (state["winner"] is None and state["turns"] >= env.max_turns)
    assert b1.count("X") - b1.count("O") in (-1, 0, 1)
    return msg


def test_fuzz_step_never_crashes_and_state_stays_consistent():
    rng = random.Random(20240601)
    envs = [ttt.load_environment(max_turns=8), ttt.load_environment(max_turns=30)]
    minimax = envs[0].scripted_player("minimax", random_move_prob=0.3)
    examples = ttt.load_environment().examples(2000, seed=17)
    live, n_fuzz, n_games, valid = [], 0, 0, 0
    while n_fuzz < 10_000:
        if len(live) < 8:
            env = rng.choice(envs)
            state, _ = env.reset(examples[n_games % len(examples)])
            n_games += 1
            live.append((env, state))
        env, state = live[rng.randrange(len(live))]
        if rng.random() < 0.35:
            reply = minimax(state)  # advance the game so fuzz hits every stage
        else:
            reply = random_reply(rng)
            n_fuzz += 1
        board = state["board"]
        msg = check_step(env, state, reply)
        valid += state["board"] != board
        if msg is None:
            live = [g for g in live if g[1] is not state]
    assert n_games > 300 and valid > 1000


def test_fuzz_odd_reply_types_and_huge_reply():
    env = ttt.load_environment(max_turns=30)
    state, _ = env.reset({"seed": 3, "random_move_prob": 0.0, "model_first": True})
    for reply in [None, 4, 4.0, b"<move>4</move>", ["<move>4</move>"], {"move": 4}]:
        a, b = copy.deepcopy(state), copy.deepcopy(state)
        assert env.step(a, reply) == env.step(b, str(reply))  # non-str replies are read as str(reply)
        assert a == b
    for reply in ["", "\x00" * 1000, "<move>" * 200 + "</move>"]:
        check_step(env, state, reply)
    huge = "<think>" + "lorem ipsum <mov e> 4 ٤ " * 100_000 + "</think><move>4</move>"
    assert len(huge) > 2_000_000
    t0 = time.perf_counter()
    check_step(env, state, huge)
    assert ttt.is_well_formed(huge)
    assert state["board"][4] == "X"
    huge_junk = "".join(random.Random(1).choices("<>/movethink 0123456789", k=2_000_000))
    check_step(env, state, huge_junk)
    assert time.perf_counter() - t0 < 5


PATHOLOGICAL_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import env_tictactoe as t
reply = "<move>" * 100_000 + "4"  # 600 kB of unclosed opening tags
print(t.parse_move(reply, "." * 9), t.is_well_formed(reply))
"""


def test_many_unclosed_move_tags_parse_fast(run_python_within):
    proc = run_python_within(PATHOLOGICAL_SCRIPT, 1.5, "parse_move on a 600 kB reply")
    assert proc.stdout.startswith("(None, ") and "False" in proc.stdout  # invalid, not well-formed


@pytest.mark.parametrize("reply,cell,reason", [
    ("<move>-1</move>", None, "not between 0 and 8"),
    ("<move>9</move>", None, "not between 0 and 8"),
    ("<move>4.0</move>", None, "not a whole number"),
    ("<move>٤</move>", None, "not a whole number"),
    ("<move>４</move>", None, "not a whole number"),
    ("<move>four</move>", None, "not a whole number"),
    ("<move></move>", None, "not a whole number"),
    ("<move> 4 </move>", 4, None),
    ("<move>\n4\t</move>", 4, None),
    ("<move>4</move><move>5</move>", None, "more than one"),
    ("<move>4</move><move>4</move>", None, "more than one"),
    ("<move><move>4</move>", None, "more than one"),
    ("<think><move>3</move></think><move>4</move>", None, "more than one"),
    ("4", None, "no <move>"),
    ("", None, "no <move>"),
    ("<move>4", None, "no <move>"),
    ("<think>x</think><move>3</move>", 3, None),
    ("text before <move>8</move> and after", 8, None),
    ("<move>0</move>", None, "already taken"),
])
def test_parse_move_documented_cases(reply, cell, reason):
    board = "O" + "." * 8
    got_cell, why = ttt.parse_move(reply, board)
    assert got_cell == cell
    if reason is None:
        assert why is None
    else:
        assert reason in why


@pytest.mark.parametrize("reply,ok", [
    ("<think>x</think><move>3</move>", True),
    ("  <think>\nmulti\nline</think>\n<move> 3 </move>\n", True),
    ("<think></think><move>0</move>", True),
    ("<move>3</move>", False),
    ("<think>x</think>", False),
    ("<think>x</think><move>3</move>tail", False),
    ("lead<think>x</think><move>3</move>", False),
    ("<think>x</think>junk<move>3</move>", False),
    ("<think><think>x</think><move>3</move>", False),
    ("<think>a<move>1</move></think><move>3</move>", False),
    ("<think>x</think><move>3</move><move>4</move>", False),
    ("<think>x</think><move>4.0</move>", False),
    ("<think>x</think><move>٤</move>", False),
    ("<think>x</think><move></move>", False),
    ("", False),
])
def test_is_well_formed_cases(reply, ok):
    assert ttt.is_well_formed(reply) is ok


@settings(derandomize=True, max_examples=250, deadline=None, database=None)
@given(st.text(alphabet=st.sampled_from(list("<>/ movethink0123456789-.\n٤")) | st.characters(), max_size=60),
       st.sampled_from([EMPTY, "X...O....", "XOXOXO..."]))
def test_parse_move_property(reply, board):
    cell, why = ttt.parse_move(reply, board)
    assert (cell is None) != (why is None)
    expect = expected_cell(reply, board)
    if expect != "either":
        assert cell == expect, (reply, board)
    if cell is not None:
        assert board[cell] == "."
    if ttt.is_well_formed(reply):
        assert structurally_well_formed(reply)


@settings(derandomize=True, max_examples=120, deadline=None, database=None)
@given(st.text(max_size=30).filter(lambda s: "<think>" not in s and "</think>" not in s
                                   and "<move>" not in s and "</move>" not in s),
       st.integers(0, 8), st.sampled_from(["", " ", "\n", "\t "]))
def test_well_formed_property(think, cell, ws):
    reply = f"{ws}<think>{think}</think>{ws}<move>{ws}{cell}{ws}</move>{ws}"
    assert ttt.is_well_formed(reply)
    assert ttt.parse_move(reply, EMPTY) == (cell, None)


# ----------------------------------------------------------------------------- 8. bad load_environment arguments

@pytest.mark.parametrize("kwargs,name", [
    ({"min_random_move_prob": 0.8, "max_random_move_prob": 0.2}, "min_random_move_prob"),
    ({"min_random_move_prob": -0.1}, "min_random_move_prob"),
    ({"max_random_move_prob": 1.5}, "max_random_move_prob"),
    ({"min_random_move_prob": float("nan")}, "min_random_move_prob"),
    ({"max_random_move_prob": "0.5"}, "max_random_move_prob"),
    ({"num_groups": 0}, "num_groups"),
    ({"num_groups": 2.5}, "num_groups"),
    ({"max_turns": 0}, "max_turns"),
    ({"invalid_penalty": -0.1}, "invalid_penalty"),
    ({"invalid_penalty": float("nan")}, "invalid_penalty"),
    ({"show_cells": "yes"}, "show_cells"),
    ({"show_wins": 1}, "show_wins"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ttt.load_environment(**kwargs)


def test_unknown_argument_raises_naming_it():
    with pytest.raises(TypeError, match="opponent_strength"):
        ttt.load_environment(opponent_strength=0.5)


def test_rules_player_knows_the_format_and_the_rules_only():
    """The 'rules' player (speedrun.sh TEACHER=rules): a legal move, a <think> that lists the free cells and names
    the move, and no strategy: where it can win at once it does so no more often than a random free cell would."""
    env = ttt.load_environment(show_cells=True)
    player = env.scripted_player("rules")
    wins_taken = wins_possible = 0
    for ex in env.examples(400, seed=3):
        state, _ = env.reset(ex)
        while not state["done"]:
            board, free = state["board"], ttt.free_cells(state["board"])
            reply = player(state)
            m = re.fullmatch(r"<think>Free cells: ([0-8 ]+)\. I take cell ([0-8])\.</think><move>([0-8])</move>", reply)
            assert m and [int(c) for c in m.group(1).split()] == free and m.group(2) == m.group(3) and int(m.group(3)) in free
            if ttt.threats(board, "X") and len(free) > 2:
                wins_possible += 1
                wins_taken += int(m.group(3)) in ttt.threats(board, "X")
            env.step(state, reply)
    assert wins_possible > 100 and wins_taken / wins_possible < 0.5  # minimax would take every one


def test_rules_wins_player_states_the_wins_and_plays_the_rules_players_move():
    """'rules_wins' (speedrun.sh TEACHER=rules_wins): the 'rules' player's move and think, after a true statement of
    where each side could complete a line now; no more strategy than 'rules' (the same random cell)."""
    env = ttt.load_environment(show_cells=True)
    rules, rules_wins = env.scripted_player("rules"), env.scripted_player("rules_wins")
    seen = set()
    for ex in env.examples(100, seed=4):
        state, _ = env.reset(ex)
        while not state["done"]:
            board, reply = state["board"], rules_wins(state)
            m = re.fullmatch(r"<think>Wins: me ([0-8 ]+|none), opponent ([0-8 ]+|none)\. (Free cells: .*)", reply)
            assert m, reply
            listed = [[] if g == "none" else [int(c) for c in g.split()] for g in m.group(1, 2)]
            assert listed == [ttt.threats(board, "X"), ttt.threats(board, "O")]
            assert "<think>" + m.group(3) == rules(state)  # the same free cells and the same random move
            seen.add((bool(listed[0]), bool(listed[1])))
            env.step(state, reply)
    assert seen == {(False, False), (True, False), (False, True), (True, True)}


def test_rules_then_player_ends_its_think_with_its_wins_after_the_move():
    """'rules_then' (speedrun.sh TEACHER=rules_then): rules_wins's reply, its think ending with where X could
    complete a line after its move; the next check's `me` part is that list less the opponent's reply."""
    env = ttt.load_environment(show_cells=True)
    rules_wins, rules_then = env.scripted_player("rules_wins"), env.scripted_player("rules_then")
    copied = 0
    for ex in env.examples(100, seed=6):
        state, _ = env.reset(ex)
        promised = None
        while not state["done"]:
            board, reply = state["board"], rules_then(state)
            m = re.fullmatch(r"(<think>.*\.) Then: me ([0-8 ]+|none)\.</think>(<move>([0-8])</move>)", reply)
            assert m and m.group(1) + "</think>" + m.group(3) == rules_wins(state), reply
            then = [] if m.group(2) == "none" else [int(c) for c in m.group(2).split()]
            assert then == ttt.threats(ttt.play(board, int(m.group(4)), "X"), "X")
            assert ttt.states_the_wins(reply, board)
            if promised is not None:  # the opponent's reply took at most one of them, and made none
                assert set(promised) - set(ttt.threats(board, "X")) <= {c for c in range(9) if board[c] == "O"}
                assert set(ttt.threats(board, "X")) <= set(promised)
                copied += bool(promised)
            promised = then
            env.step(state, reply)
    assert copied > 50
    board = "X...O.O.."  # O wins at 2; after X 2, X could complete a line at 1
    right = "<think>Wins: me none, opponent 2. Free cells: 1 2 3 5 7 8. I take cell 2. Then: me 1.</think><move>2</move>"
    assert ttt.states_the_wins(right, board)
    for wrong in (right.replace("me 1.", "me 1 3."), right.replace("me 1.", "me none."), right.replace("<move>2", "<move>8"),
                  right.replace("<move>2", "<move>4")):  # one too many, none, another move's list, an invalid move
        assert not ttt.states_the_wins(wrong, board), wrong


def test_check_reward_scores_the_true_wins_statements_only():
    """check_reward: the share of replies whose <think> begins with the true `Wins:` statement, weighted into the
    total; off (no "check" component, the class's weights) by default."""
    board = "XX.OO...."  # X wins at 2, O at 5
    assert ttt.states_the_wins("<think>Wins: me 2, opponent 5. Free cells: 2 5 6 7 8. I take cell 2.</think><move>2</move>", board)
    for wrong in ("<think>Wins: me none, opponent 5. I block.</think><move>5</move>",   # a win missed
                  "<think>Wins: me 2 5, opponent 5.</think><move>2</move>",            # one too many
                  "<think>Wins: me 5, opponent 2.</think><move>2</move>",              # the sides swapped
                  "<think>I take cell 2. Wins: me 2, opponent 5.</think><move>2</move>",  # not where it begins
                  "Wins: me 2, opponent 5.<move>2</move>"):
        assert not ttt.states_the_wins(wrong, board), wrong
    env = ttt.load_environment(show_cells=True, check_reward=0.5)
    assert env.reward_weights["check"] == 0.5 and "check" not in ttt.load_environment().reward_weights
    rules_wins, none = env.scripted_player("rules_wins"), "Wins: me none, opponent none."
    lies = 0
    for example in env.examples(20, seed=5):
        state, _ = env.reset(example)
        replies = true = 0
        while not state["done"]:
            reply = rules_wins(state)
            if replies % 2:  # every other reply states no wins at all, true only where neither side has one
                true += ttt.wins_check(state["board"], "X") == none
                lies += ttt.wins_check(state["board"], "X") != none
                reply = reply.replace("Wins:", f"{none} Was:")
            else:
                true += 1
            env.step(state, reply)
            replies += 1
        assert env.rewards(state)["check"] == pytest.approx(true / replies)
    assert lies > 5
    assert "check" not in ttt.load_environment(show_cells=True).rewards(state)


def test_missed_win_penalty_costs_a_stated_win_not_taken():
    """missed_win_penalty: minus the share of replies whose `Wins:` check names a win of X's and whose move is
    elsewhere; a stated win taken, a check naming none, or an invalid move costs nothing; off by default."""
    env = ttt.load_environment(show_cells=True, max_turns=2, missed_win_penalty=0.5)
    assert env.reward_weights["missed_win"] == 0.5 and "missed_win" not in ttt.load_environment().reward_weights
    example = {"seed": 1, "random_move_prob": 0.0, "model_first": True, "replies": {"X........": 3, "XX.O.....": 4},
               "position": "XX.OO...."}

    def play(*replies):
        state, _ = env.reset(example)
        for reply in replies:
            if not state["done"]:
                env.step(state, reply)
        return env.rewards(state)["missed_win"]

    taken = "<think>Wins: me 2, opponent 5.</think><move>2</move>"
    missed = "<think>Wins: me 2, opponent 5. I block.</think><move>5</move>"
    unstated = "<think>Wins: me none, opponent 5. I block.</think><move>5</move>"
    assert play(taken) == 0.0
    assert play(unstated, "<move>x</move>") == 0.0
    assert play("<think>Wins: me 2, opponent 5.</think><move>x</move>", taken) == 0.0  # invalid, then the win
    assert play(missed, "<move>8</move>") == pytest.approx(-0.5)  # one of two replies
    assert "missed_win" not in ttt.load_environment(show_cells=True).rewards(env.reset(example)[0])


def test_unknown_scripted_player():
    with pytest.raises(ValueError, match="perfect"):
        ttt.load_environment().scripted_player("perfect")


def test_edge_arguments_are_accepted():
    env = ttt.load_environment(min_random_move_prob=0, max_random_move_prob=0, num_groups=1, max_turns=1)
    assert all(r["random_move_prob"] == 0 for r in env.examples(10))


# ----------------------------------------------------------------------------- 9. the scripted players' <think> is true

THINK_RE = re.compile(r"<think>(.*)</think><move>(\d)</move>", re.DOTALL)


def my_threats(board, player):
    return sorted(i for i in range(9) if board[i] == "." and my_winner(board[:i] + player + board[i + 1:]) == player)


def check_explanation(board, reply):
    m = THINK_RE.fullmatch(reply)
    assert m, reply
    text, cell = m.group(1), int(m.group(2))
    assert board[cell] == "."
    after = board[:cell] + "X" + board[cell + 1:]
    assert re.search(rf"\b{cell}\b", text)
    if board.count(".") == 1:  # the last free cell has its own words, whatever it does
        assert text == f"Only cell {cell} is free."
        return "last"
    # first the check of both sides' immediate wins, true whatever the move
    mc = re.fullmatch(r"Wins: me (none|\d( \d)*), opponent (none|\d( \d)*)\. (.*)", text)
    assert mc, text
    for listed, player in ((mc.group(1), "X"), (mc.group(3), "O")):
        assert listed == (" ".join(map(str, my_threats(board, player))) or "none"), (board, text)
    text = mc.group(5)
    if "completes my line" in text:
        assert my_winner(after) == "X"
        return "win"
    assert my_winner(after) != "X"  # a winning move is always announced as one
    if "block" in text:
        assert cell in my_threats(board, "O")
        return "block"
    assert cell not in my_threats(board, "O")
    if "fork" in text:
        assert len(my_threats(after, "X")) >= 2
        return "fork"
    mt = re.fullmatch(r"Cell (\d) makes a threat at (\d)\.", text)
    if mt:
        assert my_threats(after, "X") == [int(mt.group(2))]
        return "threat"
    assert not my_threats(after, "X")
    kind = {4: "the centre"}.get(cell, "a corner" if cell in CORNERS else "an edge")
    assert text == f"I take {kind}, cell {cell}."
    return "plain"


def test_scripted_explanations_are_true():
    env = ttt.load_environment()
    players = [env.scripted_player("minimax"), env.scripted_player("random"),
               env.scripted_player("minimax", random_move_prob=0.5)]
    kinds = Counter()
    boards = [b for b in POS_X | POS_O if my_winner(b) is None and b.count("X") <= b.count("O")]
    boards = sorted(set(boards))
    for i, board in enumerate(boards):
        for player in players:
            kinds[check_explanation(board, player({"board": board, "seed": i % 3}))] += 1
    assert set(kinds) == {"win", "block", "fork", "threat", "plain", "last"}, kinds


def my_chance_vs_random(board, first, val, memo):
    """X's best chance to win against a uniformly random O, X playing only its immediate wins, else optimal moves."""
    if board not in memo:
        w = my_winner(board)
        free = [i for i in range(9) if board[i] == "."]
        if w is not None:
            memo[board] = Fraction(w == "X")
        elif to_move(board, first) == "O":
            memo[board] = sum(my_chance_vs_random(board[:i] + "O" + board[i + 1:], first, val, memo) for i in free) / len(free)
        else:
            options = my_threats(board, "X") or my_best_moves(board, first, val)
            memo[board] = max(my_chance_vs_random(board[:i] + "X" + board[i + 1:], first, val, memo) for i in options)
    return memo[board]


def test_minimax_player_takes_immediate_wins_and_optimal_moves_in_one_style():
    # one style, the same for every seed: of its immediate wins (else optimal moves), the best chance to win
    # against a random opponent, then the first of centre, corners, edges
    env = ttt.load_environment()
    player = env.scripted_player("minimax")
    memo = {"X": {}, "O": {}}
    for board in sorted(POS_X | POS_O):
        if my_winner(board) is not None or board.count("X") > board.count("O"):
            continue
        replies = {player({"board": board, "seed": s}) for s in (5, 6, 7)}
        assert len(replies) == 1, (board, replies)
        cell = int(re.search(r"<move>(\d)</move>", replies.pop()).group(1))
        first = "X" if board.count("X") == board.count("O") else "O"
        val = VAL_X if first == "X" else VAL_O
        options = my_threats(board, "X") or my_best_moves(board, first, val)
        chance = {i: my_chance_vs_random(board[:i] + "X" + board[i + 1:], first, val, memo[first]) for i in options}
        best = [i for i in options if chance[i] == max(chance.values())]
        assert cell == min(best, key=[4, 0, 2, 6, 8, 1, 3, 5, 7].index), (board, cell, chance)
    # the style's point: from the empty board, X moving first wins 191/192 of the games against a random O
    # (centre first, then always the first optimal move in that order: 187/192), and 0.9164 moving second
    assert my_chance_vs_random(EMPTY, "X", VAL_X, memo["X"]) == Fraction(191, 192)
    assert ttt.chance_vs_random(EMPTY, True) == Fraction(191, 192)


def test_scripted_player_is_seeded_by_seed_and_board():
    env = ttt.load_environment()
    player = env.scripted_player("random")
    assert player({"board": EMPTY, "seed": 1}) == player({"board": EMPTY, "seed": 1})
    assert len({player({"board": EMPTY, "seed": s}) for s in range(60)}) == 9


@pytest.mark.parametrize("env_args", [{"max_turns": True}, {"num_groups": False}, {"opening": True},
                                      {"invalid_penalty": float("nan")}, {"max_random_move_prob": True}])
def test_booleans_and_nan_are_not_numbers(env_args):
    """JSON true/false are Python bools, which are ints: they must not pass as a number of turns or a probability."""
    import common
    with pytest.raises(SystemExit, match="bad --env_args for tictactoe"):
        common.load_env("tictactoe", env_args)


def test_play_against_a_model_in_the_terminal(monkeypatch, capsys):
    """python env_tictactoe.py: the policy plays X, the person O through input(); a taken cell is asked again; the
    game ends with the final board and its result."""
    import policies
    env = ttt.load_environment()
    asked = []

    def person(prompt):  # first a taken or unknown cell, then the first free cell offered
        asked.append(prompt)
        return "x" if len(asked) == 1 else prompt.split("[")[1].split(",")[0].rstrip("]")
    monkeypatch.setattr("builtins.input", person)
    ttt.play_human(policies.ScriptedPolicy(env, "minimax"), {"show_cells": True}, games=1)
    printed = capsys.readouterr().out
    assert "not a free cell, try again" in printed and "result: " in printed and "[model] <think>" in printed
    assert "You (X):" in printed  # the env_args reached the game
