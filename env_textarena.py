"""
TextArena's single-player games (https://github.com/LeonGuertler/TextArena) as an environment: an
optional extra, `pip install textarena==0.7.4` (never needed to train on our own environments).

    python eval.py --env textarena --model bisect -n 50 --show 1 \\
        --env_args '{"game": "GuessTheNumber-v0"}'
    python eval.py --env textarena --env_args '{"game": "TowerOfHanoi-v0"}' --model hanoi -n 50
    python rl.py --env textarena --env_args '{"game": "GuessTheNumber-v0"}' \\
        --model Qwen/Qwen3-0.6B --out out/gtn
    python eval.py --env textarena --model out/gtn -n 50 \\
        --env_args '{"game": "Sudoku-v0-easy", "max_turns": 60}'

An episode is one game of `game` (a registered id without its "-raw"/"-train" suffix: the game is
always played unwrapped), started with the example's seed. The first user message is the game's
prompt and board, each game message on a line "[GAME] ..." as TextArena's LLMObservationWrapper
writes them; every later message is only what the game said since the model's last reply (the chat
holds the rest; the game's echo of the model's move is left out). A reply is untrusted text: its
last MAX_REPLY_CHARS characters go to the game (as TextArena's ClipCharactersActionWrapper clips),
and a library error on it ends the episode as a loss, never a crash.

Rewards: `game` (weight 1): 1 for a solve/win and only then; else the game's own partial credit or
penalty from env.close(), in [-1, 0.99], put right per family where the library's is out of range
or pays for the wrong thing (SOLVED, RESCORE; docs/TEXTARENA.md); -1, TextArena's invalid-move
penalty, where the library raised or its reward is not a number. A game cut off at max_turns gets
the partial credit the game gives at its own turn limit (CREDIT; 0 where it gives none), never
less than quitting there with two invalid moves would get. `format` (0.1): the share of replies
holding the game's action format as its prompt shows it (FAMILIES: `[12]` for GuessTheNumber,
`[A C]` for TowerOfHanoi). Metrics: `win` (solved), `finished` (the game ended by itself),
`n_invalid` (moves the game called invalid: TextArena allows one retry, a second invalid move in a
row ends the game), `n_turns`, `format`. max_turns: (the game's own turn limit + 1) x 2, the most
replies a game can take (the games check the limit before counting the turn, and every turn may
take an invalid move and its retry), or 100 without a limit; the argument overrides it.

TextArena draws from Python's process-global `random` (and its states call random.seed(seed) at
reset): an episode keeps its own random state, seeded by the example's seed, swapped into the
global `random` around every call into the library and out after, so interleaved episodes play
exactly as each alone and the caller's `random` is left as it was. The rollouts of one example
play the same game (the same draws for the same moves). copy.deepcopy(state) works: the copy, live
game and random state included, goes on apart from the original. The library runs behind guard.py,
in a worker process: a game that hangs or crashes on a reply (or at reset) costs its episode
(reward 0, metric `timeout` or `error`), never the run.

Scripted players: `bisect` (GuessTheNumber: halves the range it reads from the game's
"higher"/"lower" messages) and `hanoi` (TowerOfHanoi: the optimal move from the board it reads).
docs/TEXTARENA.md: the game list, results.
"""
import contextlib
import io
import math
import random
import re

import textarena as ta
from textarena.core import ObservationType
from textarena.envs.registration import ENV_REGISTRY

from guard import Guarded

MAX_REPLY_CHARS = 4000  # the reply's tail that reaches the game (int() of over 4,300 digits raises)
NO_LIMIT_TURNS = 100  # max_turns of a game without a turn limit of its own
# `game` where the library raised or its reward is not a number: TextArena's invalid-move penalty
LOSS = -1.0

