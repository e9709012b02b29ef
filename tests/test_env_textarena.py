"""TextArena's single-player games (env_textarena.py, textarena==0.7.4 from requirements-test.txt): the contract,
the games that work and the ones refused, episodes that play the same interleaved or alone (the library draws from
the process-global `random`), untrusted replies, the scripted players, and rl.py / eval.py on a game."""
import copy
import itertools
import json
import os
import random
import re
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import common
import env_textarena as et
from conftest import play, run_main
from policies import make_policy
from sample import rollout

GTN = "GuessTheNumber-v0"
ONE_PER_FAMILY = {}  # the cheapest-to-start game of each working family
for _game in et.WORKING_GAMES:
    if _game not in ("Sudoku-v0-very-easy", "Sudoku-v0-hard", "Sokoban-v0-medium"):  # Sudoku-v0-easy; slow resets
        ONE_PER_FAMILY.setdefault(et.family(_game), _game)


def load(game=GTN, **kw):
    return et.TextArena(game=game, **kw)


# ----------------------------------------------------------------------------- the contract


def test_examples_are_deterministic_json_clean_rows():
    env = load()
    rows = env.examples(6, seed=3)
    assert rows == env.examples(6, seed=3) and rows != env.examples(6, seed=4)
    assert json.loads(json.dumps(rows)) == rows
    assert all(set(r) == {"seed", "game"} and isinstance(r["seed"], int) and r["game"] == GTN for r in rows)
    assert len({r["seed"] for r in rows}) == 6
    with pytest.raises(ValueError, match="an example of 'TowerOfHanoi-v0'"):
        env.reset({"seed": 1, "game": "TowerOfHanoi-v0"})


def test_the_first_message_is_the_games_own_prompt_and_later_ones_only_whats_new():
    env = load()
    assert "GuessTheNumber-v0" in env.system_prompt and "[12]" in env.system_prompt
    state, first = env.reset({"seed": 7})
    assert first.startswith("[GAME] You are Player 0. You are playing Guess The Number.") and "between 1 and 20" in first
    target = state["env"].game_number
    message = env.step(state, "I think it is [1]" if target != 1 else "[2]")
    assert message in ("[GAME] The target number is higher.", "[GAME] The target number is lower.")  # no echo, no history
    assert env.step(state, f"<think>so</think> [{target}]") is None
    assert env.rewards(state) == {"game": 1.0, "format": 1.0}
    assert env.metrics(state) == {"win": 1.0, "finished": 1.0, "cut_off": 0.0, "n_invalid": 0, "n_turns": 2, "format": 1.0}
    assert env.step(state, "[3]") is None and state["turns"] == 2  # after the end: nothing changes
    assert "Congratulations" in env.describe(state)


def test_invalid_moves_are_counted_and_the_second_in_a_row_ends_the_game():
    env = load()
    state, _ = env.reset({"seed": 7})
    g, h = [n for n in range(1, 21) if n != state["env"].game_number][:2]
    assert "[GAME] The target number is" in env.step(state, f"[{g}]")
    assert "invalid move" in env.step(state, "no brackets")  # one retry allowed
    assert state["invalid"] == 1 and not state["done"]
    assert "[GAME] The target number is" in env.step(state, f"then [{h}]")
    assert "already guessed" in env.step(state, f"[{g}]")
    assert env.step(state, f"again [{g}]") is None  # the second invalid move in a row: the game is over
    rewards, metrics = env.rewards(state), env.metrics(state)
    assert metrics["n_invalid"] == 3 and metrics["finished"] == 1.0 and metrics["win"] == 0.0 and metrics["n_turns"] == 5
    assert 0.0 <= rewards["game"] < 1.0 and rewards["format"] == 4 / 5  # the game's own partial score


def test_max_turns_is_the_games_limit_and_an_argument_cuts_episodes():
    assert load("TowerOfHanoi-v0").max_turns == 30 and load().max_turns == 22 and load("2048-v0-ultra-easy").max_turns == et.NO_LIMIT_TURNS
    env = load(max_turns=2)
    state, _ = env.reset({"seed": 7})
    g, h = [n for n in range(1, 21) if n != state["env"].game_number][:2]
    assert env.step(state, f"[{g}]") is not None and env.step(state, f"[{h}]") is None
    assert env.metrics(state)["finished"] == 0.0 and "cut off" in state["reason"]
    target = state["env"].game_number  # the credit the game gives at its own turn limit: the last guess's closeness
    assert env.rewards(state)["game"] == 1 - abs(h - target) / 19


