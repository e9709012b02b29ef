"""Tests for env_tictactoe_lab, the research variants built on the game (env_tictactoe): the lab without its options
is the game; puzzles, the rules teachers and their checks, show_wins, the extra rewards, the exploiter's replays
(from the mistake, explored, ranked by wins against a weak opponent, exploit_stop), its options' checks and CLI.

CPU only, deterministic, a few seconds in all.
"""
import inspect
import re
import subprocess
import sys
from collections import Counter

import pytest

from conftest import ROOT

import env_tictactoe as ttt
import env_tictactoe_lab as lab
from test_env_tictactoe import EMPTY, my_winner, scripted_game as game_of, total_reward


def scripted_game(model_moves, opponent_moves, **env_args):
    """test_env_tictactoe's game with scripted moves for both sides, on the lab."""
    return game_of(model_moves, opponent_moves, load=lab.load_environment, **env_args)


# ----------------------------------------------------------------------------- 1. the lab without its options is the game

def test_without_its_options_the_lab_plays_the_game():
    """Every option at its default: the same examples, messages, rewards, metrics, scripted replies, certificate and
    replays as env_tictactoe's, and the options of the game pass through (rl.py's num_groups default among them)."""
    game, labbed = ttt.load_environment(show_cells=True, opening=2), lab.load_environment(show_cells=True, opening=2)
    examples = game.examples(60, seed=3)
    assert labbed.examples(60, seed=3) == examples and labbed.reward_weights == game.reward_weights
    for name in ("minimax", "random"):
        game_player, lab_player = game.scripted_player(name, 0.3), labbed.scripted_player(name, 0.3)
        for ex in examples:
            (a, msg), (b, msg_lab) = game.reset(ex), labbed.reset(ex)
            while msg is not None:
                assert msg_lab == msg and lab_player(b) == game_player(a) and labbed.forced_reply(b, 1) is None
                reply = game_player(a)
                msg, msg_lab = game.step(a, reply), labbed.step(b, reply)
            assert msg_lab is None and labbed.rewards(b) == game.rewards(a) and labbed.metrics(b) == game.metrics(a)
    player = game.scripted_player("random")
    policy = lambda episodes: [player(ep["state"]) for ep in episodes]
    assert labbed.exploit(policy) == game.exploit(policy)
    assert set(inspect.signature(ttt.load_environment).parameters) < set(inspect.signature(lab.load_environment).parameters)
    import common
    assert common.load_env("tictactoe_lab", {}, defaults={"num_groups": 5}).num_groups == 5


# ----------------------------------------------------------------------------- 2. the research options

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
    assert env.reward_weights["optimal"] == 0.5 and "optimal" not in lab.load_environment().reward_weights
    env, state, _ = scripted_game([0, 8, 1], [4, 2, 6])
    assert "optimal" not in env.rewards(state)


def test_show_wins_states_where_each_side_could_complete_a_line():
    env, state, msgs = scripted_game([4, 8, 1], [0, 2, 3], show_cells=True, show_wins=True)
    assert msgs[0].endswith("6|7|8\nYou (X): none. Opponent (O): none.\nWins now: you none, opponent none.\n"
                            "Free cells: 0 1 2 3 4 5 6 7 8. Your move.")
    assert "You (X): 4 8. Opponent (O): 0 2.\nWins now: you none, opponent 1.\nFree cells: 1 3 5 6 7." in msgs[2]
    assert "You (X): 1 4 8. Opponent (O): 0 2 3.\nWins now: you 7, opponent 6.\n" in msgs[3]
    board = "O.X.X...X"  # two lines for X, through 5 and 6; the message says what the teacher's check says
    assert ttt.wins_check(board, "X") == "Wins: me 5 6, opponent none."
    only_wins = lab.load_environment(show_wins=True)._show({"board": board})
    assert only_wins.endswith("6|7|X\nWins now: you 5 6, opponent none.\nFree cells: 1 3 5 6 7. Your move.")
    assert "Wins now" not in lab.load_environment(show_cells=True)._show({"board": board})  # opt-in


def test_random_opening_plays_random_free_cells_for_x():
    """opening_player="random" (the rules recipe's SFT): the opening's X moves are random free cells, not the
    minimax player's, the game is never over, and the message is the one a minimax opening writes."""
    env = lab.load_environment(show_cells=True, opening=3, opening_player="random")
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
        lab.load_environment(opening_player="perfect")


