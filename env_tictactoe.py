"""
Tic-tac-toe against a seeded, unbiased minimax opponent (multi-turn environment).

    python eval.py --model minimax --env tictactoe -n 2 --show 2      # watch the scripted player
    python eval.py --model random --env tictactoe --opponent optimal   # a baseline
    python env_tictactoe.py --model out/rl                             # play against a model yourself
    python env_tictactoe.py --report out/speedrun                      # the speedrun's report (its scripts add the run's flags)

The model plays X, the opponent O; the example's seed decides who moves first. The opponent plays a
uniformly random free cell with probability `random_move_prob`, otherwise a uniformly random choice among
ALL minimax-optimal moves (no positional tie-breaking: an opponent that always answers the same way is
memorised, not beaten). Every opponent decision comes from an RNG seeded by (example seed, board), so two
rollouts of one example that reach the same position see the same reply, in any process. With `opening`
set, a game may start from a position a few rounds in (see load_environment).

Replies are untrusted text; their outcomes (see `parse_move`):
  - the move is the content of the ONLY <move>...</move> pair, stripped of whitespace, and must be exactly
    one ASCII digit 0-8 naming a free cell; no tag, several <move> tags, a non-integer ("4.0", "four"), any
    other integer ("-1", "9", "04", "-0") or an occupied cell is an invalid move: the board stays, the model is told
    why, the turn is used up and the game goes on;
  - a reply is well-formed (format reward) when it is exactly <think>...</think> then <move>N</move>,
    whitespace aside, with no tags nested inside the think block.
Pure Python: no torch here (but certify, which plays a policy through sample.py, and the speedrun's report).
"""
import fractions
import json
import os
import functools
import hashlib
import random
import re

# ----------------------------------------------------------------------------- the game and its solver

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
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


@functools.lru_cache(maxsize=None)  # every think, check and certificate decision asks it; there are 5,478 positions
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
    """Random free cell with probability random_move_prob, else a uniform choice among all optimal moves."""
    if rng.random() < random_move_prob:
        return rng.choice(free_cells(board))
    return rng.choice(best_moves(board, player))


def opponent_move(board, seed, random_move_prob):
    """The seeded opponent's reply (O) on `board`: a pure function of (board, example seed, skill), so two rollouts
    of one example that reach the same position see the same reply, in any process."""
    return choose_move(board, "O", random_move_prob, stable_rng(seed, board))


def line_moves(model_first, replies, board):
    """The moves ["O 3", "X 4", ...] of a replayed line from the empty board to `board` (X to move): O's are the
    `replies` ({board: cell}, as eval.py --certify records them), X's lead to the next board of the line."""
    now, moves, x_to_move = "." * 9, [], model_first
    while now != board:
        if x_to_move:
            nxt = [c for c in free_cells(now) if play(now, c, "X") in replies or play(now, c, "X") == board]
            if len(nxt) != 1:
                raise ValueError(f"position {board!r} is not on the replayed line")
            cell = nxt[0]
        elif now in replies:
            cell = replies[now]
        else:
            raise ValueError(f"position {board!r} is not on the replayed line")
        now = play(now, cell, "X" if x_to_move else "O")
        moves.append(f"{'X' if x_to_move else 'O'} {cell}")
        x_to_move = not x_to_move
    if not x_to_move:
        raise ValueError(f"position {board!r}: O is to move there, not X")
    return moves


# ----------------------------------------------------------------------------- the scripted player (teacher, baseline)

# The scripted minimax PLAYER's style (never the opponent's): one move per board, so that a student copies one
# consistent style (greedy, it meets 383 distinct positions against every opponent line; a player choosing
# uniformly among optimal moves meets 3,052). Of its optimal moves it takes the one with the best chance to win
# against a random opponent (`chance_vs_random`), ties broken by this order.
PREFERENCE = (CENTRE, *CORNERS, *EDGES)


PUZZLE_KINDS = ("block", "win", "threat", "opening", "second", "start")
# how rl.py --exploit ranks certificates with as many lost lines (TicTacToe.exploit)
EXPLOIT_RANKS = ("mistakes", "random_wins")
RULES_PLAYERS = ("rules", "rules_wins", "rules_then")  # the warm-up teachers that know only the format and the rules
SCRIPTED_PLAYERS = ("random", "minimax", *RULES_PLAYERS)


def demands(board, kind):
    """Does X to move on `board` face a puzzle of `kind`: "block" (O threatens one line, X has no win, and the game is
    not yet lost, so the block is the one move that keeps it), "win" (a line for X to complete now), "threat"
    (either), "opening" (X's first or second move, where some move loses the position's value) or "second" (X's
    second move, where some move loses it)?"""
    if kind in ("opening", "second"):
        x_moves = (0, 1) if kind == "opening" else (1,)
        return board.count("X") in x_moves and len(best_moves(board, "X")) < len(free_cells(board))
    wins, their_wins = threats(board, "X"), threats(board, "O")
    block = not wins and len(their_wins) == 1 and value(board, "X") > -1
    return (kind != "win" and block) or (kind != "block" and bool(wins))


def puzzle_line(rng, kind):
    """A line of uniformly random play, by both sides, to the first position that `demands` `kind`, X to move:
    (model_first, replies, board), the fields of a replayed line's example (see TicTacToe.reset). An "opening"
    puzzle is X's first or second move, drawn at random, so that the second moves are not all cut short by a first.
    A "second" puzzle's line has X's first move optimal, not random: the second moves a good first move leads to."""
    while True:
        model_first, board, replies = rng.random() < 0.5, "." * 9, {}
        nth = rng.randrange(2) if kind == "opening" else None
        if not model_first:
            replies[board] = rng.choice(free_cells(board))
            board = play(board, replies[board], "O")
        while winner(board) is None:
            if demands(board, kind) and nth in (None, board.count("X")):
                return model_first, replies, board
            board = play(board, rng.choice(best_moves(board, "X") if kind == "second" else free_cells(board)), "X")
            if winner(board) is not None:
                break
            replies[board] = rng.choice(free_cells(board))
            board = play(board, replies[board], "O")


