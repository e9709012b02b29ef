"""
Tic-tac-toe against a seeded, unbiased minimax opponent: the multi-turn game the course describes.

    python eval.py --model minimax --env tictactoe -n 2 --show 2      # watch the scripted player
    python eval.py --model random --env tictactoe --setting optimal   # a baseline
    python env_tictactoe.py --model out/rl                            # play against a model
    python env_tictactoe.py --report out/speedrun ...                 # the speedrun's report

The model plays X, the opponent O; the example's seed decides who moves first. The opponent plays a
uniformly random free cell with probability `random_move_prob`, else a uniform choice among ALL
minimax-optimal moves (no positional tie-breaking: an opponent that always answers the same way is
memorised, not beaten), from an RNG seeded by (example seed, board): rollouts of one example that
reach one position see one reply, in any process. With `opening`, a game may start a few rounds in.

Replies are untrusted text; their outcomes (see `parse_move`):
  - the move is the content of the ONLY <move>...</move> pair, stripped of whitespace, and must be
    exactly one ASCII digit 0-8 naming a free cell; no tag, several <move> tags, a non-integer
    ("4.0", "four"), any other integer ("-1", "9", "04", "-0") or an occupied cell is an invalid
    move: the board stays, the model is told why, the turn is used up and the game goes on;
  - a reply is well-formed (format reward) when it is exactly <think>...</think><move>N</move>,
    whitespace aside, with no tags nested inside the think block.
The research variants (puzzles, the rules teachers, show_wins, more rewards, exploration at the
exploiter's replays) are env_tictactoe_lab.py, `--env tictactoe_lab`, built on the hooks TicTacToe
marks. Pure Python: no torch (but certify, which plays a policy through sample.py, and the report).
"""
import copy
import fractions
import functools
import hashlib
import importlib
import inspect
import json
import os
import random
import re

# -------------------------------------------------------------------------- the game and its solver

# the eight ways to win: rows, columns, diagonals
LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
# the kinds of cell, for the scripted player's tie-break order and the words of its <think>
CORNERS, EDGES, CENTRE = (0, 2, 6, 8), (1, 3, 5, 7), 4


def other(player):
    return "O" if player == "X" else "X"


def winner(board):
    """'X' or 'O' for three in a row, 'draw' for a full board, None while the game goes on."""
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return "draw" if "." not in board else None


def cells_of(board, mark):
    """The cells holding `mark`: "X", "O", or "." for the free ones."""
    return [i for i, c in enumerate(board) if c == mark]


def free_cells(board):
    return cells_of(board, ".")


def play(board, cell, player):
    return board[:cell] + player + board[cell + 1:]


@functools.lru_cache(maxsize=None)
def value(board, player):
    """Game value for `player` to move on `board` under perfect play: 1 win, 0 draw, -1 loss."""
    w = winner(board)
    if w == "draw":
        return 0
    if w is not None:
        return 1 if w == player else -1
    return max(-value(play(board, c, player), other(player)) for c in free_cells(board))


@functools.lru_cache(maxsize=None)
def _best_moves(board, player):
    scores = {c: -value(play(board, c, player), other(player)) for c in free_cells(board)}
    top = max(scores.values())
    return tuple(c for c, s in scores.items() if s == top)


def best_moves(board, player):
    """Every minimax-optimal move (win/draw/loss value) for `player` on a non-terminal `board`."""
    if winner(board) is not None:
        return []
    return list(_best_moves(board, player))


def threats(board, player):
    """Cells where `player` would complete a line right now."""
    return list(_threats(board, player))


@functools.lru_cache(maxsize=None)  # every think, check and certificate decision asks it
def _threats(board, player):
    return tuple(c for c in free_cells(board) if winner(play(board, c, player)) == player)


def render(board):
    """The board with free cells shown as their numbers, e.g. 'X|1|2\\n3|O|5\\n6|7|8'."""
    cells = [c if c != "." else str(i) for i, c in enumerate(board)]
    return "\n".join("|".join(cells[r * 3:r * 3 + 3]) for r in range(3))


# ----------------------------------------------------------------------------- the opponent