@pytest.mark.parametrize("args,match", [
    ({"max_turns": 0}, "max_turns=0"), ({"max_turns": True}, "max_turns=True"), ({"max_turns": 2.5}, "max_turns=2.5"),
    ({"game": 5}, "game=5: must be a TextArena game id"), ({"game": "Nope-v0"}, "not a registered TextArena game"),
    ({"game": "TicTacToe-v0"}, "not one of TextArena's single-player games"),
    ({"game": "GuessTheNumber-v0-raw"}, "without its wrapper suffix"),
])
def test_bad_arguments_raise_naming_them(args, match):
    with pytest.raises(ValueError, match=match):
        et.TextArena(**args)
    with pytest.raises(SystemExit, match="bad --env_args for textarena"):
        common.load_env("textarena", args)


@pytest.mark.parametrize("fam", sorted(et.REFUSED))
def test_refused_games_name_the_reason_and_the_games_that_work_without_importing_them(fam):
    game = next(g for g in et.REFUSED_GAMES if et.family(g) == fam)
    with pytest.raises(SystemExit) as e:
        common.load_env("textarena", {"game": game})
    said = str(e.value)
    assert said.startswith(f"bad --env_args for textarena: game={game!r} is refused: {fam} ")
    assert ("nltk" in said) == (et.REFUSED[fam] == et.NLTK) and GTN in said and "TowerOfHanoi-v0" in said
    assert f"textarena.envs.{fam}.env" not in sys.modules  # never imported: no download is ever tried


def test_a_missing_textarena_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # `import textarena` now fails as if not installed
    monkeypatch.delitem(sys.modules, "env_textarena")  # restored after the test
    with pytest.raises(SystemExit, match="env_textarena.py imports 'textarena', which is not installed"):
        common.load_env("textarena", {"game": GTN})


@pytest.mark.parametrize("game", sorted(ONE_PER_FAMILY.values()))
def test_every_working_family_plays_copies_and_scores_in_range(game):
    env = load(game)
    example = et.FAMILIES[env.family][2]
    replies = [example, "hello", example, "[1]", "[up]", "[A B]", example, "[2 3]"]
    for row in env.examples(2, seed=11):
        state, first = env.reset(row)
        assert first.startswith("[GAME] ")
        for i, reply in enumerate(replies):
            if i == 2:  # a deep copy goes on exactly as the original, apart from it
                twin = copy.deepcopy(state)
                rest = [env.step(twin, r) for r in replies[i:]]
                assert twin["env"] is not state["env"]
            message = env.step(state, reply)
            assert message is None or (isinstance(message, str) and message.startswith("[GAME] "))
            if i >= 2:
                assert message == rest[i - 2]
        rewards, metrics = env.rewards(state), env.metrics(state)
        assert -1.0 <= rewards["game"] <= 1.0 and 0.0 <= rewards["format"] <= 1.0 and set(rewards) == set(env.reward_weights)
        assert metrics["win"] == float(rewards["game"] == 1.0)
        assert json.loads(json.dumps(metrics)) == metrics and metrics["n_invalid"] <= metrics["n_turns"]
        assert state["reason"] is None or "the library raised" not in state["reason"]


# ----------------------------------------------------------------------------- rewards: range, wins, cut-offs


def a_set(state):
    """The first Set on the board (the library's own test of three cards)."""
    from textarena.envs.Set.env import _is_set
    board = state["env"].state.game_state["board"]
    i, j, k = next(c for c in itertools.combinations(range(len(board)), 3) if _is_set([board[i] for i in c]))
    return f"[{i + 1}, {j + 1}, {k + 1}]"


def crossword_letter(state):
    game = state["env"].state.game_state
    r, c = next((r, c) for r, row in enumerate(game["board"]) for c, cell in enumerate(row) if cell == "_")
    return f"[{r} {c} {game['solution'][r][c]}]"