# family (the package under textarena.envs) -> (its prompt's action format, as the game finds it:
# anywhere in the reply, or the whole stripped reply for games that fullmatch; an example for the
# system prompt). Every game of these families was made, reset, stepped and closed here
# (tests/test_env_textarena.py, docs/TEXTARENA.md).
FAMILIES = {
    "Game2048": (r"\[\s*(?:up|down|left|right|w|a|s|d)\s*\]", False, "[up]"),
    "Bandit": (r"\[[a-z]+\]", False, "[red]"),
    "Blackjack": (r"\[(?:hit|stand)\]", False, "[hit]"),
    "Countdown": (r"\[\s*\d+\s+\d+\s*[-+*/]\s*\]", True, "[0 2 *]"),
    "Crosswords": (r"\[\d+\s\d+\s[a-zA-Z]\]", False, "[0 0 d]"),
    "Cryptarithm": (r"\[\s*[A-Za-z]\s+\d\s*\]", True, "[A 5]"),
    "FrozenLake": (r"\[\s*(?:up|down|left|right|w|a|s|d)\s*\]", False, "[up]"),
    "GuessTheNumber": (r"\[\d+\]", False, "[12]"),
    "LightsOut": (r"\[\d+\s+\d+\]", True, "[2 3]"),
    "LogicPuzzle": (r"\[[a-zA-Z]+\s+[a-zA-Z]+\s+[XOxo]\]", False, "[Alice park X]"),
    "Mastermind": (r"\[\d+(?:\s+\d+)*\]", False, "[1 2 3 4]"),
    "Minesweeper": (r"\[\d+\s\d+\]", False, "[3 2]"),
    "PegJump": (r"\[\d{1,2}\s*\d{1,2}\]", True, "[4 1]"),
    "RushHour": (r"\[[A-Za-z][-+]\]", True, "[A+]"),
    "Secretary": (r"\[(?:accept|continue)\]", True, "[continue]"),
    "Set": (r"\[\s*\d+\s*,\s*\d+\s*,\s*\d+\s*\]", False, "[1, 4, 11]"),
    "Slitherlink": (r"\[\s*[hv]\s+\d+\s+\d+\s*\]", True, "[h 0 1]"),
    "Sokoban": (r"\[(?:up|down|left|right|w|a|s|d)\]", False, "[up]"),
    "Sudoku": (r"\[\d+\s\d+\s\d+\]", False, "[1 2 5]"),
    "ThreeCardMonte": (r"\[\s*\d+\s*\]", True, "[1]"),
    "TowerOfHanoi": (r"\[[ABCabc]\s*,?\s*[ABCabc]\]", False, "[A C]"),
}
NLTK = ("downloads nltk's corpora ('words') when its module is imported, and cannot run without "
        "them offline")  # REFUSED's reason for the word games
REFUSED = {  # single-player families that do not run offline on Python 3.11, and why
    "Hangman": NLTK, "WordLadder": NLTK, "Wordle": NLTK, "WordSearch": NLTK,
    "GuessWho": "its game master is an LLM behind OpenRouter (network and OPENROUTER_API_KEY)",
    "TwentyQuestions": "its game master is an LLM behind OpenRouter "
                       "(network and OPENROUTER_API_KEY)",
    "FifteenPuzzle": "shuffles its tiles uniformly, so about half of its boards cannot be solved, "
                     "and a solve raises in the library (AttributeError: SinglePlayerState has "
                     "no set_winners)",
    "Klondike": "its source needs Python 3.12 (SyntaxError on 3.11)",
    "UltimateTexasHoldem": "its source needs Python 3.12 (SyntaxError on 3.11)",
}
LOOSE_SUFFIXES = ("-raw", "-train")  # registered variants that differ only by wrappers

# ----------------------------------------------------------------------------- scoring per family
# Checked against textarena 0.7.4's sources and played games (docs/TEXTARENA.md has the table): the
# library's reward is not always in [-1, 1] with 1 = solved, nor does a cut-off get what the game
# would give there. These put it right per family; other families' rewards are taken as given.
UNSOLVED_MAX = 0.99  # an unsolved game scores below a solve (Slitherlink's credit can be 1.0)
SET_TURNS = 20  # Set-v0's turns: its reward is the number of sets found in them