def stable_rng(*parts):
    """An RNG seeded by a stable hash of `parts` (Python's hash() changes between processes)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def choose_move(board, player, random_move_prob, rng):
    """A random free cell with probability random_move_prob, else uniformly any optimal move."""
    if rng.random() < random_move_prob:
        return rng.choice(free_cells(board))
    return rng.choice(best_moves(board, player))


def opponent_move(board, seed, random_move_prob):
    """The seeded opponent's reply (O) on `board`: a pure function of (board, example seed,
    skill), so two rollouts of one example that reach one position see one reply, in any process."""
    return choose_move(board, "O", random_move_prob, stable_rng(seed, board))


# ----------------------------------------------------------------------------- the scripted player

# The scripted minimax PLAYER's style (teacher, baseline; never the opponent's): one move per board,
# so that a student copies one consistent style (it meets far fewer positions than a player choosing
# uniformly among optimal moves: docs/LESSONS.md). Of its optimal moves it takes the best chance to
# win against a random opponent (`chance_vs_random`), ties broken by this order.
PREFERENCE = (CENTRE, *CORNERS, *EDGES)


def safe_moves(board):
    """X's immediate wins, else all its minimax-optimal moves: the scripted player's candidates."""
    return threats(board, "X") or best_moves(board, "X")


@functools.lru_cache(maxsize=None)
def chance_vs_random(board, x_to_move):
    """X's best chance to win (an exact Fraction) against an O playing uniformly random cells, when
    X plays only `safe_moves`: choosing by it wins more than PREFERENCE alone (docs/LESSONS.md)."""
    w = winner(board)
    if w is not None:
        return fractions.Fraction(w == "X")
    if x_to_move:
        return max(chance_vs_random(play(board, c, "X"), False) for c in safe_moves(board))
    free = free_cells(board)
    return sum(chance_vs_random(play(board, c, "O"), True) for c in free) / len(free)


def player_move(board):
    """The scripted minimax player's move for X (one per board): of `safe_moves`, the best
    `chance_vs_random`, ties broken by PREFERENCE."""
    return max(safe_moves(board),
               key=lambda c: (chance_vs_random(play(board, c, "X"), False), -PREFERENCE.index(c)))


def player_reply(board, cell):
    """The scripted players' reply as X: a <think> giving a reason (`explain`), then `cell`."""
    return f"<think>{explain(board, cell, 'X')}</think><move>{cell}</move>"


def explain(board, cell, player):
    """A short, true reasoning for playing `cell` (the scripted players' <think>): first where each
    side could complete a line now, then why this cell."""
    if len(free_cells(board)) == 1:  # own words: students wrote "I take a corner" with none left
        return f"Only cell {cell} is free."
    return f"{wins_check(board, player)} {_reason(board, cell, player)}"


def wins_now(board, player):
    """Where `player`, then the other side, could complete a line now, as text: ('2 6', 'none')."""
    return tuple(" ".join(map(str, threats(board, p))) or "none" for p in (player, other(player)))


def wins_check(board, player):
    """Where each side could complete a line now: 'Wins: me 7, opponent none.'"""
    mine, theirs = wins_now(board, player)
    return f"Wins: me {mine}, opponent {theirs}."


def _reason(board, cell, player):
    after = play(board, cell, player)
    if winner(after) == player:
        return f"Cell {cell} completes my line, so I win."
    if cell in threats(board, other(player)):
        return f"The opponent threatens to win at {cell}, so I block it."
    if len(threats(after, player)) >= 2:
        return f"Cell {cell} makes a fork: two threats at once."
    if threats(after, player):
        return f"Cell {cell} makes a threat at {threats(after, player)[0]}."
    kind = "the centre" if cell == CENTRE else "a corner" if cell in CORNERS else "an edge"
    return f"I take {kind}, cell {cell}."


# ------------------------------------------------------------------------ parsing untrusted replies

# a <move> tag's content (parse_move takes it only from a reply with one such tag)
MOVE_RE = re.compile(r"<move>(.*?)</move>", re.DOTALL)
# a well-formed reply (format reward): a <think> with no tag inside, then a <move>, whitespace aside
FORMAT_RE = re.compile(r"\s*<think>(?:(?!</?think>|</?move>).)*</think>"
                       r"\s*<move>\s*-?[0-9]+\s*</move>\s*", re.DOTALL)


def is_well_formed(reply):
    return FORMAT_RE.fullmatch(reply) is not None


# a <think> that opens with the `Wins:` check, in wins_check's words (whether true: states_the_wins)
CHECK_RE = re.compile(r"<think>Wins: me ([0-8](?: [0-8])*|none), "
                      r"opponent ([0-8](?: [0-8])*|none)\.")


def states_the_wins(reply, board):
    """Does the reply's <think> begin with a true `Wins: me A, opponent B.` for X on `board`?"""
    m = CHECK_RE.match(reply.lstrip())
    return m is not None and m.group(0)[len("<think>"):] == wins_check(board, "X")


def stated_own_wins(reply):
    """Where the reply's `Wins:` check says X could complete a line now; None without a check."""
    m = CHECK_RE.match(reply.lstrip())
    return (None if m is None else [] if m.group(1) == "none"
            else [int(c) for c in m.group(1).split()])


def parse_move(reply, board):
    """(cell, None) for a legal move, else (None, reason) — never raises, whatever the reply."""
    if reply.count("<move>") > 1:  # checked first: findall over unclosed tags is quadratic
        return None, "more than one <move> tag"
    found = MOVE_RE.findall(reply)
    if not found:
        return None, "no <move>...</move> tag"
    text = found[0].strip()
    if not re.fullmatch(r"-?[0-9]+", text, re.ASCII):
        return None, "the move is not a whole number"
    if not re.fullmatch(r"[0-8]", text):
        return None, f"cell {text[:12]} is not between 0 and 8"
    cell = int(text)
    if board[cell] != ".":
        return None, f"cell {cell} is already taken"
    return cell, None