@pytest.mark.parametrize("kind", ["block", "win", "threat"])
def test_puzzles_start_where_random_play_first_demands_the_kind_and_end_after_puzzle_turns(kind):
    """puzzles=p: about that share of the examples start where a line of legal moves first reached a position, X to
    move, that demands `kind` (block: O threatens one line, X has no win, and blocking is the only move that keeps
    the game's value; win: X has a win; threat: either), the moves listed as an opening's; the rest are the plain
    environment's examples; a puzzle is cut off after puzzle_turns replies, an ordinary game is not."""
    env = lab.load_environment(show_cells=True, puzzles=0.5, puzzle_kind=kind, puzzle_turns=1)
    plain = lab.load_environment(show_cells=True)
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
        assert not any(lab.demands(b, kind) for b in seen)  # the first such position of its line
        # one reply (a legal move that does not win) and the puzzle is over, cut off
        cell = ([c for c in ttt.free_cells(board) if c not in wins] or wins)[0]
        assert env.step(state, f"<think>a</think><move>{cell}</move>") is None and state["done"]
        assert state["cut_off"] or state["winner"] is not None
    assert 150 < sum(kinds.values()) < 250
    assert set(kinds) == {"block": {"block"}, "win": {"win"}, "threat": {"block", "win"}}[kind]
    for bad in ({"puzzles": 1.5}, {"puzzles": -0.1}, {"puzzle_kind": "fork"}, {"puzzle_turns": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            lab.load_environment(**bad)


def test_opening_puzzles_are_first_and_second_moves_that_can_lose_and_a_list_draws_a_kind_per_puzzle():
    """puzzle_kind="opening": X's first or second move of a random line (each about as often), where some move loses
    the position's value; a list of kinds draws one per puzzle, each about as often, and a one-kind list is that
    kind."""
    positions = [ex["position"] for ex in lab.load_environment(puzzles=1.0, puzzle_kind="opening").examples(600, seed=3)]
    for board in positions:
        assert board.count("O") - board.count("X") in (0, 1) and my_winner(board) is None and board.count("X") <= 1
        assert len(ttt.best_moves(board, "X")) < len(ttt.free_cells(board))  # a move that loses the value
    stones = Counter(9 - b.count(".") for b in positions)
    assert set(stones) == {1, 2, 3} and stones[1] > 150 and stones[2] > 150 and stones[3] > 100  # first moves: 1 stone
    env = lab.load_environment(puzzles=1.0, puzzle_kind=["block", "opening"])
    openings = sum(lab.demands(ex["position"], "opening") and not lab.demands(ex["position"], "block")
                   for ex in env.examples(400, seed=3))
    assert 150 < openings < 250
    assert all(lab.demands(ex["position"], "block") or lab.demands(ex["position"], "opening") for ex in env.examples(400, seed=3))
    one = lab.load_environment(puzzles=0.5, puzzle_kind=["threat"]).examples(100, seed=3)
    assert one == lab.load_environment(puzzles=0.5, puzzle_kind="threat").examples(100, seed=3)
    for bad in ([], ["fork"], ["block", "fork"], "fork", ("block",)):
        with pytest.raises(ValueError, match="puzzle_kind"):
            lab.load_environment(puzzle_kind=bad)


def test_second_puzzles_are_second_moves_that_can_lose_after_an_optimal_first_move():
    """puzzle_kind="second": X's second move, where some move loses the position's value, on a line whose X move
    was optimal (O's random): the positions a good first move leads to, a centre reply to a corner opening among
    them, which "opening" puzzles (their X move random) rarely reach."""
    examples = lab.load_environment(puzzles=1.0, puzzle_kind="second").examples(600, seed=3)
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
    opening = lab.load_environment(puzzles=1.0, puzzle_kind="opening").examples(600, seed=3)
    centre_after_corner_opening = sum(not ex["model_first"] and ex["position"].count("X") == 1 and ex["position"][4] == "X"
                                      and ex["replies"][EMPTY] in ttt.CORNERS for ex in opening)
    assert centre_after_corner > 100 and centre_after_corner > 5 * centre_after_corner_opening


def test_start_puzzles_are_a_games_first_two_replies_against_a_random_opponent():
    """puzzle_kind="start": no position; the game's own messages from the empty board, the opponent uniformly
    random, cut off after X's second reply (not before), each side starting about as often."""
    env = lab.load_environment(show_cells=True, puzzles=1.0, puzzle_kind="start", optimal_reward=1.0)
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
    player = lab.load_environment().scripted_player("random")
    policy = lambda episodes: [player(ep["state"]) for ep in episodes]
    summary, _, replays = lab.load_environment(show_cells=True).exploit(policy)
    assert lab.load_environment(show_cells=True, puzzles=1.0).exploit(policy) == (summary, _, replays)
    assert all(opts["puzzles"] == 0.0 for opts in lab.EVAL_SETTINGS.values())


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
    for rank in lab.EXPLOIT_RANKS:
        env = lab.load_environment(exploit_rank=rank)
        ranks[rank] = {name: env.exploit(p)[1] for name, p in (("minimax", minimax), ("plain", plain), ("first", first_free))}
    by_mistakes, by_wins = ranks["mistakes"], ranks["random_wins"]
    assert by_mistakes["minimax"] == by_mistakes["plain"] == (0, 0) and by_mistakes["first"][0] > 0
    assert by_wins["minimax"] < by_wins["plain"] < by_wins["first"]
    assert by_wins["minimax"][0] == by_wins["plain"][0] == 0 and -1 < by_wins["minimax"][1] < by_wins["plain"][1] < 0
    with pytest.raises(ValueError, match="exploit_rank"):
        lab.load_environment(exploit_rank="wins")


@pytest.mark.parametrize("first", [True, False])
def test_exploit_replays_from_the_mistake_start_at_its_position(first):
    """replay_from="mistake": each of the exploit hook's replays starts at the board where the policy erred, X to
    move, its moves so far listed; those moves are the line's (the same board reached by replaying from the empty
    board with replay_from="start"), and the opponent goes on with the line's replies then optimal play."""
    from_start = lab.load_environment(show_cells=True)
    from_mistake = lab.load_environment(show_cells=True, replay_from="mistake")
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
        lab.load_environment(replay_from="middle")


def test_replay_explore_forces_other_moves_at_the_mistake():
    """replay_explore: the exploit hook's replays carry the mistake's board; there, the odd rollouts of a group
    get a forced reply (in the named player's words, a true check, each free cell in turn from one the seed picks),
    the even ones and every other board none; without replay_explore the replays are as before."""
    env = lab.load_environment(show_cells=True, show_wins=True, replay_explore="rules_wins")
    player = env.scripted_player("random")
    policy = lambda episodes: [player(ep["state"]) for ep in episodes]
    _, _, replays = env.exploit(policy)
    _, _, plain = lab.load_environment(show_cells=True, show_wins=True).exploit(policy)
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
    assert all(ttt.is_well_formed(f) and lab.states_the_wins(f, state["board"]) for f in forced)
    assert forced[0] == lab.scripted_reply("rules_wins", state["board"], cells[0])
    env.step(state, forced[0])
    assert env.forced_reply(state, 1) is None
    with pytest.raises(ValueError, match="replay_explore"):
        lab.load_environment(replay_explore="teacher")


def test_rules_player_knows_the_format_and_the_rules_only():
    """The 'rules' player (speedrun.sh TEACHER=rules): a legal move, a <think> that lists the free cells and names
    the move, and no strategy: where it can win at once it does so no more often than a random free cell would."""
    env = lab.load_environment(show_cells=True)
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
    env = lab.load_environment(show_cells=True)
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
    env = lab.load_environment(show_cells=True)
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
            assert lab.states_the_wins(reply, board)
            if promised is not None:  # the opponent's reply took at most one of them, and made none
                assert set(promised) - set(ttt.threats(board, "X")) <= {c for c in range(9) if board[c] == "O"}
                assert set(ttt.threats(board, "X")) <= set(promised)
                copied += bool(promised)
            promised = then
            env.step(state, reply)
    assert copied > 50
    board = "X...O.O.."  # O wins at 2; after X 2, X could complete a line at 1
    right = "<think>Wins: me none, opponent 2. Free cells: 1 2 3 5 7 8. I take cell 2. Then: me 1.</think><move>2</move>"
    assert lab.states_the_wins(right, board)
    for wrong in (right.replace("me 1.", "me 1 3."), right.replace("me 1.", "me none."), right.replace("<move>2", "<move>8"),
                  right.replace("<move>2", "<move>4")):  # one too many, none, another move's list, an invalid move
        assert not lab.states_the_wins(wrong, board), wrong


def test_check_reward_scores_the_true_wins_statements_only():
    """check_reward: the share of replies whose <think> begins with the true `Wins:` statement, weighted into the
    total; off (no "check" component, the class's weights) by default."""
    board = "XX.OO...."  # X wins at 2, O at 5
    assert lab.states_the_wins("<think>Wins: me 2, opponent 5. Free cells: 2 5 6 7 8. I take cell 2.</think><move>2</move>", board)
    for wrong in ("<think>Wins: me none, opponent 5. I block.</think><move>5</move>",   # a win missed
                  "<think>Wins: me 2 5, opponent 5.</think><move>2</move>",            # one too many
                  "<think>Wins: me 5, opponent 2.</think><move>2</move>",              # the sides swapped
                  "<think>I take cell 2. Wins: me 2, opponent 5.</think><move>2</move>",  # not where it begins
                  "Wins: me 2, opponent 5.<move>2</move>"):
        assert not lab.states_the_wins(wrong, board), wrong
    env = lab.load_environment(show_cells=True, check_reward=0.5)
    assert env.reward_weights["check"] == 0.5 and "check" not in lab.load_environment().reward_weights
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
    assert "check" not in lab.load_environment(show_cells=True).rewards(state)


def test_missed_win_penalty_costs_a_stated_win_not_taken():
    """missed_win_penalty: minus the share of replies whose `Wins:` check names a win of X's and whose move is
    elsewhere; a stated win taken, a check naming none, or an invalid move costs nothing; off by default."""
    env = lab.load_environment(show_cells=True, max_turns=2, missed_win_penalty=0.5)
    assert env.reward_weights["missed_win"] == 0.5 and "missed_win" not in lab.load_environment().reward_weights
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
    assert "missed_win" not in lab.load_environment(show_cells=True).rewards(env.reset(example)[0])


# ----------------------------------------------------------------------------- 3. bad options, the recipe's checks

@pytest.mark.parametrize("kwargs,error,says", [
    ({"show_wins": 1}, ValueError, "show_wins"),
    ({"check_reward": -1}, ValueError, "check_reward"),
    ({"loss_penalty": float("nan")}, ValueError, "loss_penalty"),
    ({"optimal_reward": "high"}, ValueError, "optimal_reward"),
    ({"missed_win_penalty": True}, ValueError, "missed_win_penalty"),
    ({"exploit_stop": "yes"}, ValueError, "exploit_stop"),
    ({"max_turns": 0}, ValueError, "max_turns"),  # the game's options are checked as in the game
    ({"opponent_strength": 0.5}, TypeError, "unexpected keyword argument 'opponent_strength'"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, error, says):
    with pytest.raises(error, match=says):
        lab.load_environment(**kwargs)


def test_unknown_scripted_player():
    with pytest.raises(ValueError, match="unknown scripted player 'perfect': use 'minimax', 'random', 'rules', 'rules_wins', 'rules_then'"):
        lab.load_environment().scripted_player("perfect")


def test_play_a_lab_model_in_the_terminal(monkeypatch, capsys):
    """python play_tictactoe.py --env tictactoe_lab: the game in the terminal, with the lab's options (show_wins)."""
    import play_tictactoe
    import policies
    monkeypatch.setattr("builtins.input", lambda prompt: prompt.split("[")[1].split(",")[0].rstrip("]"))  # the first free cell
    env = lab.load_environment(show_wins=True)
    play_tictactoe.play_human(policies.ScriptedPolicy(env, "rules_wins"), {"show_wins": True}, games=1,
                              load=lab.load_environment)
    printed = capsys.readouterr().out
    assert "Wins now: you none, opponent none." in printed and "[model] <think>Wins: me " in printed and "result: " in printed


def test_the_random_teacher_checks_answer_by_exit_status(tmp_path):
    """env_tictactoe_lab.py --puzzle_learnt METRICS UNTIL (exit 0: the solver reward's mean over the last 10 steps is
    at least UNTIL) and --lost_lines CERT (exit 0: the certificate loses a line), each saying what it found."""
    import json
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "exploit_lines_lost": 3}] + [{"step": s, "reward_optimal": 0.1 if s <= 5 else 0.9} for s in range(1, 16)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    check = lambda *flags: subprocess.run([sys.executable, "env_tictactoe_lab.py", *flags], cwd=ROOT, capture_output=True, text=True)
    learnt, not_learnt = check("--puzzle_learnt", str(metrics), "0.9"), check("--puzzle_learnt", str(metrics), "0.95")
    assert learnt.returncode == 0 and not_learnt.returncode == 1  # steps 6-15: 0.9 each
    assert "the block stage at step 15: solver reward 0.900 over its last 10 steps (until 0.9)" in learnt.stdout
    for lost, status in ((3, 0), (0, 1)):
        (tmp_path / "certificate.json").write_text(json.dumps({"lines_lost": lost, "mistake_positions": []}))
        proc = check("--lost_lines", str(tmp_path / "certificate.json"))
        assert proc.returncode == status and f"the third stage's best certificate: {lost} lost lines" in proc.stdout