def sudoku_digit(state):
    env = state["env"]
    r, c = next((r, c) for r, row in enumerate(env.state.game_state["board"]) for c, cell in enumerate(row) if not cell)
    return f"[{r + 1} {c + 1} {env.full_grid[r][c]}]"


def safe_cell(state):
    env = state["env"]
    return "[{} {}]".format(*next((r, c) for r in range(env.rows) for c in range(env.cols)
                                  if env.grid[r][c] != -1 and not env.revealed[r][c]))


def logic_mark(state):
    grid = next(iter(state["env"].game_board_solution.values()))
    row, marks = next(iter(grid.items()))
    return "[{} {} {}]".format(row, *next(iter(marks.items())))


PLAY_ON = {  # replies (or a function of the state giving one) that leave each game going, most making progress
    "2048-v0-ultra-easy": ["[left]", "[down]", "[right]", "[down]"],
    "Bandit-v0": ["[red]", "[blue]"],
    "Blackjack-v0": ["[stand]", "[stand]"],
    "Countdown-v0": ["[0 1 +]"],
    "Crosswords-v0": [crossword_letter],
    "Cryptarithm-v0": ["[S 9]", "[E 5]"],
    "FrozenLake-v0": [lambda state: "[down]" if state["env"].state.game_state["grid"][0][1] == "H" else "[right]"],
    "GuessTheNumber-v0": [lambda state: f"[{state['env'].game_number % 20 + 1}]"],
    "LightsOut-v0": ["[0 0]", "[2 2]"],
    "LogicPuzzle-v0": [logic_mark],
    "Mastermind-v0": ["[1 2 3 4]"],
    "Minesweeper-v0": ["[3 3]", safe_cell],
    "PegJump-v0": ["[12 5]", "[3 8]"],
    "RushHour-v0": ["[X+]"],
    "Secretary-v0": ["[continue]"],
    "Set-v0": [a_set],
    "Slitherlink-v0": ["[h 0 0]"],
    "Sokoban-v0": [lambda state: next(f"[{d}]" for d in ("up", "down", "left")
                                      if not state["env"]._would_collide_with_wall(d))],
    "Sudoku-v0-easy": [sudoku_digit],
    "ThreeCardMonte-v0": ["[7]"],
    "TowerOfHanoi-v0": ["[A C]", "[A B]", "[C B]", "[A C]"],
}
# the families whose game ended by two invalid moves gets a penalty (-1; Set 0) rather than its partial credit
QUIT_PENALISED = {"Bandit", "Countdown", "Cryptarithm", "Secretary", "Set", "Slitherlink", "ThreeCardMonte"}


@pytest.mark.parametrize("game", sorted(ONE_PER_FAMILY.values()))
def test_a_cut_off_game_scores_what_the_game_gives_there_never_below_quitting(game):
    """A game cut off at max_turns gets the partial credit the game itself gives at its own turn limit: exactly what
    quitting there with two invalid moves gets where that keeps the credit, never less (2048 once scored a cut-off
    0, below an early quit)."""
    replies, fam = PLAY_ON[game], et.family(game)
    envs = {"cut": load(game, max_turns=len(replies)), "quit": load(game)}
    for row in envs["quit"].examples(2, seed=3):
        score = {}
        for how, env in envs.items():
            state, _ = env.reset(row)
            for reply in replies + (["", ""] if how == "quit" else []):  # the second invalid move in a row ends it
                env.step(state, reply(state) if callable(reply) else reply)
            if how == "quit":  # ended by the invalid moves, not before
                assert state["finished"] and state["turns"] > len(replies)
            else:
                assert not state["finished"] and state["turns"] == len(replies)
            assert state["done"] and not state["solved"]
            score[how] = env.rewards(state)["game"]
        assert score["cut"] == score["quit"] if fam not in QUIT_PENALISED else score["cut"] >= score["quit"]
        assert score["cut"] == (et.bounded(et.CREDIT[fam](state["env"])) if fam in et.CREDIT else 0.0)


