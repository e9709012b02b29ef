"""Tests for env_tictactoe, the game: the solver, the seeded opponent, the scripted players, rewards and untrusted
replies (its research variants: test_env_tictactoe_lab.py).

CPU only, deterministic (fixed seeds everywhere, hypothesis derandomized), a few seconds in all.
"""
import copy
import inspect
import json
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from conftest import ROOT

import env_tictactoe as ttt

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

def scripted_game(model_moves, opponent_moves, model_first=True, max_turns=8, load=ttt.load_environment, **env_args):
    moves = iter(opponent_moves)
    env = load(max_turns=max_turns, opponent=lambda state: next(moves), **env_args)
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
])
def test_bad_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ttt.load_environment(**kwargs)


def test_unknown_argument_raises_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'opponent_strength'"):
        ttt.load_environment(opponent_strength=0.5)


def test_a_research_option_is_refused_naming_the_lab():
    """The research options are tictactoe_lab's (env_tictactoe_lab.py): the game refuses each, saying where it is, in
    one line from --env_args too; its scripted players are minimax and random, the rules teachers the lab's."""
    import common
    import env_tictactoe_lab as lab
    own = [name for name in inspect.signature(lab.load_environment).parameters if name not in inspect.signature(ttt.load_environment).parameters]
    assert {"puzzles", "show_wins", "check_reward", "replay_explore", "exploit_stop"} <= set(own)
    assert sorted(ttt.LAB_OPTIONS) == sorted(own)  # the game names them without importing the lab
    for name in own:
        with pytest.raises(TypeError, match=rf"^{name} is an option of tictactoe_lab \(env_tictactoe_lab.py\): --env tictactoe_lab$"):
            ttt.load_environment(**{name: 0.5})
    with pytest.raises(SystemExit) as e:
        common.load_env("tictactoe", '{"puzzles": 0.5}')
    said = str(e.value)
    assert said.startswith("bad --env_args for tictactoe: puzzles is an option of tictactoe_lab (env_tictactoe_lab.py): "
                           "--env tictactoe_lab; it accepts ['min_random_move_prob', ") and "\n" not in said
    assert list(inspect.signature(ttt.load_environment).parameters)[-1] == "player_random_prob"  # the game's, named
    with pytest.raises(ValueError, match="unknown scripted player 'rules': use 'minimax', 'random'"):
        ttt.load_environment().scripted_player("rules")


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
    """python play_tictactoe.py: the policy plays X, the person O through input(); a taken cell is asked again; the
    game ends with the final board and its result."""
    import play_tictactoe
    import policies
    env = ttt.load_environment()
    asked = []

    def person(prompt):  # first a taken or unknown cell, then the first free cell offered
        asked.append(prompt)
        return "x" if len(asked) == 1 else prompt.split("[")[1].split(",")[0].rstrip("]")
    monkeypatch.setattr("builtins.input", person)
    play_tictactoe.play_human(policies.ScriptedPolicy(env, "minimax"), {"show_cells": True}, games=1)
    printed = capsys.readouterr().out
    assert "not a free cell, try again" in printed and "result: " in printed and "[model] <think>" in printed
    assert "You (X):" in printed  # the env_args reached the game