def branch(ep):
    """A copy of an episode that goes on apart from it (certify branches lines over the opponent's
    replies): lists and environment state copied, the rest shared, the KV cache included (the fast
    engine gives the copy a row of its own); lists copied whole, far faster than deepcopy."""
    child = {k: list(v) if isinstance(v, list) else v for k, v in ep.items()}
    child["state"] = copy.deepcopy(ep["state"])
    return child


# ----------------------------------------------------------------------------- the environment

# The two standard evaluation settings (eval.py --setting, the evaluations in sft.py and rl.py).
EVAL_SETTINGS = {"optimal": {"min_random_move_prob": 0.0, "max_random_move_prob": 0.0},
                 "random": {"min_random_move_prob": 1.0, "max_random_move_prob": 1.0}}
# the certificate's panels in curves.png (eval.plot_curves; rl.py --exploit, the speedrun's report):
# lost lines and mistaken decisions; optimal-move share and exact win rate against a random opponent
CURVE_PANELS = (("certificate (greedy, every opponent line)",
                 ("exploit_lines_lost", "exploit_mistakes")),
                ("certificate: optimal moves, exact wins vs random",
                 ("exploit_optimal_move_rate", "exploit_random_win_rate")))

# the model's system message: trained models depend on these exact bytes (wrap the source, not them)
SYSTEM_PROMPT = ("You play tic-tac-toe as X against an opponent playing O. "
                 "Three in a row (a row, column or diagonal) wins.\n"
                 "Cells are numbered 0-8, row by row:\n0|1|2\n3|4|5\n6|7|8\n"
                 "The board shows free cells as their numbers. Reply with a short reasoning inside "
                 "<think>...</think>, then the free cell you take inside <move>...</move>, "
                 "for example:\n<think>I take the centre.</think><move>4</move>")