def test_set_scores_its_sets_out_of_20_wins_only_with_all_20_and_one_card_thrice_is_invalid():
    env = load("Set-v0")
    state, _ = env.reset({"seed": 4})
    assert env.step(state, a_set(state)) is not None and state["env"].state.game_state["score"] == 1
    assert "the same card three times is not a Set" in env.step(state, "[2, 2, 2]")  # the library scores it a Set
    assert env.step(state, "[5, 5, 5]") is None and state["invalid"] == 2  # the second in a row ends the game
    assert env.rewards(state)["game"] == 0.0 and env.metrics(state)["win"] == 0.0  # Set's invalid-move end: 0
    _, rewards, metrics = play(env, {"seed": 4}, ["[1, 1, 1]"] * 20)
    assert rewards["game"] == 0.0 and metrics["n_turns"] == 2  # the library alone: 20 points
    cut = load("Set-v0", max_turns=1)
    state, _ = cut.reset({"seed": 4})
    assert cut.step(state, a_set(state)) is None  # one set found, then cut off
    assert cut.rewards(state)["game"] == 1 / 20 and cut.metrics(state)["win"] == 0.0
    state, _ = env.reset({"seed": 4})
    state["env"].state.game_state.update(score=18, num_turns=18)  # two turns before the end, 18 sets found
    env.step(state, "[1, 2, 3]" if a_set(state) != "[1, 2, 3]" else "[1, 2, 4]")  # not a Set: 18 of 20
    env.step(state, a_set(state))
    assert env.rewards(state)["game"] == 19 / 20 and env.metrics(state)["win"] == 0.0 and state["finished"]
    state, _ = env.reset({"seed": 4})
    state["env"].state.game_state.update(score=19, num_turns=19)
    assert env.step(state, a_set(state)) is None  # a set on each of the 20 turns
    assert env.rewards(state)["game"] == 1.0 and env.metrics(state)["win"] == 1.0


def test_bandit_pays_the_chosen_buttons_mean_over_the_best_and_wins_only_with_the_best():
    env = load("Bandit-v0")
    state, _ = env.reset({"seed": 2})
    means = state["env"].state.game_state["ground_truth"]
    scores = {}
    for button in means:
        _, rewards, metrics = play(env, {"seed": 2}, ["[red]"] * 20 + [f"[{button}]"])
        assert metrics["finished"] == 1.0 and metrics["win"] == float(means[button] == max(means.values()))
        scores[button] = rewards["game"]
    assert sorted(scores, key=scores.get) == sorted(means, key=means.get)  # the library's regret pays the worst most
    assert scores == pytest.approx({button: mean / max(means.values()) for button, mean in means.items()})


def test_2048_wins_only_with_the_target_tile_and_scores_a_lost_game_below_it():
    env = load("2048-v0")
    state, _ = env.reset({"seed": 1})
    board = state["env"].state.game_state["board"]  # a 1024 tile and 10,000 points: the library's credit is 1.0
    board[:] = [[1024, 512, 256, 128], [4, 8, 16, 32], [2, 4, 8, 16], [4, 2, 4, 2]]
    state["env"].state.game_state["score"] = 10_000
    assert env.step(state, "no move") is not None and env.step(state, "no move") is None
    assert state["env"].close()[0][0] == 1.0
    assert env.rewards(state)["game"] == 0.75 and env.metrics(state)["win"] == 0.0
    env = load("2048-v0-ultra-easy")
    state, _ = env.reset({"seed": 1})
    state["env"].state.game_state["board"][:] = [[16, 16, 0, 0], [0] * 4, [0] * 4, [0] * 4]
    assert env.step(state, "[left]") is None and env.rewards(state)["game"] == 1.0 and env.metrics(state)["win"] == 1.0


def test_blackjack_counts_a_draw_half_at_the_end_as_when_quitting():
    env = load("Blackjack-v0")
    _, rewards, metrics = play(env, {"seed": 5}, ["[stand]"] * 5)  # 1 won, 1 drawn, 3 lost
    assert metrics["finished"] == 1.0 and rewards["game"] == 1.5 / 5  # the library: 1 / 5, below quitting at hand 5