def completion(env):
    """Partial credit most games give at their own turn limit and on a game-ending invalid move."""
    return env._get_percentage_completion()


def game2048_credit(env):
    """2048's own partial credit, its score share capped at 1: uncapped, a lost game without the
    target tile reaches 1.0 (a 1024 tile, 10,000 points on 2048-v0); capped, at most 0.75."""
    score_share = (env.state.game_state["score"]
                   / (1.5 * env._min_score_to_reach_tile(env.target_tile)))
    return 0.5 * min(1.0, score_share) + 0.5 * env._max_tile() / env.target_tile


def bandit_score(env, regret):
    """Bandit compares the chosen button with the dict of means (never equal, so never 1) and
    rewards the regret (more for a worse button): we give the chosen button's mean over the best
    one's, 1 for the best button (regret 0)."""
    if regret < 0:  # its invalid-move penalty
        return regret
    best = max(env.state.game_state["ground_truth"].values())
    return (best - regret) / best


# family -> the partial credit the game gives an unsolved game at its own turn limit (or at its end
# where it has none), given at a cut-off by max_turns; a family without one gets 0 there
CREDIT = {
    "Game2048": game2048_credit, "Blackjack": completion,
    "Countdown": lambda env: env._calculate_progress(),
    "Crosswords": completion, "FrozenLake": completion, "GuessTheNumber": completion,
    "LightsOut": completion, "LogicPuzzle": completion, "Mastermind": completion,
    "Minesweeper": completion, "PegJump": completion, "RushHour": completion,
    "Set": lambda env: env.state.game_state["score"] / SET_TURNS,
    "Slitherlink": lambda env: env._progress(), "Sokoban": completion, "Sudoku": completion,
    "TowerOfHanoi": completion,
}
# family -> whether a game the library ended with this reward is solved (where 1 is not that)
SOLVED = {
    "Game2048": lambda env, reward: env._max_tile() >= env.target_tile,
    "Bandit": lambda env, regret: regret == 0.0,  # the best button
    "Set": lambda env, reward: reward == SET_TURNS,  # a set on every turn
    "Slitherlink": lambda env, reward: env._is_solved(),  # 1.0 also for clues met without a loop
}
# family -> a better score for an unsolved game the library ended (invalid-move ends included)
RESCORE = {
    "Game2048": lambda env, reward: game2048_credit(env),
    "Bandit": bandit_score,
    # the end pays wins / hands, an invalid move (wins + draws / 2) / hands: quitting beat a draw
    "Blackjack": lambda env, reward: completion(env),
    # a wrong full mapping gets 0, its turn limit the share of letters given any digit: both 0 here
    "Cryptarithm": lambda env, reward: 0.0,
    "Set": lambda env, reward: reward / SET_TURNS,  # the number of sets found (up to 20)
}


def same_card_thrice(env, reply):
    """Set: the library takes "[k, k, k]" (one card thrice) as a Set: 20 such replies score 20."""
    cards = env._parse_action(reply)
    return "the same card three times is not a Set." if cards and len(set(cards)) == 1 else None


GUARDS = {"Set": same_card_thrice}  # family -> why a reply the library takes is invalid, or None


def family(game_id):
    """The package under textarena.envs of a registered id ("Sudoku-v0" -> "Sudoku"), or None."""
    spec = ENV_REGISTRY.get(game_id)
    entry = getattr(spec, "entry_point", None)
    return (entry.split(".")[2] if isinstance(entry, str) and entry.startswith("textarena.envs.")
            else None)


def games(families):
    return [g for g in ENV_REGISTRY if family(g) in families and not g.endswith(LOOSE_SUFFIXES)]


WORKING_GAMES = games(FAMILIES)  # the game ids this environment plays
REFUSED_GAMES = games(REFUSED)  # the ids check_game refuses, with REFUSED's reason


def as_text(reply):
    """The reply as a string: str() of a non-string, "" where even that raises (str(10**5000))."""
    try:
        return reply if isinstance(reply, str) else str(reply)
    except Exception:
        return ""