def number(x):
    """A number that --env_args may give: not NaN, not JSON's true or false (bools are ints)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def integer(x):
    return isinstance(x, int) and not isinstance(x, bool)


def non_negative(x):
    return number(x) and 0 <= x < float("inf")


def check_options(checks):
    """Raise ValueError naming the first failing option of [(name, value, ok, what it must be)]."""
    for name, value, ok, must in checks:
        if not ok:
            raise ValueError(f"{name}={value!r}: must be {must}")


class TicTacToe:
    """The game. Methods whose docstring begins "Hook" are where a variant (env_tictactoe_lab.py)
    adds its options by overriding them; here they are the game's own behaviour."""
    system_prompt = SYSTEM_PROMPT
    reward_weights = {"win": 1.0, "format": 0.2, "invalid": 1.0}
    curve_panels = CURVE_PANELS  # rl.py --exploit's curves.png
    scripted_players = ("minimax", "random")  # the first: sft.py's default teacher
    keep = "format=1,loss=0"  # sft.py --keep's default: the teacher's well-formed games not lost

    def __init__(self, min_random_move_prob=0.0, max_random_move_prob=1.0, num_groups=8,
                 max_turns=8, invalid_penalty=0.1, show_cells=False, opening=0, opponent=None,
                 player_random_prob=0.0):
        lo, hi = min_random_move_prob, max_random_move_prob
        check_options([
            ("min_random_move_prob", lo, number(lo) and 0 <= lo <= 1, "a probability in [0, 1]"),
            ("max_random_move_prob", hi, number(hi) and 0 <= hi <= 1, "a probability in [0, 1]"),
            ("min_random_move_prob", lo, number(lo) and number(hi) and lo <= hi,
             f"at most max_random_move_prob={hi}"),
            ("num_groups", num_groups, integer(num_groups) and num_groups >= 1,
             "a positive integer"),
            ("max_turns", max_turns, integer(max_turns) and max_turns >= 1, "a positive integer"),
            ("invalid_penalty", invalid_penalty, non_negative(invalid_penalty), "a number >= 0"),
            ("show_cells", show_cells, isinstance(show_cells, bool), "true or false"),
            ("opening", opening, integer(opening) and opening >= 0, "an integer >= 0"),
            ("player_random_prob", player_random_prob,
             number(player_random_prob) and 0 <= player_random_prob <= 1,
             "a probability in [0, 1]")])
        self.player_random_prob = player_random_prob
        self.lo, self.hi, self.num_groups, self.max_turns = lo, hi, num_groups, max_turns
        self.invalid_penalty, self.show_cells, self.opening = invalid_penalty, show_cells, opening
        # opponent(state) -> cell replaces the seeded opponent (a human player, a test's script);
        # None: an example's "replies" where they name the board (replayed line), else opponent_move
        self.opponent = opponent

    def examples(self, n, seed=0):
        """Example i has its random_move_prob drawn inside bucket i % num_groups of [min, max]."""
        rng = random.Random(seed)
        width = (self.hi - self.lo) / self.num_groups
        rows = []
        for i in range(n):
            p = self.lo + width * (i % self.num_groups + rng.random())
            rows.append({"seed": rng.randrange(2**31), "random_move_prob": min(p, self.hi)})
        return rows

    def reset(self, example):
        """An example may set "model_first" (else the seed picks who starts) and "replies", the
        opponent's {board: cell} replies on those boards (a replayed line, as certify records)."""
        state = self.new_state(example)
        moves = self.first_moves(state, example)
        if len(moves) > 1:
            return state, (f"New game, from a position: the moves so far were {', '.join(moves)}.\n"
                           f"{self._show(state)}")
        if state["model_first"]:
            return state, f"New game. You are X and move first.\n{self._show(state)}"
        return state, (f"New game. The opponent (O) moved first and took cell {moves[0][2:]}.\n"
                       f"{self._show(state)}")

    def new_state(self, example):
        """Hook: the state of a game before any move."""
        return {"board": "." * 9, "seed": example["seed"],
                "random_move_prob": example["random_move_prob"],
                "replies": example.get("replies", {}),
                "model_first": example.get("model_first",
                                           stable_rng(example["seed"], "first").random() < 0.5),
                "turns": 0, "well_formed": 0, "invalid_moves": 0, "winner": None, "cut_off": False,
                "done": False, "max_turns": self.max_turns}

    def first_moves(self, state, example):
        """Hook: play the moves before the model's first: the opponent's first where it starts,
        then up to `opening` rounds of X (`opening_move`) and the example's O, stopping before a
        round that would end the game (a replayed line has none). Returns ["O 3", "X 4", "O 2"]."""
        moves = [] if state["model_first"] else [f"O {self._opponent(state)}"]
        rounds = (0 if "replies" in example
                  else stable_rng(example["seed"], "opening").randint(0, self.opening))
        for _ in range(rounds):
            board = state["board"]
            x = self.opening_move(board, example["seed"])
            after = play(board, x, "X")
            if winner(after) is not None or len(free_cells(after)) < 2:
                break
            state["board"] = after
            o = self._opponent(state)  # plays on state["board"]: undone below if it ends the game
            if winner(state["board"]) is not None:
                state["board"] = board
                break
            moves += [f"X {x}", f"O {o}"]
        return moves

    def opening_move(self, board, seed):
        """Hook: X's move in an opening, the scripted minimax player's."""
        return player_move(board)

    def step(self, state, reply):
        """Apply the model's reply; return the next user message, or None when the game is over."""
        if state["done"]:
            raise RuntimeError("step() called on a finished episode")
        reply = reply if isinstance(reply, str) else str(reply)
        state["turns"] += 1
        state["well_formed"] += is_well_formed(reply)
        cell, why = parse_move(reply, state["board"])
        self.note_reply(state, reply, cell)
        if cell is None:
            state["invalid_moves"] += 1
            news = f"Invalid move: {why}. The board is unchanged."
        else:
            state["board"] = play(state["board"], cell, "X")
            news = f"You took cell {cell}."
            if self._finish(state):
                return None
            news += f" The opponent took cell {self._opponent(state)}."
        if self._finish(state):
            return None
        if state["turns"] >= state["max_turns"]:
            state.update(cut_off=True, done=True)
            return None
        return f"{news}\n{self._show(state)}"

    def note_reply(self, state, reply, cell):
        """Hook: step passes each reply here before its move (cell None: invalid); a no-op here."""

    def rewards(self, state):
        result = state["winner"]
        return {"win": 1.0 if result == "X" else 0.5 if result == "draw" else 0.0,
                "format": state["well_formed"] / max(state["turns"], 1),
                "invalid": -self.invalid_penalty if state["invalid_moves"] else 0.0}

    def metrics(self, state):
        """Per-episode metrics: indicators/fractions become `<name>_rate` in an evaluation,
        `n_<name>` a mean."""
        result = state["winner"]
        return {"win": float(result == "X"), "draw": float(result == "draw"),
                "loss": float(result not in ("X", "draw")),
                "format": state["well_formed"] / max(state["turns"], 1),
                "invalid": float(state["invalid_moves"] > 0), "cut_off": float(state["cut_off"]),
                "n_turns": state["turns"], "n_invalid_moves": state["invalid_moves"]}

    def scripted_player(self, name, random_move_prob=None):
        """A reply function state -> str for the player `name` of scripted_players, in its words
        (scripted_reply): 'random', or 'minimax' (random moves with random_move_prob, by default
        player_random_prob). Random moves are seeded by (example seed, board), like the opponent's,
        so a baseline is reproducible; minimax's other moves are `player_move`'s."""
        if name not in self.scripted_players:
            raise ValueError(f"unknown scripted player {name!r}: "
                             f"use {', '.join(map(repr, self.scripted_players))}")
        p = ((self.player_random_prob if random_move_prob is None else random_move_prob)
             if name == "minimax" else 1.0)

        def reply(state):
            board = state["board"]
            rng = stable_rng(state["seed"], board, "player")
            cell = rng.choice(free_cells(board)) if rng.random() < p else player_move(board)
            return self.scripted_reply(name, board, cell)
        return reply

    def scripted_reply(self, name, board, cell):
        """Hook: the reply of scripted player `name` taking `cell` as X; here `player_reply`."""
        return player_reply(board, cell)

    def describe(self, state):
        """A human-readable picture of the final state, for transcripts."""
        return f"{render(state['board'])}\nresult: {state['winner'] or 'cut off'}"

    def certify(self, policy, out=None, progress=True):
        """Play a greedy policy against EVERY opponent reply at every step, moving first and second.

        Breadth-first: each level's unfinished lines go to the policy in one batch; after each valid
        model move the line branches over every free cell for the opponent. Returns a summary
        (lines_won / drawn / lost, optimal_move_rate over all decisions, random_win/draw/loss_rate:
        the exact results against a uniformly random opponent) and the mistakes: positions where the
        model lost a won or drawn game or missed a forced win, each with the line that led there
        (model_first, and replies: the opponent's reply on each board, replaying it, see reset)."""
        # the rollout module plays the policy (it imports no environment)
        from sample import advance, finish, new_episode
        # each line is an example whose "replies" script the opponent (reset): from the empty board,
        # the opponent's every move so far; a branch adds its next one
        ex = {k: v for k, v in self.examples(1, seed=0)[0].items()
              if k in ("seed", "random_move_prob")}  # not a variant's puzzle
        frontier = [new_episode(self, {**ex, "model_first": True, "replies": {}})]
        frontier += [new_episode(self, {**ex, "model_first": False, "replies": {"." * 9: cell}})
                     for cell in range(9)]
        # each line's probability against a uniformly random opponent (who starts: a coin toss, as
        # in eval's games): the certificate's exact results against it, with no sampling error
        for ep in frontier:
            ep["line_prob"] = 0.5 if ep["example"]["model_first"] else 0.5 / 9
        lines, decisions, optimal, mistakes = [], 0, 0, []
        random_result = {"win": 0.0, "draw": 0.0, "loss": 0.0}
        # what each position demands: a win to take, else a threat to block, else a quiet move
        # (forks are made or stopped there); per kind, [positions, the policy's right moves]
        asked = {"win": [0, 0], "block": [0, 0], "quiet": [0, 0]}
        # a <think> that opens with the `Wins:` check (the minimax and rules_wins teachers'): how
        # often it is true, and at positions with a win to take, how often it names exactly X's wins
        checks_true = wins_stated = 0
        while frontier:
            replies = policy(frontier)
            nxt = []
            for ep, reply in zip(frontier, replies):
                board = ep["state"]["board"]
                cell, _ = parse_move(reply, board)
                best = best_moves(board, "X")
                decisions += 1
                optimal += cell in best
                wins, blocks = threats(board, "X"), threats(board, "O")
                kind, right = (("win", wins) if wins else ("block", blocks) if blocks
                               else ("quiet", best))
                asked[kind][0] += 1
                asked[kind][1] += cell in right
                checks_true += self.check_is_true(reply, board)
                wins_stated += bool(wins) and stated_own_wins(reply) == wins
                before = value(board, "X")
                line = {"model_first": ep["example"]["model_first"],
                        "replies": ep["state"]["replies"]}
                if cell is None:
                    after_board, after = board, None
                    mistakes.append({"board": board, "reply": reply[:200], "kind": "invalid move",
                                     **line})
                else:
                    after_board = play(board, cell, "X")
                    w = winner(after_board)
                    after = 1 if w == "X" else 0 if w == "draw" else -value(after_board, "O")
                    if after < before:
                        mistakes.append({"board": board, "reply": reply[:200],
                                         "kind": ("missed a forced win" if before == 1
                                                  else "lost a drawn position"),
                                         "value_before": before, "value_after": after, **line})
                branches = (free_cells(after_board)
                            if cell is not None and winner(after_board) is None else [None])
                for c in branches:
                    child = branch(ep)
                    child["line_prob"] = ep["line_prob"] / len(branches)
                    if c is not None:
                        child["state"]["replies"] = {**ep["state"]["replies"], after_board: c}
                    if advance(self, child, reply):
                        lines.append(finish(self, child))
                        for result in random_result:
                            random_result[result] += (child["line_prob"]
                                                      * lines[-1]["metrics"][result])
                    else:
                        nxt.append(child)
            frontier = nxt
            if progress:
                print(f"certify: {len(lines)} lines finished, {len(frontier)} open")
        won = sum(r["metrics"]["win"] for r in lines)
        drawn = sum(r["metrics"]["draw"] for r in lines)
        summary = {"lines": len(lines), "lines_won": int(won), "lines_drawn": int(drawn),
                   "lines_lost": int(len(lines) - won - drawn), "decisions": decisions,
                   "optimal_move_rate": optimal / max(decisions, 1), "mistakes": len(mistakes),
                   "win_positions": asked["win"][0], "wins_taken": asked["win"][1],
                   "block_positions": asked["block"][0], "threats_blocked": asked["block"][1],
                   "quiet_positions": asked["quiet"][0], "quiet_optimal": asked["quiet"][1],
                   "checks_true": checks_true, "wins_stated": wins_stated,
                   "random_win_rate": random_result["win"],
                   "random_draw_rate": random_result["draw"],
                   "random_loss_rate": random_result["loss"]}
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            with open(os.path.join(out, "certificate.json"), "w") as f:
                json.dump({**summary, "mistake_positions": mistakes}, f, indent=2)
            with open(os.path.join(out, "lost_lines.jsonl"), "w") as f:
                for r in lines:
                    if r["metrics"]["loss"]:
                        f.write(json.dumps({k: r[k] for k in ("messages", "rewards", "metrics")})
                                + "\n")
        return summary, mistakes

    def check_is_true(self, reply, board):
        """Hook: is the reply's `Wins:` check true on `board` (checks_true)? `states_the_wins`."""
        return states_the_wins(reply, board)

    # --- rl.py --exploit's and eval.py --exploit's hook
    def exploit(self, policy, out=None):
        """Certify the greedy `policy` (its files to `out` when given) and return (summary, score,
        examples): the certificate's numbers, its `rank_of` (lower is better), and for each mistake,
        the worst first (an invalid move counts as a loss), the example replaying its line."""
        summary, mistakes = self.certify(policy, out, progress=out is not None)
        mistakes.sort(key=lambda m: m.get("value_after", -1))
        return summary, self.rank_of(summary), [self.replay_of(m) for m in mistakes]

    def rank_of(self, summary):
        """Hook: rl.py --exploit's rank of a certificate, lower first: lost lines, then mistakes."""
        return summary["lines_lost"], summary["mistakes"]

    def replay_of(self, mistake):
        """Hook: example fields that replay a mistake's line from the start, O optimal after it."""
        return {"model_first": mistake["model_first"], "replies": mistake["replies"],
                "random_move_prob": 0.0}

    # --- internals
    def _show(self, state):
        board = state["board"]
        return "\n".join([render(board), *self.notes(board),
                          f"Free cells: {' '.join(map(str, free_cells(board)))}. Your move."])

    def notes(self, board):
        """Hook: the lines between the board and its free cells: with show_cells, each side's cells
        (a small model otherwise has to locate every X and O by counting positions)."""
        if not self.show_cells:
            return []
        mine, theirs = (" ".join(map(str, cells_of(board, p))) or "none" for p in "XO")
        return [f"You (X): {mine}. Opponent (O): {theirs}."]

    def _opponent(self, state):
        board = state["board"]
        if self.opponent is not None:
            cell = self.opponent(state)
        elif board in state["replies"]:
            cell = state["replies"][board]
        else:
            cell = opponent_move(board, state["seed"], state["random_move_prob"])
        if not (isinstance(cell, int) and cell in free_cells(board)):
            raise ValueError(f"the opponent's cell {cell!r} is not a free cell of {board!r}")
        state["board"] = play(board, cell, "O")
        return cell

    def _finish(self, state):
        w = winner(state["board"])
        if w is not None:
            state.update(winner=w, done=True)
        return state["done"]