def test_cryptarithm_gives_no_credit_for_letters_given_wrong_digits():
    env = load("Cryptarithm-v0")
    assignments = ["[S 9]", "[E 5]", "[N 6]", "[D 7]", "[M 1]", "[O 0]", "[R 8]"]
    _, rewards, metrics = play(env, {"seed": 1}, assignments + ["[Y 3]"])  # complete but wrong (Y is 2)
    assert metrics["finished"] == 1.0 and rewards["game"] == 0.0 and metrics["win"] == 0.0
    _, rewards, metrics = play(load("Cryptarithm-v0", max_turns=7), {"seed": 1}, assignments)
    assert rewards["game"] == 0.0 and metrics["finished"] == 0.0  # the library's own turn limit: 7 / 8
    _, rewards, metrics = play(env, {"seed": 1}, ["[S 9]"] * 101)  # to the library's own turn limit
    assert metrics["finished"] == 1.0 and rewards["game"] == 0.0
    _, rewards, metrics = play(env, {"seed": 1}, assignments + ["[Y 2]"])
    assert rewards["game"] == 1.0 and metrics["win"] == 1.0


def most_lights_on(state):
    """The press that turns the most lights on."""
    grid = state["env"].state.game_state["grid"]

    def dark(r, c):
        return sum(0 <= r + dr < 5 and 0 <= c + dc < 5 and not grid[r + dr][c + dc]
                   for dr, dc in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)))
    return "[{} {}]".format(*max(itertools.product(range(5), repeat=2), key=lambda cell: dark(*cell)))


def test_lights_out_with_more_lights_on_than_at_the_start_scores_no_less_than_minus_1():
    env = load("LightsOut-v0")
    state, _ = env.reset({"seed": 3})
    while env.step(state, most_lights_on(state)) is not None:
        pass
    assert state["env"].close()[0][0] < -1.0 and env.rewards(state)["game"] == -1.0  # the library: -1.2


def test_slitherlink_clues_met_without_a_loop_are_not_a_solve():
    edges = ["[h 0 1]", "[h 0 3]", "[h 1 3]", "[h 3 0]", "[h 3 2]", "[h 4 1]", "[h 4 3]",
             "[v 0 0]", "[v 0 2]", "[v 1 0]", "[v 2 3]", "[v 3 0]", "[v 3 3]"]
    env = load("Slitherlink-v0", max_turns=len(edges))
    state, _ = env.reset({"seed": 11})
    for edge in edges:
        env.step(state, edge)
    assert state["env"]._progress() == 1.0 and not state["env"]._is_solved()  # every clue met, no single loop
    assert env.rewards(state)["game"] == et.UNSOLVED_MAX < 1.0 and env.metrics(state)["win"] == 0.0
    assert env.score(state["env"], 1.0) == (et.UNSOLVED_MAX, False)  # the library's reward at its own turn limit


@pytest.mark.parametrize("game", sorted(ONE_PER_FAMILY.values()))
def test_random_replies_score_in_range_and_win_only_on_a_solve(game):
    env = load(game)
    own = [r for r in PLAY_ON[game] if isinstance(r, str)] + [et.FAMILIES[env.family][2]]
    pool = own * 10 + [r for r in sum(PLAY_ON.values(), []) if isinstance(r, str)] + [""]  # the game's own moves mostly
    for row in env.examples(2, seed=8):
        rng = random.Random(row["seed"])
        _, rewards, metrics = play(env, row, [rng.choice(pool) for _ in range(40)])
        assert -1.0 <= rewards["game"] <= 1.0 and metrics["win"] == float(rewards["game"] == 1.0)


# ----------------------------------------------------------------------------- the global random state


KEEP_PLAYING = {  # replies that keep each game going for a while
    "Bandit-v0": ["[red]", "[blue]", "[green]", "[yellow]", "[purple]"] * 4,
    "2048-v0-ultra-easy": ["[up]", "[left]", "[down]", "[right]"] * 5,
    "Blackjack-v0": ["[hit]", "[stand]", "[stand]"] * 6,
    "Minesweeper-v0-small": [f"[{r} {c}]" for r in (0, 4, 2, 1, 3) for c in (0, 4, 2, 1, 3)],
    GTN: [f"[{n}]" for n in (10, 5, 15, 3, 8, 12, 18, 1, 20, 7)],
}


