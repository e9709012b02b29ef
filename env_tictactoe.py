"""
Tic-tac-toe against a seeded, unbiased minimax opponent: the multi-turn game the course describes.

    python eval.py --model minimax --env tictactoe -n 2 --show 2      # watch the scripted player
    python eval.py --model random --env tictactoe --setting optimal   # a baseline
    python play_tictactoe.py --model out/rl                           # play against a model

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
marks. Pure Python: no torch (but certify, which plays a policy through sample.py).
"""
import copy
import fractions
import functools
import hashlib
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
                "success": float(result in ("X", "draw")),  # not lost: eval.py's pass@k counts it
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
        # what each position demands: a win to take, else a threat to block, else a quiet move
        # (forks are made or stopped there); per kind, [positions, the policy's right moves]; a
        # <think> that opens with the `Wins:` check (the minimax and rules_wins teachers'): how
        # often it is true, and at positions with a win to take, how often it names exactly X's wins
        tally = {"decisions": 0, "optimal": 0, "win": [0, 0], "block": [0, 0], "quiet": [0, 0],
                 "checks_true": 0, "wins_stated": 0}
        lines, mistakes, random_result = [], [], {"win": 0.0, "draw": 0.0, "loss": 0.0}
        while frontier:
            replies = policy(frontier)
            nxt = []
            for ep, reply in zip(frontier, replies):
                for child in branch_replies(ep, self.judge(ep, reply, tally, mistakes)):
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
        summary = certificate_summary(lines, tally, mistakes, random_result)
        if out:
            write_certificate(out, summary, mistakes, lines)
        return summary, mistakes

    def judge(self, ep, reply, tally, mistakes):
        """certify's count of one decision on a line, in `tally`: optimal or not, right or not for
        what its position demands, its `Wins:` check; a move that loses the position's value, or an
        invalid one, joins `mistakes` with its line. Returns the board after the move (None after an
        invalid one)."""
        board = ep["state"]["board"]
        cell, _ = parse_move(reply, board)
        best = best_moves(board, "X")
        tally["decisions"] += 1
        tally["optimal"] += cell in best
        wins, blocks = threats(board, "X"), threats(board, "O")
        kind, right = ("win", wins) if wins else ("block", blocks) if blocks else ("quiet", best)
        tally[kind][0] += 1
        tally[kind][1] += cell in right
        tally["checks_true"] += self.check_is_true(reply, board)
        tally["wins_stated"] += bool(wins) and stated_own_wins(reply) == wins
        line = {"model_first": ep["example"]["model_first"], "replies": ep["state"]["replies"]}
        if cell is None:
            mistakes.append({"board": board, "reply": reply[:200], "kind": "invalid move", **line})
            return None
        before, after_board = value(board, "X"), play(board, cell, "X")
        w = winner(after_board)
        after = 1 if w == "X" else 0 if w == "draw" else -value(after_board, "O")
        if after < before:
            mistakes.append({"board": board, "reply": reply[:200],
                             "kind": ("missed a forced win" if before == 1
                                      else "lost a drawn position"),
                             "value_before": before, "value_after": after, **line})
        return after_board

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


# TicTacToeLab's own options, named here for load_environment to point to the lab when given one:
# the lab imports the game, never the reverse (a test holds this list to the lab's signature)
LAB_OPTIONS = ("opening_player", "replay_from", "check_reward", "loss_penalty", "optimal_reward",
               "puzzles", "puzzle_kind", "puzzle_turns", "missed_win_penalty", "show_wins",
               "replay_explore", "exploit_rank", "exploit_stop")


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
        name = next(iter(lab_options))
        if name in LAB_OPTIONS:
            raise TypeError(f"{name} is an option of tictactoe_lab (env_tictactoe_lab.py): "
                            "--env tictactoe_lab")
        raise TypeError(f"load_environment() got an unexpected keyword argument {name!r}")
    return TicTacToe(min_random_move_prob, max_random_move_prob, num_groups, max_turns,
                     invalid_penalty, show_cells, opening, opponent, player_random_prob)


# common.load_env lists the options it accepts off this signature: the game's, not **lab_options
load_environment.__signature__ = inspect.signature(TicTacToe)


# ------------------------------------------------------- the certificate's lines, numbers and files

def branch(ep):
    """A copy of an episode that goes on apart from it (certify branches lines over the opponent's
    replies): lists and environment state copied, the rest shared, the KV cache included (the fast
    engine gives the copy a row of its own); lists copied whole, far faster than deepcopy."""
    child = {k: list(v) if isinstance(v, list) else v for k, v in ep.items()}
    child["state"] = copy.deepcopy(ep["state"])
    return child


def branch_replies(ep, after):
    """certify's next lines from an episode whose move led to board `after` (None: an invalid
    move): one per free cell the opponent could reply, each with its share of the line's
    probability; one alone where the game is over or the move was invalid. Made one at a time, as
    certify plays each on."""
    cells = free_cells(after) if after is not None and winner(after) is None else [None]
    for c in cells:
        child = branch(ep)
        child["line_prob"] = ep["line_prob"] / len(cells)
        if c is not None:
            child["state"]["replies"] = {**ep["state"]["replies"], after: c}
        yield child


def certificate_summary(lines, tally, mistakes, random_result):
    """certify's numbers from its finished lines, its `tally` of decisions (TicTacToe.judge), its
    mistakes and the exact results against a random opponent."""
    won = sum(r["metrics"]["win"] for r in lines)
    drawn = sum(r["metrics"]["draw"] for r in lines)
    decisions = tally["decisions"]
    return {"lines": len(lines), "lines_won": int(won), "lines_drawn": int(drawn),
            "lines_lost": int(len(lines) - won - drawn), "decisions": decisions,
            "optimal_move_rate": tally["optimal"] / max(decisions, 1), "mistakes": len(mistakes),
            "win_positions": tally["win"][0], "wins_taken": tally["win"][1],
            "block_positions": tally["block"][0], "threats_blocked": tally["block"][1],
            "quiet_positions": tally["quiet"][0], "quiet_optimal": tally["quiet"][1],
            "checks_true": tally["checks_true"], "wins_stated": tally["wins_stated"],
            **{f"random_{result}_rate": p for result, p in random_result.items()}}


def write_certificate(out, summary, mistakes, lines):
    """certify's files in `out`: summary.json, certificate.json (with the mistakes' positions) and
    lost_lines.jsonl (the lost lines' messages, rewards and metrics)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out, "certificate.json"), "w") as f:
        json.dump({**summary, "mistake_positions": mistakes}, f, indent=2)
    with open(os.path.join(out, "lost_lines.jsonl"), "w") as f:
        for r in lines:
            if r["metrics"]["loss"]:
                f.write(json.dumps({k: r[k] for k in ("messages", "rewards", "metrics")}) + "\n")