def load_environment(min_random_move_prob=0.0, max_random_move_prob=1.0, num_groups=8, max_turns=8,
                     invalid_penalty=0.1, show_cells=False, opening=0, opponent=None,
                     player_random_prob=0.0, **lab_options):
    """min/max_random_move_prob: the range of opponent skill (0 = optimal, 1 = random), split into
    num_groups buckets that consecutive examples cycle through; max_turns: model replies before a
    cut-off; invalid_penalty: taken off a game's reward when it had an invalid move (which only
    costs a turn, so against a strong opponent the result alone barely punishes it); show_cells:
    list each side's cells under the board ("You (X): 4. Opponent (O): 2 5."), an easier read for a
    model from scratch; opening: start each game after up to this many rounds (drawn per example, 0
    included) of the scripted minimax player's X and the example's O, listed in the first message
    ("the moves so far were O 3, X 4, O 2."): more of the data is a game's harder end, and games are
    shorter; opponent: a function state -> cell replacing the seeded opponent (not from --env_args:
    the terminal game and tests pass one); player_random_prob: the scripted minimax player's chance
    of a random move (`--model minimax`, sft.py's teacher). The research options (puzzles,
    show_wins, ...) are tictactoe_lab's: refused here, saying so."""
    if lab_options:
        import env_tictactoe_lab
        name = next(iter(lab_options))
        if name in inspect.signature(env_tictactoe_lab.TicTacToeLab).parameters:
            raise TypeError(f"{name} is an option of tictactoe_lab (env_tictactoe_lab.py): "
                            "--env tictactoe_lab")
        raise TypeError(f"load_environment() got an unexpected keyword argument {name!r}")
    return TicTacToe(min_random_move_prob, max_random_move_prob, num_groups, max_turns,
                     invalid_penalty, show_cells, opening, opponent, player_random_prob)