@contextlib.contextmanager
def own_random(state):
    """Run the library with the episode's random state as the global one (the caller's is put back
    after) and its prints (some games print while they generate a puzzle) swallowed."""
    outer = random.getstate()
    random.setstate(state["random"])
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        state["random"] = random.getstate()
        random.setstate(outer)


def bounded(score):
    """An unsolved game's score in [-1, UNSOLVED_MAX] (LightsOut's credit goes to -8.5 with more
    lights on than at the start)."""
    return max(LOSS, min(UNSOLVED_MAX, float(score)))


def reject(env, reply, reason):
    """For a reply the library would take: whether the game is over after its own handling of an
    invalid move (one retry, then the end, with the family's invalid-move reward: 0 for Set)."""
    env.state.add_observation(from_id=env.state.current_player_id, message=reply,
                              observation_type=ObservationType.PLAYER_ACTION)
    env.state.set_invalid_move(reason=reason, reward=0.0)
    return env.state.step()[0]


def game_lines(observation):
    """The game's messages of a get_observation() list as "[GAME] ..." lines; the player's echoed
    moves are left out (some games pass add_observation's arguments out of order: anything that is
    not a proper game message goes)."""
    lines = []
    for entry in observation:
        if (len(entry) == 3 and isinstance(entry[2], ObservationType)
                and entry[2] != ObservationType.PLAYER_ACTION):
            lines.append(f"[GAME] {entry[1]}")
    return "\n".join(lines)


def check_game(game):
    """ValueError naming the reason unless `game` is a single-player game that runs offline here."""
    if game in WORKING_GAMES:
        return
    works = f"the games that work offline here: {', '.join(WORKING_GAMES)}"
    if not isinstance(game, str):
        raise ValueError(f"game={game!r}: must be a TextArena game id, e.g. \"GuessTheNumber-v0\"; "
                         f"{works}")
    if game.endswith(LOOSE_SUFFIXES) and game.rsplit("-", 1)[0] in WORKING_GAMES:
        raise ValueError(f"game={game!r}: name the game without its wrapper suffix "
                         f"({game.rsplit('-', 1)[0]!r}); this environment always plays the "
                         "unwrapped game and formats its messages itself")
    fam = family(game)
    if fam in REFUSED:
        raise ValueError(f"game={game!r} is refused: {fam} {REFUSED[fam]}; {works}")
    if fam is not None:
        raise ValueError(f"game={game!r} is not one of TextArena's single-player games; {works}")
    raise ValueError(f"game={game!r} is not a registered TextArena game; {works}")