def safe_moves(board):
    """X's immediate wins, else all of X's minimax-optimal moves: the scripted minimax player's candidates."""
    return threats(board, "X") or best_moves(board, "X")


@functools.lru_cache(maxsize=None)
def chance_vs_random(board, x_to_move):
    """X's best chance to win (an exact Fraction) against an O that plays uniformly random cells, when X plays
    only `safe_moves`. Choosing by it wins 95.6% of such games (half moving first); always the first safe move
    in PREFERENCE, 90.6%."""
    w = winner(board)
    if w is not None:
        return fractions.Fraction(w == "X")
    if x_to_move:
        return max(chance_vs_random(play(board, c, "X"), False) for c in safe_moves(board))
    free = free_cells(board)
    return sum(chance_vs_random(play(board, c, "O"), True) for c in free) / len(free)


def player_move(board):
    """The scripted minimax player's move for X (one per board): of `safe_moves`, the best `chance_vs_random`,
    ties broken by PREFERENCE."""
    return max(safe_moves(board), key=lambda c: (chance_vs_random(play(board, c, "X"), False), -PREFERENCE.index(c)))


def scripted_reply(name, board, cell):
    """The reply of scripted player `name` taking `cell` as X: the rules players' <think> lists the free cells (and,
    for rules_wins and rules_then, where each side could complete a line; rules_then's also where X could after
    the move), the others' gives a reason (`explain`)."""
    if name in RULES_PLAYERS:
        check = f"{wins_check(board, 'X')} " if name != "rules" else ""
        then = f" {then_check(board, cell)}" if name == "rules_then" else ""
        return f"<think>{check}Free cells: {' '.join(map(str, free_cells(board)))}. I take cell {cell}.{then}</think><move>{cell}</move>"
    return f"<think>{explain(board, cell, 'X')}</think><move>{cell}</move>"


def explain(board, cell, player):
    """A short, true reasoning for playing `cell` (the scripted players' <think>): first where each side could
    complete a line now, then why this cell."""
    if len(free_cells(board)) == 1:  # its own words: a student that began "I take a corner" had no corner left
        return f"Only cell {cell} is free."
    return f"{wins_check(board, player)} {_reason(board, cell, player)}"


def wins_now(board, player):
    """Where `player`, then the other side, could complete a line now, as text: ('2 6', 'none')."""
    return tuple(" ".join(map(str, threats(board, p))) or "none" for p in (player, other(player)))


def wins_check(board, player):
    """Where each side could complete a line now: 'Wins: me 7, opponent none.'"""
    mine, theirs = wins_now(board, player)
    return f"Wins: me {mine}, opponent {theirs}."


def then_check(board, cell):
    """Where X could complete a line after taking `cell`: 'Then: me 2 6.'"""
    return f"Then: me {' '.join(map(str, threats(play(board, cell, 'X'), 'X'))) or 'none'}."


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


# ----------------------------------------------------------------------------- parsing untrusted replies

MOVE_RE = re.compile(r"<move>(.*?)</move>", re.DOTALL)
FORMAT_RE = re.compile(r"\s*<think>(?:(?!</?think>|</?move>).)*</think>\s*<move>\s*-?[0-9]+\s*</move>\s*", re.DOTALL)


def is_well_formed(reply):
    return FORMAT_RE.fullmatch(reply) is not None


CHECK_RE = re.compile(r"<think>Wins: me ([0-8](?: [0-8])*|none), opponent ([0-8](?: [0-8])*|none)\.")
THEN_RE = re.compile(r"Then: me (?:[0-8](?: [0-8])*|none)\.(?=</think>)")


def states_the_wins(reply, board):
    """Does the reply's <think> begin with a true `Wins: me A, opponent B.` for X on `board` (wins_check's words),
    and, where it ends with `Then: me C.` (the rules_then teacher's words), is that true of the move it makes?"""
    reply = reply.lstrip()
    m = CHECK_RE.match(reply)
    if m is None or m.group(0)[len("<think>"):] != wins_check(board, "X"):
        return False
    then = THEN_RE.search(reply)
    if then is None:
        return True
    cell, _ = parse_move(reply, board)
    return cell is not None and then.group(0) == then_check(board, cell)


def stated_own_wins(reply):
    """The cells where the reply's `Wins:` check says X could complete a line now, or None without a check."""
    m = CHECK_RE.match(reply.lstrip())
    return None if m is None else [] if m.group(1) == "none" else [int(c) for c in m.group(1).split()]


def parse_move(reply, board):
    """(cell, None) for a legal move, else (None, reason) — never raises, whatever the reply."""
    if reply.count("<move>") > 1:  # checked first: findall over many unclosed tags would be quadratic
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


# ----------------------------------------------------------------------------- the environment

# The two standard evaluation settings (eval.py --opponent, and the evaluations inside sft.py and rl.py).
EVAL_SETTINGS = {"optimal": {"min_random_move_prob": 0.0, "max_random_move_prob": 0.0, "puzzles": 0.0},
                 "random": {"min_random_move_prob": 1.0, "max_random_move_prob": 1.0, "puzzles": 0.0}}
# the certificate's panels in curves.png (eval.plot_curves, from rl.py and the speedrun's report): lost lines and
# mistaken decisions; the optimal-move share and the exact win rate against the random opponent
CERTIFY_CURVES = (("certificate (greedy, every opponent line)", ("lines_lost", "mistakes")),
                  ("certificate: optimal moves, exact wins vs random", ("optimal_move_rate", "random_win_rate")))

SYSTEM_PROMPT = """You play tic-tac-toe as X against an opponent playing O. Three in a row (a row, column or diagonal) wins.
Cells are numbered 0-8, row by row:
0|1|2
3|4|5
6|7|8
The board shows free cells as their numbers. Reply with a short reasoning inside <think>...</think>, then the free cell you take inside <move>...</move>, for example:
<think>I take the centre.</think><move>4</move>"""