# common.load_env lists the options it accepts off this signature: the game's, not **lab_options
load_environment.__signature__ = inspect.signature(TicTacToe)


# -------------------------------------------------------------------------- playing in the terminal


def play_human(policy, env_args, games=None, load=load_environment):
    """Games in the terminal: the policy is X, you are O (input() asks your cells); `games` of them,
    or until you say no. `load`: the game's load_environment, or a variant's built on it."""
    from sample import advance, new_episode

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


# ---------------------------------------------------------------------------- the speedrun's report

def write_report(out, times, teacher, teacher_p, sft_args, rl_args, env_args, puzzle_args="",
                 polish_args="", wins_args="", resumed=False, env="tictactoe"):
    """OUT/results.json, OUT/report.md and OUT/curves.png from the evaluations a speedrun script
    wrote to OUT/eval/{teacher,sft,rl}/{optimal,random,exploit}; times = (SFT, RL, total) seconds
    or None; the SFT teacher (minimax with random-move probability teacher_p, or a rules teacher),
    the other arguments and env (the commands' --env, where not tictactoe) name the run's recipe."""
    import platform

    import torch

    from eval import plot_curves
    t_sft, t_rl, t_all = times or (None, None, None)
    load = lambda who, task: json.load(open(os.path.join(out, "eval", who, task, "summary.json")))
    res = {w: {"optimal": load(w, "optimal"), "random": load(w, "random"),
               "certificate": load(w, "exploit")} for w in ("teacher", "sft", "rl")}
    # a resumed speedrun (RESUME=1) times only its own invocation: earlier stages count ~0
    res["times_s"] = ({"sft": int(t_sft), "rl": int(t_rl), "total": int(t_all), "resumed": resumed}
                      if times else None)
    res["machine"] = f"{platform.machine()}, {os.cpu_count()} cores" + (
        f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", CPU only")
    # the RL stages the run had, in order: (directory, the model it starts from, its flags, its
    # name); the last gives the RL model (its best certificate's weights, and their step)
    stages = [stage for stage in (("rl_puzzles", "sft", puzzle_args, "puzzle stage "),
                                  ("rl", "rl_puzzles" if puzzle_args else "sft", rl_args, ""),
                                  ("rl_polish", "rl", polish_args, "third stage "),
                                  ("rl_wins", "rl_polish_best", wins_args, "fourth stage "))
              if stage[0] == "rl" or stage[2]]
    best = os.path.join(out, stages[-1][0] + "_best", "exploit.json")
    res["rl_step"] = json.load(open(best))["step"] if os.path.exists(best) else None
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=2)
    max_new = json.load(open(os.path.join(out, "eval", "rl", "optimal",
                                          "args.json")))["max_new_tokens"]
    teacher_flags = f"--teacher {teacher}"
    name = {"teacher": f"teacher (minimax, random moves p={teacher_p})" if teacher == "minimax" else
                       f"teacher ({teacher}: a random legal move, no strategy)", "sft": "SFT model",
            "rl": "RL model" + (f" ({stages[-1][3]}step {res['rl_step']}: the best certificate)"
                                if res["rl_step"] is not None else "")}
    rows = ["| model | opponent | win | draw | loss | format | games with invalid move |",
            "|---|---|---|---|---|---|---|"]
    for w in ("teacher", "sft", "rl"):
        for o in ("random", "optimal"):
            s = res[w][o]
            rows.append(f"| {name[w]} | {o} | {s['win_rate']:.1%} | {s['draw_rate']:.1%} | "
                        f"{s['loss_rate']:.1%} | {s['format_rate']:.1%} | "
                        f"{s['invalid_rate']:.1%} |")
    cert = ["| model | lines | won | drawn | lost | mistaken decisions | optimal moves | "
            "wins taken | threats blocked | other moves optimal | true `Wins:` checks | "
            "own wins stated | random opponent, exact: win / loss |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in ("teacher", "sft", "rl"):
        c = res[w]["certificate"]
        cert.append(f"| {name[w]} | {c['lines']} | {c['lines_won']} | {c['lines_drawn']} | "
                    f"{c['lines_lost']} | {c['mistakes']} of {c['decisions']} | "
                    f"{c['optimal_move_rate']:.1%} | {c['wins_taken']} of {c['win_positions']} | "
                    f"{c['threats_blocked']} of {c['block_positions']} | "
                    f"{c['quiet_optimal']} of {c['quiet_positions']} | "
                    f"{c['checks_true']} of {c['decisions']} | "
                    f"{c['wins_stated']} of {c['win_positions']} | "
                    f"{c['random_win_rate']:.1%} / {c['random_loss_rate']:.1%} |")
    # where the RL model still errs: the certificate's positions (board row by row, X = the model)
    errs = json.load(open(os.path.join(out, "eval", "rl", "exploit",
                                       "certificate.json")))["mistake_positions"]
    shown = [f"- {m['kind']}: {m['board'][:3]}/{m['board'][3:6]}/{m['board'][6:]}, it replied "
             f"`{' '.join(m['reply'].split())}`" for m in errs[:20]]
    n = res["rl"]["optimal"]["n"]
    errors = (f"The RL model's mistaken decisions: {len(errs)} (the first {len(shown)} below; "
              f"all in {out}/eval/rl/exploit/certificate.json)" if errs else
              "The RL model makes no mistaken decision: each of its moves on every line is "
              "minimax-optimal.")
    nl = "\n"
    env_flag = "" if env == "tictactoe" else f" --env {env}"  # the environment its commands ran
    drawn = plot_curves([(d, os.path.join(out, d, "metrics.jsonl")) for d, *_ in stages],
                        os.path.join(out, "curves.png"), CURVE_PANELS)
    metrics = ", ".join(f"{out}/{d}/metrics.jsonl" for d, *_ in stages)
    rl_commands = "".join(f"    python rl.py --model {out}/{start}{env_flag} {args} "
                          f"--out {out}/{d}{nl}" for d, start, args, _ in stages)
    alone = (" of this resumed invocation alone (RESUME=1; earlier ones not counted)"
             if resumed else "")
    wall = (f"Wall time{alone}: SFT {t_sft}s, RL {t_rl}s, total with evaluation {t_all}s"
            if times else "Wall time: not given (--times)")
    curves = (f"{out}/curves.png (the RL stages one after another)" if drawn
              else "none drawn (matplotlib is not installed)")
    # the report's text; a backslash at a line's end joins the next source line to it
    report = f"""# speedrun report

Machine: {res['machine']}. {wall}.

## Greedy play, {n} games per opponent
{nl.join(rows)}

## Certificate: the greedy policy against every opponent line (moving first and second)
{nl.join(cert)}

Each decision by what its position demands: a win to take (the model can complete a line at \
once), else a threat to
block (the opponent could), else another move, optimal by minimax (where forks are made or \
stopped). A true check:
the reply's <think> opens with `Wins: me A, opponent B.` and it is right (and its `Then: me C.`, \
where written);
own wins stated: at the positions with a win to take, the check's `me` part names exactly those \
cells. Random
opponent, exact: the greedy policy's results against a uniformly random opponent, every line \
weighted by its
probability (the games above sample them, 200 to about 2 points).

{errors}
{nl.join(shown)}

## Commands
    python sft.py --model scratch{env_flag} {teacher_flags} {sft_args} --out {out}/sft
{rl_commands}    python eval.py --model MODEL{env_flag} --setting optimal random --exploit \
-n {n} --temp 0 --max_new_tokens {max_new} --env_args '{env_args}' --out {out}/eval/WHO

Training curves: {curves}; the metrics: {metrics}
"""
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report)
    print(report)