class TextArena:
    reward_weights = {"game": 1.0, "format": 0.1}

    def __init__(self, game="GuessTheNumber-v0", max_turns=None, player_random_prob=0.0):
        check_game(game)
        if not (isinstance(player_random_prob, (int, float)) and 0 <= player_random_prob <= 1):
            raise ValueError(f"player_random_prob={player_random_prob!r}: must be in [0, 1]")
        self.player_random_prob = player_random_prob
        if max_turns is not None and not (isinstance(max_turns, int)
                                          and not isinstance(max_turns, bool) and max_turns >= 1):
            raise ValueError(f"max_turns={max_turns!r}: must be a positive integer "
                             "(or null: the game's own limit)")
        self.game, self.family = game, family(game)
        pattern, whole, example = FAMILIES[self.family]
        self.format = re.compile(pattern, re.IGNORECASE)
        self.format_whole = whole
        probe, _ = self.reset({"seed": 0, "game": game})  # its turn limit, invalid-move allowance
        limit, allowance = probe["env"].state.max_turns, probe["env"].state.error_allowance
        # the games check their limit before counting the turn (GuessTheNumber's 10 turns take 11
        # guesses), and every turn may take an invalid move and its retry
        self.max_turns = max_turns or ((limit + 1) * (allowance + 1) if limit else NO_LIMIT_TURNS)
        self.system_prompt = (f"You are playing {game}, a single-player TextArena game. The game's "
                              "messages come as lines starting with [GAME]. Reply with your next "
                              "move in the action format the game asks for, for example "
                              f"{example}.")

    def examples(self, n, seed=0):
        """Rows {"seed", "game"}, deterministic given `seed`."""
        rng = random.Random(seed)
        return [{"seed": rng.randrange(2**31), "game": self.game} for _ in range(n)]

    def reset(self, example):
        if example.get("game", self.game) != self.game:
            raise ValueError(f"an example of {example['game']!r} given to the {self.game!r} "
                             "environment")
        state = {"game": self.game, "seed": example["seed"],
                 "random": random.Random(example["seed"]).getstate(), "turns": 0, "well_formed": 0,
                 "invalid": 0, "done": False, "finished": False, "solved": False,
                 "game_reward": None, "reason": None, "replies": [], "observations": []}
        with own_random(state):
            env = ta.make(self.game + "-raw")  # the registered game without wrappers
            env.reset(num_players=1, seed=example["seed"])
            first = game_lines(env.get_observation()[1])
        state["env"] = env
        state["observations"].append(first)
        return state, first

    def well_formed(self, text):
        return (self.format.fullmatch(text.strip()) if self.format_whole
                else self.format.search(text)) is not None

    def step(self, state, reply):
        """The game's messages since the reply, or None when the game is over (then a no-op)."""
        if state["done"]:
            return None
        text = as_text(reply)[-MAX_REPLY_CHARS:]
        state["turns"] += 1
        state["replies"].append(text)
        state["well_formed"] += self.well_formed(text)
        env, message = state["env"], None
        try:
            with own_random(state):
                guard = GUARDS.get(self.family)
                reason = guard(env, text) if guard else None
                done = reject(env, text, reason) if reason else env.step(text)[0]
                state["invalid"] += bool(env.state.error_count > 0
                                         or (done and env.state.game_info[0].get("invalid_move")))
                if done:
                    rewards, info = env.close()
                    state["game_reward"], state["solved"] = self.score(
                        env, (rewards or {}).get(0, 0.0))
                    state["reason"], state["finished"] = str(info[0].get("reason")), True
                elif state["turns"] >= self.max_turns:
                    done, state["reason"] = (
                        True, f"cut off after max_turns={self.max_turns} replies")
                    state["game_reward"] = (bounded(CREDIT[self.family](env))
                                            if self.family in CREDIT else 0.0)
                else:
                    message = game_lines(env.get_observation()[1]) or "[GAME] Your move."
        except Exception as e:  # a library error on untrusted text: the episode ends as a loss
            done, state["game_reward"] = True, LOSS
            state["reason"] = f"the library raised {type(e).__name__}: {str(e)[:200]}"
        state["done"] = done
        if done:
            return None
        state["observations"].append(message)
        return message

    def score(self, env, reward):
        """(game reward, solved) of a game the library ended with `reward`."""
        # a string from Countdown, Cryptarithm, Slitherlink, ThreeCardMonte ended by invalid moves
        if not (isinstance(reward, (int, float)) and math.isfinite(reward)):
            return LOSS, False
        solved = SOLVED[self.family](env, reward) if self.family in SOLVED else reward == 1.0
        if solved:
            return 1.0, True
        return bounded(RESCORE[self.family](env, reward) if self.family in RESCORE
                       else reward), False

    def game_reward(self, state):
        return state["game_reward"] if state["game_reward"] is not None else 0.0

    def rewards(self, state):
        return {"game": self.game_reward(state),
                "format": state["well_formed"] / max(state["turns"], 1)}

    def metrics(self, state):
        return {"win": float(state["solved"]), "finished": float(state["finished"]),
                "cut_off": float(not state["finished"]),  # ended at max_turns, not by the game
                "n_invalid": state["invalid"], "n_turns": state["turns"],
                "format": state["well_formed"] / max(state["turns"], 1)}

    def describe(self, state):
        return (f"{state['game']} seed {state['seed']}: {state['turns']} replies, "
                f"{state['invalid']} invalid, game reward {self.game_reward(state):g} "
                f"({state['reason']})")

    @property
    def scripted_players(self):
        return {"GuessTheNumber": ("bisect",), "TowerOfHanoi": ("hanoi",)}.get(self.family, ())

    def scripted_player(self, name, random_move_prob=None):
        """bisect (GuessTheNumber) and hanoi (TowerOfHanoi); random_move_prob (default: the
        environment's player_random_prob): the chance of a random move instead (a random number in
        the game's range; a random legal move), drawn from the example's seed and the turn."""
        random_move_prob = self.player_random_prob if random_move_prob is None else random_move_prob
        players = {"bisect": ("GuessTheNumber", bisect_move), "hanoi": ("TowerOfHanoi", hanoi_move)}
        if name not in players or players[name][0] != self.family:
            have = [p for p, (fam, _) in players.items() if fam == self.family]
            raise ValueError(f"unknown scripted player {name!r} for textarena {self.game}: "
                             + (f"use {have[0]!r}" if have else
                                "it has none (bisect: GuessTheNumber, hanoi: TowerOfHanoi)"))
        move = players[name][1]

        def player(state):
            rng = random.Random(state["seed"] * 1000 + state["turns"])
            return move(state, rng if rng.random() < random_move_prob else None)
        return player