class TicTacToe:
    system_prompt = SYSTEM_PROMPT
    reward_weights = {"win": 1.0, "format": 0.2, "invalid": 1.0}
    certify_curves = CERTIFY_CURVES  # rl.py --exploit's curves.png

    def __init__(self, min_random_move_prob=0.0, max_random_move_prob=1.0, num_groups=8, max_turns=8, invalid_penalty=0.1,
                 show_cells=False, opening=0, opening_player="minimax", replay_from="start", check_reward=0.0,
                 loss_penalty=0.0, optimal_reward=0.0, puzzles=0.0, puzzle_kind="threat", puzzle_turns=1,
                 missed_win_penalty=0.0, show_wins=False, replay_explore=None, exploit_rank="mistakes",
                 exploit_stop=False, opponent=None):
        lo, hi = min_random_move_prob, max_random_move_prob
        number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN, not true/false
        integer = lambda x: isinstance(x, int) and not isinstance(x, bool)
        finite_non_negative = lambda x: number(x) and 0 <= x < float("inf")
        kinds = [puzzle_kind] if isinstance(puzzle_kind, str) else puzzle_kind if isinstance(puzzle_kind, list) else []
        for name, value, ok, must in [
                ("min_random_move_prob", lo, number(lo) and 0 <= lo <= 1, "a probability in [0, 1]"),
                ("max_random_move_prob", hi, number(hi) and 0 <= hi <= 1, "a probability in [0, 1]"),
                ("min_random_move_prob", lo, number(lo) and number(hi) and lo <= hi, f"at most max_random_move_prob={hi}"),
                ("num_groups", num_groups, integer(num_groups) and num_groups >= 1, "a positive integer"),
                ("max_turns", max_turns, integer(max_turns) and max_turns >= 1, "a positive integer"),
                ("invalid_penalty", invalid_penalty, finite_non_negative(invalid_penalty), "a number >= 0"),
                ("show_cells", show_cells, isinstance(show_cells, bool), "true or false"),
                ("show_wins", show_wins, isinstance(show_wins, bool), "true or false"),
                ("opening", opening, integer(opening) and opening >= 0, "an integer >= 0"),
                ("opening_player", opening_player, opening_player in ("minimax", "random"), '"minimax" or "random"'),
                ("replay_from", replay_from, replay_from in ("start", "mistake"), '"start" or "mistake"'),
                ("replay_explore", replay_explore, replay_explore in (None, *SCRIPTED_PLAYERS),
                 "null or a scripted player: " + ", ".join(map(repr, SCRIPTED_PLAYERS))),
                ("exploit_rank", exploit_rank, exploit_rank in EXPLOIT_RANKS, " or ".join(map(repr, EXPLOIT_RANKS))),
                ("exploit_stop", exploit_stop, isinstance(exploit_stop, bool), "true or false"),
                ("check_reward", check_reward, finite_non_negative(check_reward), "a number >= 0"),
                ("loss_penalty", loss_penalty, finite_non_negative(loss_penalty), "a number >= 0"),
                ("optimal_reward", optimal_reward, finite_non_negative(optimal_reward), "a number >= 0"),
                ("missed_win_penalty", missed_win_penalty, finite_non_negative(missed_win_penalty), "a number >= 0"),
                ("puzzles", puzzles, number(puzzles) and 0 <= puzzles <= 1, "a share in [0, 1]"),
                ("puzzle_kind", puzzle_kind, kinds and all(k in PUZZLE_KINDS for k in kinds),
                 " or ".join(map(repr, PUZZLE_KINDS)) + ", or a list of them"),
                ("puzzle_turns", puzzle_turns, integer(puzzle_turns) and puzzle_turns >= 1, "a positive integer")]:
            if not ok:
                raise ValueError(f"{name}={value!r}: must be {must}")
        self.lo, self.hi, self.num_groups, self.max_turns = lo, hi, num_groups, max_turns
        self.invalid_penalty, self.opening = invalid_penalty, opening
        self.show_cells, self.show_wins = show_cells, show_wins
        self.opening_player, self.replay_from, self.replay_explore = opening_player, replay_from, replay_explore
        self.exploit_rank, self.exploit_stop = exploit_rank, exploit_stop
        self.check_reward, self.loss_penalty, self.optimal_reward = check_reward, loss_penalty, optimal_reward
        self.puzzles, self.puzzle_kinds, self.puzzle_turns = puzzles, kinds, puzzle_turns
        self.missed_win_penalty = missed_win_penalty
        # an instance's weights: the class's are every other game's
        extra = {name: w for name, w in (("check", check_reward), ("optimal", optimal_reward),
                                         ("missed_win", missed_win_penalty)) if w}
        if extra:
            self.reward_weights = {**TicTacToe.reward_weights, **extra}
        # opponent(state) -> cell replaces the seeded opponent (a human in `python env_tictactoe.py`, a script in tests);
        # None: an example's "replies" where they name the board (a replayed line), else `opponent_move`
        self.opponent = opponent

    def examples(self, n, seed=0):
        """Example i has its random_move_prob drawn inside bucket i % num_groups of [min, max]. With `puzzles`, each
        example is, with that probability, a puzzle: a game that starts where random play first reached a position
        demanding `puzzle_kind` (`puzzle_line`; of a list, one kind drawn per puzzle), its moves listed as an
        opening's, cut off after `puzzle_turns` replies; a "start" puzzle is a game from the empty board against a
        uniformly random opponent, cut off after two replies (X's first two moves, asked in a game's messages)."""
        rng, puzzle_rng = random.Random(seed), stable_rng(seed, "puzzles")
        width = (self.hi - self.lo) / self.num_groups
        rows = []
        for i in range(n):
            p = self.lo + width * (i % self.num_groups + rng.random())
            rows.append({"seed": rng.randrange(2**31), "random_move_prob": min(p, self.hi)})
            if self.puzzles and puzzle_rng.random() < self.puzzles:
                # one kind draws nothing: a one-kind list gives the same examples as that kind alone
                kind = self.puzzle_kinds[0] if len(self.puzzle_kinds) == 1 else puzzle_rng.choice(self.puzzle_kinds)
                if kind == "start":  # the game's own messages from the empty board, a random opponent, two replies
                    rows[-1].update(model_first=puzzle_rng.random() < 0.5, random_move_prob=1.0, max_turns=2)
                    continue
                model_first, replies, board = puzzle_line(puzzle_rng, kind)
                rows[-1].update(model_first=model_first, replies=replies, position=board, max_turns=self.puzzle_turns)
        return rows

    def reset(self, example):
        """An example may set "model_first" to override the seed's choice of who starts, and "replies", a
        {board: cell} map of the opponent's replies on those boards (a line replayed: `eval.py --certify` records
        the lines a policy lost, `rl.py --exploit` trains on them); elsewhere the seeded opponent plays. With
        "position" too (a board on that line, X to move), the game starts there, its moves so far listed as an
        opening's are; "max_turns" replaces the environment's for this game."""
        state = {"board": "." * 9, "seed": example["seed"], "random_move_prob": example["random_move_prob"],
                 "replies": example.get("replies", {}),
                 "model_first": example.get("model_first", stable_rng(example["seed"], "first").random() < 0.5),
                 "turns": 0, "well_formed": 0, "true_checks": 0, "missed_wins": 0, "optimal_moves": 0, "invalid_moves": 0,
                 "winner": None, "cut_off": False, "done": False, "max_turns": example.get("max_turns", self.max_turns),
                 "explore": example.get("explore")}
        first = None if state["model_first"] else self._opponent(state)
        moves = [] if first is None else [f"O {first}"]
        if "position" in example:
            moves = line_moves(state["model_first"], state["replies"], example["position"])
            state["board"] = example["position"]
        # the opening: up to `opening` rounds of X (the scripted minimax player, or a random cell) and the example's
        # O, stopping before a round that would end the game, so that the model always has a move to make; a
        # replayed line has none
        rounds = 0 if "replies" in example else stable_rng(example["seed"], "opening").randint(0, self.opening)
        for _ in range(rounds):
            board = state["board"]
            x = player_move(board) if self.opening_player == "minimax" else \
                stable_rng(example["seed"], board, "opening X").choice(free_cells(board))
            after = play(board, x, "X")
            if winner(after) is not None or len(free_cells(after)) < 2:
                break
            state["board"] = after
            o = self._opponent(state)  # plays on state["board"]: undone below if it ends the game
            if winner(state["board"]) is not None:
                state["board"] = board
                break
            moves += [f"X {x}", f"O {o}"]
        if len(moves) > 1:
            return state, f"New game, from a position: the moves so far were {', '.join(moves)}.\n{self._show(state)}"
        if state["model_first"]:
            return state, f"New game. You are X and move first.\n{self._show(state)}"
        return state, f"New game. The opponent (O) moved first and took cell {first}.\n{self._show(state)}"

    def step(self, state, reply):
        """Apply the model's reply; return the next user message, or None when the game is over."""
        if state["done"]:
            raise RuntimeError("step() called on a finished episode")
        reply = reply if isinstance(reply, str) else str(reply)
        state["turns"] += 1
        state["well_formed"] += is_well_formed(reply)
        state["true_checks"] += states_the_wins(reply, state["board"])
        cell, why = parse_move(reply, state["board"])
        if cell is None:
            state["invalid_moves"] += 1
            news = f"Invalid move: {why}. The board is unchanged."
        else:
            state["optimal_moves"] += cell in best_moves(state["board"], "X")
            named = stated_own_wins(reply) or []
            state["missed_wins"] += bool(named) and cell not in named
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

    def rewards(self, state):
        result = state["winner"]
        # a game neither won nor drawn (lost, or cut off) scores -loss_penalty: above 0, not losing is worth more
        # than winning is, the certificate's aim
        rewards = {"win": 1.0 if result == "X" else 0.5 if result == "draw" else -self.loss_penalty,
                   "format": state["well_formed"] / max(state["turns"], 1),
                   "invalid": -self.invalid_penalty if state["invalid_moves"] else 0.0}
        if self.check_reward:
            rewards["check"] = state["true_checks"] / max(state["turns"], 1)
        if self.optimal_reward:
            rewards["optimal"] = state["optimal_moves"] / max(state["turns"], 1)
        if self.missed_win_penalty:
            rewards["missed_win"] = -state["missed_wins"] / max(state["turns"], 1)
        return rewards

    def metrics(self, state):
        """Per-episode metrics: indicators/fractions become `<name>_rate` in an evaluation, `n_<name>` a mean."""
        result = state["winner"]
        return {"win": float(result == "X"), "draw": float(result == "draw"), "loss": float(result not in ("X", "draw")),
                "format": state["well_formed"] / max(state["turns"], 1), "invalid": float(state["invalid_moves"] > 0),
                "cut_off": float(state["cut_off"]), "n_turns": state["turns"], "n_invalid_moves": state["invalid_moves"]}

    def scripted_player(self, name, random_move_prob=0.0):
        """A reply function state -> str: 'random' or 'minimax' (playing randomly with random_move_prob), or
        'rules', a player that knows only the rules and the format: a random free cell, its <think> listing the
        free cells and nothing strategic (a warm-up teacher that shows no strategy: docs/RANDOM_TEACHER.md);
        'rules_wins' plays the same random cell, its <think> first stating where each side could complete a line
        now (`Wins: me 7, opponent none.`, a fact of the rules; what to do about it is left to RL); 'rules_then'
        also ends its <think> with where it could complete a line after its move (`Then: me 2 6.`), so that the
        next turn's `me` part is that list less the opponent's reply, a copy, not a search of the board.
        Random moves are seeded by (example seed, board), like the opponent's, so a baseline is reproducible;
        minimax's other moves depend on the board only: of `safe_moves`, the best `chance_vs_random`, then the
        first in PREFERENCE."""
        if name not in SCRIPTED_PLAYERS:
            raise ValueError(f"unknown scripted player {name!r}: use {', '.join(map(repr, SCRIPTED_PLAYERS))}")
        p = random_move_prob if name == "minimax" else 1.0

        def reply(state):
            board = state["board"]
            rng = stable_rng(state["seed"], board, "player")
            cell = rng.choice(free_cells(board)) if rng.random() < p else player_move(board)
            return scripted_reply(name, board, cell)
        return reply

    def describe(self, state):
        """A human-readable picture of the final state, for transcripts."""
        return f"{render(state['board'])}\nresult: {state['winner'] or 'cut off'}"

    # --- eval.py --certify's hook, and rl.py --exploit's
    def certify(self, policy, out=None, progress=True):
        """Play a (greedy, deterministic) policy against EVERY opponent reply at every step, moving first and second.

        Breadth-first: each level's unfinished lines go to the policy in one batch; after each valid model move
        the line branches over every free cell for the opponent. Returns a summary with lines_won / drawn / lost,
        optimal_move_rate over all model decisions, random_win/draw/loss_rate (the exact results against a uniformly
        random opponent), and the positions where the model lost a won or drawn game or missed a forced win, each with
        the line that led there (model_first, and replies: the opponent's reply on each board, which replays the line
        as an example, see reset)."""
        from sample import advance, branch, finish, new_episode  # the rollout module plays the policy (it imports no environment)
        # each line is an example whose "replies" script the opponent (reset): from the empty board,
        # the opponent's every move so far; a branch adds its next one
        ex = {k: v for k, v in self.examples(1, seed=0)[0].items() if k in ("seed", "random_move_prob")}  # not a puzzle's start
        frontier = [new_episode(self, {**ex, "model_first": True, "replies": {}})]
        frontier += [new_episode(self, {**ex, "model_first": False, "replies": {"." * 9: cell}}) for cell in range(9)]
        # each line's probability against a uniformly random opponent (who starts is a coin toss, as in eval's games),
        # so the certificate also gives the greedy policy's exact results against the random opponent, with no
        # sampling error (200 games measure them to about 2 points)
        for ep in frontier:
            ep["line_prob"] = 0.5 if ep["example"]["model_first"] else 0.5 / 9
        lines, decisions, optimal, mistakes = [], 0, 0, []
        random_result = {"win": 0.0, "draw": 0.0, "loss": 0.0}
        # what each position demands: a win to take, else a threat to block, else a quiet move (forks are made or
        # stopped there); for each kind, how many positions and how many the policy got right
        asked = {"win": [0, 0], "block": [0, 0], "quiet": [0, 0]}
        # a reply whose <think> opens with the `Wins:` check (the rules_wins teachers' and the minimax teacher's):
        # how often it is true, and at the positions with a win to take, how often it names exactly X's own wins
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
                kind, right = ("win", wins) if wins else ("block", blocks) if blocks else ("quiet", best)
                asked[kind][0] += 1
                asked[kind][1] += cell in right
                checks_true += states_the_wins(reply, board)
                wins_stated += bool(wins) and stated_own_wins(reply) == wins
                before = value(board, "X")
                line = {"model_first": ep["example"]["model_first"], "replies": ep["state"]["replies"]}
                if cell is None:
                    after_board, after = board, None
                    mistakes.append({"board": board, "reply": reply[:200], "kind": "invalid move", **line})
                else:
                    after_board = play(board, cell, "X")
                    w = winner(after_board)
                    after = 1 if w == "X" else 0 if w == "draw" else -value(after_board, "O")
                    if after < before:
                        mistakes.append({"board": board, "reply": reply[:200], "kind": "missed a forced win" if before == 1
                                         else "lost a drawn position", "value_before": before, "value_after": after, **line})
                branches = free_cells(after_board) if cell is not None and winner(after_board) is None else [None]
                for c in branches:
                    child = branch(ep)
                    child["line_prob"] = ep["line_prob"] / len(branches)
                    if c is not None:
                        child["state"]["replies"] = {**ep["state"]["replies"], after_board: c}
                    if advance(self, child, reply):
                        lines.append(finish(self, child))
                        for result in random_result:
                            random_result[result] += child["line_prob"] * lines[-1]["metrics"][result]
                    else:
                        nxt.append(child)
            frontier = nxt
            if progress:
                print(f"certify: {len(lines)} lines finished, {len(frontier)} open")
        won = sum(r["metrics"]["win"] for r in lines)
        drawn = sum(r["metrics"]["draw"] for r in lines)
        summary = {"lines": len(lines), "lines_won": int(won), "lines_drawn": int(drawn), "lines_lost": int(len(lines) - won - drawn),
                   "decisions": decisions, "optimal_move_rate": optimal / max(decisions, 1), "mistakes": len(mistakes),
                   "win_positions": asked["win"][0], "wins_taken": asked["win"][1], "block_positions": asked["block"][0],
                   "threats_blocked": asked["block"][1], "quiet_positions": asked["quiet"][0], "quiet_optimal": asked["quiet"][1],
                   "checks_true": checks_true, "wins_stated": wins_stated,
                   "random_win_rate": random_result["win"], "random_draw_rate": random_result["draw"], "random_loss_rate": random_result["loss"]}
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            with open(os.path.join(out, "certificate.json"), "w") as f:
                json.dump({**summary, "mistake_positions": mistakes}, f, indent=2)
            with open(os.path.join(out, "lost_lines.jsonl"), "w") as f:
                for r in lines:
                    if r["metrics"]["loss"]:
                        f.write(json.dumps({k: r[k] for k in ("messages", "rewards", "metrics")}) + "\n")
        return summary, mistakes

    # --- rl.py --exploit's hook
    def exploit(self, policy):
        """Certify the greedy `policy` against every opponent line (certify) and return (summary, rank, examples):
        the certificate's numbers, its rank (lower is better: lost lines, then by exploit_rank mistaken decisions or
        the exact win rate against the random opponent, higher first), and for each
        mistake, the worst first (an invalid move counts as a loss), the example fields that replay its line, from
        the empty board or (replay_from="mistake") from the position of the mistake, the optimal opponent playing
        after it."""
        summary, mistakes = self.certify(policy, progress=False)
        mistakes.sort(key=lambda m: m.get("value_after", -1))
        position = lambda m: {"position": m["board"]} if self.replay_from == "mistake" else {}
        explore = lambda m: {"explore": m["board"]} if self.replay_explore else {}
        replays = [{"model_first": m["model_first"], "replies": m["replies"], "random_move_prob": 0.0, **position(m), **explore(m)}
                   for m in mistakes]
        then = summary["mistakes"] if self.exploit_rank == "mistakes" else -summary["random_win_rate"]
        return summary, (summary["lines_lost"], then), replays

    def forced_reply(self, state, rollout):
        """sample.rollout's exploration hook (replay_explore): at a replayed mistake's position (the example's
        "explore" board), the group's odd rollouts play a free cell in the policy's place, the cells in turn from
        one that the example's seed picks, in the words of the scripted player replay_explore names; rl.py trains
        such a reply as if sampled, with its advantage and no importance weight. Elsewhere None: the policy plays."""
        if state["explore"] != state["board"] or rollout % 2 == 0:
            return None
        cells = free_cells(state["board"])
        return scripted_reply(self.replay_explore, state["board"], cells[(state["seed"] + rollout // 2) % len(cells)])

    # --- internals
    def _show(self, state):
        board = state["board"]
        lines = [render(board)]
        if self.show_cells:
            # each side's cells as numbers: a small model otherwise has to locate every X and O by counting positions
            mine, theirs = (" ".join(map(str, cells_of(board, p))) or "none" for p in "XO")
            lines.append(f"You (X): {mine}. Opponent (O): {theirs}.")
        if self.show_wins:
            # where each side could complete a line now, read off the board for the model: a fact of the rules
            mine, theirs = wins_now(board, "X")
            lines.append(f"Wins now: you {mine}, opponent {theirs}.")
        lines.append(f"Free cells: {' '.join(map(str, free_cells(board)))}. Your move.")
        return "\n".join(lines)

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


def load_environment(min_random_move_prob=0.0, max_random_move_prob=1.0, num_groups=8, max_turns=8, invalid_penalty=0.1,
                     show_cells=False, opening=0, opening_player="minimax", replay_from="start", check_reward=0.0,
                     loss_penalty=0.0, optimal_reward=0.0, puzzles=0.0, puzzle_kind="threat", puzzle_turns=1,
                     missed_win_penalty=0.0, show_wins=False, replay_explore=None, exploit_rank="mistakes",
                     exploit_stop=False, opponent=None):
    """min/max_random_move_prob: the range of opponent skill (0 = optimal, 1 = random), split into
    num_groups buckets that consecutive examples cycle through; max_turns: model replies before a cut-off;
    invalid_penalty: subtracted from a game's reward when it had an invalid move (an invalid move only costs
    a turn, so against a strong opponent the game result alone barely punishes it); show_cells: list each
    side's cells under the board ("You (X): 4. Opponent (O): 2 5."), an easier read for a model from scratch;
    opening: start each game after up to this many rounds (the number drawn per example, 0 included) of the
    scripted minimax player's X and the example's own O, listed in the first message ("the moves so far were
    O 3, X 4, O 2."): more of a game's data is its harder end, and every game is shorter; opening_player: who
    plays X's opening moves, "minimax" (the scripted player) or "random" (a random free cell: an opening that shows
    no strategy, for the rules teacher); replay_from: where rl.py --exploit's replays start, "start" (the empty
    board, the line's replies scripting the opponent) or "mistake" (the position of the mistake, its moves listed
    as an opening's: every rollout makes that decision; the model must know the opening message, from SFT with
    opening > 0); check_reward: the weight of a reward component "check", the share of the model's replies whose
    <think> begins with a true statement of where each side could complete a line (`Wins: me 7, opponent none.`,
    as the rules_wins teacher writes it; where the think ends with rules_then's `Then: me 2 6.`, that must be true
    of the move too): a verifiable fact of the rules, so RL is not left to rewrite it as it
    rewrites the rest of an unscored think (docs/RANDOM_TEACHER.md); loss_penalty: a lost (or cut-off) game's "win"
    reward is -loss_penalty instead of 0, so that a block that saves a game pays more than a win adds;
    optimal_reward: the weight of a reward component "optimal", the share of the model's replies that made a
    minimax-optimal move (one that keeps the position's win/draw/loss value; an invalid move is not one): the
    solver scores every decision, so a missed block is paid for even when a weak opponent lets it go; the reward
    then knows the strategy that RL has to find (docs/RANDOM_TEACHER.md); puzzles: the share of examples that are
    puzzles, games that start where uniformly random play first reached a position demanding puzzle_kind, "block"
    (O threatens one line, X has no win, the game not yet lost), "win" (a line for X to complete now), "threat"
    (either), "opening" (X's first or second move, where some move loses the value), "second" (X's second move
    where some move loses it, X's first move optimal) or "start" (no position: a game from the empty board against
    a uniformly random opponent, cut off after two replies, so X's first two moves in a game's own messages), or a
    list of kinds (one drawn per puzzle), and end after puzzle_turns replies, so that a group's rollouts answer
    one decision (with optimal_reward, the solver scores it; the model must know the opening message, from SFT
    with opening > 0);
    missed_win_penalty: the weight of a reward component "missed_win", minus the share of the model's replies
    whose `Wins:` check names a cell where X could complete a line and whose move is elsewhere (an invalid move
    is not counted): a cost for a stated win that is not the move; show_wins: every message also states where each
    side could complete a line now ("Wins now: you 7, opponent none."), read off the board by the environment, so
    that a small model need not find its lines itself (the rules_wins teacher's check then copies it);
    replay_explore: a scripted player's name (the SFT teacher's, whose words the model writes): at the position of
    each mistake that rl.py --exploit replays, every other rollout of the group plays a free cell in the policy's
    place, in that player's words (`forced_reply`), so the group compares the mistake with moves the policy is too
    sure of to sample; null: off; exploit_rank: how rl.py --exploit ranks two certificates with as many lost lines,
    "mistakes" (fewer mistaken decisions) or "random_wins" (a higher exact win rate against the random opponent:
    among policies that never lose, the one that wins most against a weak one); exploit_stop: rl.py --exploit stops
    the run at the first certificate that finds no mistake (the exploiter has nothing left to teach); opponent: a
    function state -> cell that replaces the seeded opponent (not from --env_args: `python env_tictactoe.py` and tests pass
    one)."""
    return TicTacToe(min_random_move_prob, max_random_move_prob, num_groups, max_turns, invalid_penalty, show_cells, opening,
                     opening_player, replay_from, check_reward, loss_penalty, optimal_reward, puzzles, puzzle_kind, puzzle_turns,
                     missed_win_penalty, show_wins, replay_explore, exploit_rank, exploit_stop, opponent)


# ----------------------------------------------------------------------------- play against a model in the terminal


def play_human(policy, env_args, games=None):
    """Games in the terminal: the policy is X, you are O (input() asks for your cells); `games` of them, or until you
    say no."""
    from sample import advance, new_episode

    def ask(state):
        free = free_cells(state["board"])
        while True:
            text = input(f"your move (O), one of {free}: ").strip()
            if text.isdigit() and int(text) in free:
                return int(text)
            print("not a free cell, try again")
    env = load_environment(**env_args, opponent=ask)
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


# ----------------------------------------------------------------------------- the speedrun's report and checks

def write_report(out, times, teacher, teacher_p, sft_args, rl_args, env_args, puzzle_args="", polish_args="", wins_args="",
                 resumed=False):
    """OUT/results.json, OUT/report.md and OUT/curves.png from the evaluations speedrun.sh (or speedrun_random_teacher.sh)
    wrote to OUT/eval/{teacher,sft,rl}/{optimal,random,certify}; times = (SFT, RL, total) in seconds, or None; the SFT
    teacher (minimax with random-move probability teacher_p, or a rules teacher) and the other arguments name the run's recipe."""
    import platform

    import torch

    from eval import plot_curves
    t_sft, t_rl, t_all = times or (None, None, None)
    load = lambda who, task: json.load(open(os.path.join(out, "eval", who, task, "summary.json")))
    res = {w: {"optimal": load(w, "optimal"), "random": load(w, "random"), "certificate": load(w, "certify")} for w in ("teacher", "sft", "rl")}
    # a resumed speedrun (RESUME=1) times only its own invocation: the stages finished before it count ~0
    res["times_s"] = {"sft": int(t_sft), "rl": int(t_rl), "total": int(t_all), "resumed": resumed} if times else None
    res["machine"] = f"{platform.machine()}, {os.cpu_count()} cores" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", CPU only")
    # the RL stages the run had, in order: (directory, the model it starts from, its flags, its name); the last gives the
    # RL model, its best certificate's weights
    stages = [stage for stage in (("rl_puzzles", "sft", puzzle_args, "puzzle stage "),
                                  ("rl", "rl_puzzles" if puzzle_args else "sft", rl_args, ""),
                                  ("rl_polish", "rl", polish_args, "third stage "),
                                  ("rl_wins", "rl_polish_best", wins_args, "fourth stage ")) if stage[0] == "rl" or stage[2]]
    best = os.path.join(out, stages[-1][0] + "_best", "certificate.json")
    res["rl_step"] = json.load(open(best))["step"] if os.path.exists(best) else None  # the RL model's step
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=2)
    max_new = json.load(open(os.path.join(out, "eval", "rl", "optimal", "args.json")))["max_new_tokens"]
    teacher_flags = f"--teacher minimax --teacher_random_prob {teacher_p}" if teacher == "minimax" else f"--teacher {teacher}"
    name = {"teacher": f"teacher (minimax, random moves p={teacher_p})" if teacher == "minimax" else
                       f"teacher ({teacher}: a random legal move, no strategy)", "sft": "SFT model",
            "rl": "RL model" + (f" ({stages[-1][3]}step {res['rl_step']}: the best certificate)" if res["rl_step"] is not None else "")}
    rows = ["| model | opponent | win | draw | loss | format | games with invalid move |", "|---|---|---|---|---|---|---|"]
    for w in ("teacher", "sft", "rl"):
        for o in ("random", "optimal"):
            s = res[w][o]
            rows.append(f"| {name[w]} | {o} | {s['win_rate']:.1%} | {s['draw_rate']:.1%} | {s['loss_rate']:.1%} | {s['format_rate']:.1%} | {s['invalid_rate']:.1%} |")
    cert = ["| model | lines | won | drawn | lost | mistaken decisions | optimal moves | wins taken | threats blocked | "
            "other moves optimal | true `Wins:` checks | own wins stated | random opponent, exact: win / loss |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in ("teacher", "sft", "rl"):
        c = res[w]["certificate"]
        cert.append(f"| {name[w]} | {c['lines']} | {c['lines_won']} | {c['lines_drawn']} | {c['lines_lost']} | "
                    f"{c['mistakes']} of {c['decisions']} | {c['optimal_move_rate']:.1%} | {c['wins_taken']} of "
                    f"{c['win_positions']} | {c['threats_blocked']} of {c['block_positions']} | {c['quiet_optimal']} of {c['quiet_positions']} | "
                    f"{c['checks_true']} of {c['decisions']} | {c['wins_stated']} of {c['win_positions']} | "
                    f"{c['random_win_rate']:.1%} / {c['random_loss_rate']:.1%} |")
    # where the RL model still errs: the certificate's positions (board row by row, X = the model)
    errs = json.load(open(os.path.join(out, "eval", "rl", "certify", "certificate.json")))["mistake_positions"]
    shown = [f"- {m['kind']}: {m['board'][:3]}/{m['board'][3:6]}/{m['board'][6:]}, it replied "
             f"`{' '.join(m['reply'].split())}`" for m in errs[:20]]
    n = res["rl"]["optimal"]["n"]
    errors = (f"The RL model's mistaken decisions: {len(errs)} (the first {len(shown)} below; all in {out}/eval/rl/certify/certificate.json)"
              if errs else "The RL model makes no mistaken decision: each of its moves on every line is minimax-optimal.")
    nl = "\n"
    drawn = plot_curves([(d, os.path.join(out, d, "metrics.jsonl")) for d, *_ in stages], os.path.join(out, "curves.png"), CERTIFY_CURVES)
    metrics = ", ".join(f"{out}/{d}/metrics.jsonl" for d, *_ in stages)
    rl_commands = "".join(f"    python rl.py --model {out}/{start} {args} --out {out}/{d}{nl}" for d, start, args, _ in stages)
    report = f"""# speedrun report

Machine: {res['machine']}. {f"Wall time{' of this resumed invocation alone (RESUME=1; earlier ones not counted)' if resumed else ''}: SFT {t_sft}s, RL {t_rl}s, total with evaluation {t_all}s" if times else "Wall time: not given (--times)"}.

## Greedy play, {n} games per opponent
{nl.join(rows)}

## Certificate: the greedy policy against every opponent line (moving first and second)
{nl.join(cert)}

Each decision by what its position demands: a win to take (the model can complete a line at once), else a threat to
block (the opponent could), else another move, optimal by minimax (where forks are made or stopped). A true check:
the reply's <think> opens with `Wins: me A, opponent B.` and it is right (and its `Then: me C.`, where written);
own wins stated: at the positions with a win to take, the check's `me` part names exactly those cells. Random
opponent, exact: the greedy policy's results against a uniformly random opponent, every line weighted by its
probability (the games above sample them, 200 to about 2 points).

{errors}
{nl.join(shown)}

## Commands
    python sft.py --model scratch {teacher_flags} {sft_args} --out {out}/sft
{rl_commands}    python eval.py --model MODEL --opponent optimal random --certify -n {n} --temp 0 --max_new_tokens {max_new} --env_args '{env_args}' --out {out}/eval/WHO

Training curves: {f"{out}/curves.png (the RL stages one after another)" if drawn else "none drawn (matplotlib is not installed)"}; the metrics: {metrics}
"""
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report)
    print(report)


def puzzle_learnt(metrics_path, until):
    """Whether the solver's reward (reward_optimal) of an rl.py run averages `until` over its last 10 steps (the block
    stage of speedrun_random_teacher.sh PUZZLE_UNTIL); says what it found."""
    rows = [json.loads(line) for line in open(metrics_path)]
    last = [r["reward_optimal"] for r in rows if "reward_optimal" in r][-10:]
    mean = sum(last) / max(len(last), 1)
    print(f"the block stage at step {rows[-1]['step'] if rows else 0}: solver reward {mean:.3f} over its last {len(last)} steps (until {until})")
    return bool(last) and mean >= until


def lost_lines(certificate_path):
    """The lost lines of a certificate.json (speedrun_random_teacher.sh: the third stage's best); says how many."""
    lost = json.load(open(certificate_path))["lines_lost"]
    print(f"the third stage's best certificate: {lost} lost lines")
    return lost


def main():
    import argparse
    import sys

    from common import parse_env_args
    from policies import add_policy_args, policy_from_args
    p = add_policy_args(argparse.ArgumentParser(description="Play tic-tac-toe against a model in the terminal: the model is X, "
                                                "you are O (--env_args as for the model's training). Or, loading no model, "
                                                "the speedrun's report (--report) and checks (--puzzle_learnt, --lost_lines)."))
    p.set_defaults(temp=0.0)
    r = p.add_argument_group("the speedrun's report and checks (speedrun.sh, speedrun_random_teacher.sh)")
    r.add_argument("--report", default=None, metavar="OUT", help="write OUT/report.md, OUT/results.json and OUT/curves.png "
                   "(where matplotlib is installed) from the evaluations the speedrun left in OUT/eval; with --times, "
                   "--teacher and --random_move_prob (the SFT teacher's), --sft_args, --rl_args (and the other stages' flags) "
                   "and --env_args (the evaluation's) naming the run")
    r.add_argument("--times", type=int, nargs=3, default=None, metavar=("SFT", "RL", "TOTAL"), help="--report: wall times in seconds")
    r.add_argument("--resumed", action="store_true", help="--report: --times are those of a resumed run's last invocation alone (RESUME=1)")
    r.add_argument("--teacher", choices=["minimax", *RULES_PLAYERS], default="minimax", help="--report: the SFT teacher: minimax "
                   "with --random_move_prob (speedrun.sh), or rules / rules_wins / rules_then, random legal moves "
                   "(speedrun_random_teacher.sh TEACHER)")
    r.add_argument("--sft_args", default="", help="--report: the flags the run gave sft.py")
    r.add_argument("--rl_args", default="", help="--report: the flags the run gave rl.py (its main RL stage)")
    r.add_argument("--puzzle_args", default="", help="--report: the flags of an RL stage on puzzles before it, if any (PUZZLE_STEPS)")
    r.add_argument("--polish_args", default="", help="--report: the flags of an RL stage after it, if any (POLISH_STEPS)")
    r.add_argument("--wins_args", default="", help="--report: the flags of a fourth RL stage from the third's best weights, if any (WINS_STEPS)")
    r.add_argument("--puzzle_learnt", nargs=2, default=None, metavar=("METRICS", "UNTIL"), help="exit 0 if the solver reward "
                   "(reward_optimal) averages at least UNTIL over the last 10 steps of METRICS (an rl.py metrics.jsonl), else 1")
    r.add_argument("--lost_lines", default=None, metavar="CERT", help="exit 0 if the certificate CERT (a certificate.json) "
                   "loses a line, else 1")
    args = p.parse_args()
    if args.report:
        return write_report(args.report, args.times, args.teacher, args.random_move_prob, args.sft_args, args.rl_args,
                            args.env_args, args.puzzle_args, args.polish_args, args.wins_args, args.resumed)
    if args.puzzle_learnt:
        metrics, until = args.puzzle_learnt
        sys.exit(0 if puzzle_learnt(metrics, float(until)) else 1)
    if args.lost_lines:
        sys.exit(0 if lost_lines(args.lost_lines) > 0 else 1)
    try:
        env_args = parse_env_args(args.env_args)
        play_human(policy_from_args(args, load_environment(**env_args)), env_args)
    except (EOFError, KeyboardInterrupt):
        print("\nbye")


if __name__ == "__main__":
    main()