def library_alone(game, seed, replies, max_turns):
    """The messages of a game played straight on the library, nothing else drawing from `random` meanwhile."""
    import textarena as ta
    saved = random.getstate()
    env = ta.make(game + "-raw")
    env.reset(num_players=1, seed=seed)
    messages = [et.game_lines(env.get_observation()[1])]
    for reply in replies[:max_turns]:
        done, _ = env.step(reply)
        messages.append(None if done else et.game_lines(env.get_observation()[1]) or "[GAME] Your move.")
        if done:
            break
    random.setstate(saved)
    return messages


@pytest.mark.parametrize("game", KEEP_PLAYING)
def test_interleaved_episodes_play_exactly_as_each_alone(game):
    """The rollout loop steps many episodes turn by turn; TextArena draws from the global `random` (Bandit's rewards,
    2048's new tiles, Blackjack's cards, Minesweeper's mines at the first reveal). Each episode alone, then all of
    them interleaved, in reverse order, with other code drawing from `random` in between: the same games."""
    env, replies = load(game), KEEP_PLAYING[game]
    rows = env.examples(6, seed=2)
    alone = [play(env, row, replies) for row in rows]
    episodes = [env.reset(row) for row in reversed(rows)]
    transcripts = [[first] for _, first in episodes]
    for reply in replies:
        for (state, _), transcript in zip(episodes, transcripts):
            random.random()
            if transcript[-1] is not None:
                transcript.append(env.step(state, reply))
    together = [(t, env.rewards(s), env.metrics(s)) for (s, _), t in zip(episodes, transcripts)][::-1]
    assert together == alone
    assert [a[0] for a in alone] == [library_alone(game, row["seed"], replies, env.max_turns) for row in rows]  # the library's own games
    assert len({json.dumps(a) for a in alone}) > 1 and max(len(a[0]) for a in alone) > 4  # different, long games


def test_the_callers_random_state_is_left_as_it_was_even_when_the_library_raises():
    env, saved = load("Bandit-v0"), random.getstate()
    random.seed(123)
    before = random.getstate()
    state, _ = env.reset({"seed": 5})  # TextArena's reset calls random.seed(5)
    env.step(state, "[red]")
    assert random.getstate() == before

    def broken(action):
        random.random()
        raise RuntimeError("a bug in the library")
    state["env"].step = broken
    assert env.step(state, "[red]") is None and random.getstate() == before
    assert env.rewards(state)["game"] == et.LOSS and env.metrics(state)["finished"] == 0.0
    assert "the library raised RuntimeError: a bug in the library" in env.describe(state)
    random.setstate(saved)


# ----------------------------------------------------------------------------- untrusted replies


class Unprintable:
    def __str__(self):
        raise RuntimeError("no")


ENVS = {}


def check_never_raises(game, replies):
    env = ENVS.setdefault(game, load(game))
    state, _ = env.reset({"seed": 1})
    for reply in replies:
        message = env.step(state, reply)
        assert message is None or isinstance(message, str)
    rewards, metrics = env.rewards(state), env.metrics(state)
    assert -1.0 <= rewards["game"] <= 1.0 and 0.0 <= rewards["format"] <= 1.0
    assert 0 <= metrics["n_invalid"] <= metrics["n_turns"] <= len(replies)
    assert state["reason"] is None or "the library raised" not in state["reason"]


@settings(derandomize=True, max_examples=60, deadline=None, database=None)
@given(st.sampled_from([GTN, "TowerOfHanoi-v0", "Bandit-v0", "Mastermind-v0"]),
       st.lists(st.text(alphabet=st.sampled_from(list("[] 0123456789ABCabc,-+up\n١")) | st.characters(), max_size=40)
                | st.none() | st.integers() | st.binary(), min_size=1, max_size=6))
def test_step_never_raises_property(game, replies):
    check_never_raises(game, replies)