# ----------------------------------------------------------------------------- scripted players


def bisect_move(state, rng=None):
    """The middle of the range left by the game's "higher"/"lower" answers to the earlier guesses
    (rng: a random number in the game's whole range instead)."""
    lo, hi = map(int, re.search(r"between (\d+) and (\d+)", state["observations"][0]).groups())
    if rng is not None:
        return f"[{rng.randint(lo, hi)}]"
    for reply, answer in zip(state["replies"], state["observations"][1:]):
        guess = re.search(r"\[(\d+)\]", reply)
        if guess and "The target number is higher" in answer:
            lo = max(lo, int(guess.group(1)) + 1)
        elif guess and "The target number is lower" in answer:
            hi = min(hi, int(guess.group(1)) - 1)
    return f"[{(lo + hi) // 2}]"


def hanoi_move(state, rng=None):
    """The optimal move towards all disks on C, from the last board (rng: a random legal move)."""
    board = next(m for m in reversed(state["observations"]) if "Current Board:" in m)
    board = board[board.rindex("Current Board:"):]
    towers = {t: [int(d) for d in
                  re.findall(r"\d+", re.search(rf"^{t}: \[(.*)\]", board, re.M).group(1))]
              for t in "ABC"}
    if rng is not None:
        legal = [(s, t) for s in "ABC" for t in "ABC"
                 if s != t and towers[s] and (not towers[t] or towers[t][-1] > towers[s][-1])]
        return "[{} {}]".format(*rng.choice(legal))
    where = {d: t for t, disks in towers.items() for d in disks}

    def move(disk, target):  # the first move of the optimal way to put disks 1..disk on target
        if disk == 0:
            return None
        if where[disk] == target:
            return move(disk - 1, target)
        spare = ({"A", "B", "C"} - {where[disk], target}).pop()
        return move(disk - 1, spare) or (where[disk], target)
    return "[{} {}]".format(*(move(len(where), "C") or ("A", "C")))


def load_environment(game="GuessTheNumber-v0", max_turns=None, timeout=60.0,
                     player_random_prob=0.0):
    """game: a TextArena single-player game id that runs offline (docs/TEXTARENA.md lists them);
    max_turns: the most replies in an episode (default: (the game's own turn limit + 1) x 2, or 100
    for a game without one); timeout: seconds a call (a reset or a move) may take before its
    episode scores 0 with metric `timeout` (guard.py: the library runs in a worker process);
    player_random_prob: the scripted players' (bisect, hanoi) chance of a random move."""
    check_game(game)  # a refused game is said before a worker starts
    return Guarded("env_textarena:TextArena",
                   {"game": game, "max_turns": max_turns, "player_random_prob": player_random_prob},
                   timeout=timeout)