def main():
    import argparse

    from common import load_env, parse_env_args
    from policies import add_policy_args, policy_from_args
    p = add_policy_args(argparse.ArgumentParser(
        description="Play tic-tac-toe against a model in the terminal: the model is X, you are O "
                    "(--env and --env_args as for the model's training: tictactoe, or "
                    "tictactoe_lab). Or, loading no model, the speedrun's report (--report)."))
    p.set_defaults(temp=0.0)
    r = p.add_argument_group("the speedrun's report (speedrun.sh, speedrun_random_teacher.sh)")
    r.add_argument("--report", default=None, metavar="OUT", help="write OUT/report.md, "
                   "OUT/results.json and OUT/curves.png (where matplotlib is installed) from the "
                   "evaluations the speedrun left in OUT/eval; with --times, --teacher and "
                   "--teacher_random_prob (the SFT teacher's), --sft_args, --rl_args (and the "
                   "other stages' flags), --env and --env_args (the evaluation's) naming the run")
    r.add_argument("--times", type=int, nargs=3, default=None, metavar=("SFT", "RL", "TOTAL"),
                   help="--report: wall times in seconds")
    r.add_argument("--resumed", action="store_true", help="--report: --times are those of a "
                   "resumed run's last invocation alone (RESUME=1)")
    r.add_argument("--teacher_random_prob", type=float, default=0.2,
                   help="--report: the minimax teacher's player_random_prob (its --env_args)")
    r.add_argument("--teacher", default="minimax", help="--report: the SFT teacher: minimax with "
                   "--teacher_random_prob (speedrun.sh), or a teacher of random legal moves, "
                   "tictactoe_lab's rules, rules_wins or rules_then "
                   "(speedrun_random_teacher.sh TEACHER)")
    r.add_argument("--sft_args", default="", help="--report: the flags the run gave sft.py")
    r.add_argument("--rl_args", default="",
                   help="--report: the flags the run gave rl.py (its main RL stage)")
    r.add_argument("--puzzle_args", default="", help="--report: the flags of an RL stage on "
                   "puzzles before it, if any (PUZZLE_STEPS)")
    r.add_argument("--polish_args", default="",
                   help="--report: the flags of an RL stage after it, if any (POLISH_STEPS)")
    r.add_argument("--wins_args", default="", help="--report: the flags of a fourth RL stage "
                   "from the third's best weights, if any (WINS_STEPS)")
    args = p.parse_args()
    if args.report:
        return write_report(args.report, args.times, args.teacher, args.teacher_random_prob,
                            args.sft_args, args.rl_args, args.env_args, args.puzzle_args,
                            args.polish_args, args.wins_args, args.resumed, args.env)
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