def test_huge_and_strange_replies_are_fast():
    huge = ["[" * 3_000_000, "[" + "9" * 100_000 + "]", "[" * 5000 + "]" * 5000, "9" * 3_000_000 + "[5]",
            "\ud800" * 100_000, "[١٢]" * 10_000]
    for game in (GTN, "Bandit-v0", "Mastermind-v0", "Countdown-v0"):
        t0 = time.perf_counter()
        check_never_raises(game, huge)
        assert time.perf_counter() - t0 < 2.0, game
    check_never_raises(GTN, [None, 10**5000, b"[5]", ["[5]"], Unprintable(), "\ud800[5]"])


# ----------------------------------------------------------------------------- scripted players


@pytest.mark.parametrize("game,player,most", [(GTN, "bisect", 5), ("GuessTheNumber-v0-hardcore", "bisect", 6),
                                              ("TowerOfHanoi-v0", "hanoi", 7), ("TowerOfHanoi-v0-medium", "hanoi", 15)])
def test_the_scripted_players_always_win_in_the_fewest_moves(game, player, most):
    env = load(game)
    records = rollout(env, env.examples(20, seed=1), make_policy(player, env), progress=False)
    assert all(r["rewards"] == {"game": 1.0, "format": 1.0} and r["metrics"]["n_invalid"] == 0 for r in records)
    turns = [r["metrics"]["n_turns"] for r in records]
    assert max(turns) <= most and (min(turns) == most if player == "hanoi" else min(turns) < most)


def test_random_moves_of_the_scripted_players_are_reproducible_and_legal():
    env = load("TowerOfHanoi-v0")
    player = env.scripted_player("hanoi", random_move_prob=1.0)
    runs = []
    for _ in range(2):
        state, _ = env.reset({"seed": 9})
        while env.step(state, player(state)) is not None:
            pass
        runs.append(state["replies"])
        assert state["invalid"] == 0 and (state["turns"] == env.max_turns or state["finished"])
    assert runs[0] == runs[1] and len(set(runs[0])) > 2
    gtn = load()
    guesses = {gtn.scripted_player("bisect", 1.0)(gtn.reset({"seed": seed})[0]) for seed in range(20)}
    assert len(guesses) > 5 and all(1 <= int(g[1:-1]) <= 20 for g in guesses)


@pytest.mark.parametrize("game,name,match", [(GTN, "hanoi", "use 'bisect'"), ("TowerOfHanoi-v0", "bisect", "use 'hanoi'"),
                                             ("Bandit-v0", "bisect", "it has none"), (GTN, "minimax", "use 'bisect'")])
def test_unknown_scripted_players_raise_naming_the_right_one(game, name, match):
    with pytest.raises(ValueError, match=match):
        load(game).scripted_player(name)


# ----------------------------------------------------------------------------- rl.py and eval.py


def test_rl_two_steps_then_eval_on_a_game(tiny_model_dir, tmp_path):
    out = str(tmp_path / "rl")
    args = json.dumps({"game": GTN})
    printed = run_main("rl", ["--env", "textarena", "--env_args", args, "--model", tiny_model_dir, "--batch", "4",
                              "--group", "2", "--steps", "2", "--max_new_tokens", "8", "--eval_every", "0", "--eval_n", "2",
                              "--device", "cpu", "--out", out])
    assert "step 2 | reward" in printed and os.path.exists(os.path.join(out, "model.safetensors"))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and all("reward_game" in r for r in steps)
    assert all(r["mean_turns"] >= 1 and "mean_invalid" in r for r in steps)  # counts n_* logged as their means
    printed = run_main("eval", ["--env", "textarena", "--env_args", args, "--model", out, "-n", "2", "--max_new_tokens", "8",
                                "--device", "cpu", "--out", str(tmp_path / "eval")])
    summary = json.load(open(tmp_path / "eval" / "summary.json"))
    assert summary["n"] == 2 and {"win_rate", "finished_rate", "mean_invalid", "reward_game", "format_rate"} <= set(summary)
    assert f"on textarena {args}" in printed
    printed = run_main("eval", ["--env", "textarena", "--env_args", args, "--model", "bisect", "-n", "10", "--show", "1"])
    assert re.search(r"win_rate\s+100.0%", printed) and "[model] [10]" in printed
