"""
Tic-tac-toe's research variants, built on the game (env_tictactoe.py): `--env tictactoe_lab` takes
every option of the game and these (TicTacToeLab; docs/RANDOM_TEACHER.md is their recipe):

  - puzzles (puzzles, puzzle_kind, puzzle_turns): games that start where random play first reached
    a position demanding a decision (a block, a win, an opening move), cut off after a reply or two;
  - the rules teachers (rules, rules_wins, rules_then), scripted players that know only the format
    and the rules, and openings of random X moves for them (opening_player="random");
  - show_wins: every message states where each side could complete a line now;
  - more reward kinds: a true `Wins:` check, the solver's score of each move, a lost game below
    zero, a stated win not taken (check_reward, optimal_reward, loss_penalty, missed_win_penalty);
  - at rl.py --exploit's replays: starting at the mistake (replay_from="mistake"), exploring other
    moves there (replay_explore: the forced_reply hook), another ranking of certificates
    (exploit_rank) and the run's end at a certificate without a mistake (exploit_stop).

    python sft.py --model scratch --env tictactoe_lab --teacher rules_wins \
        --env_args '{"show_cells": true, "show_wins": true}'
    python env_tictactoe_lab.py --puzzle_learnt out/random_teacher/rl_puzzles/metrics.jsonl 0.85
    python env_tictactoe_lab.py --lost_lines out/random_teacher/rl_polish_best/exploit.json
"""
import inspect
import json
import re

import env_tictactoe as ttt
from env_tictactoe import (TicTacToe, best_moves, check_options, free_cells, integer, non_negative,
                           number, parse_move, play, stable_rng, stated_own_wins, threats, value,
                           winner, wins_check, wins_now)

# the positions a puzzle can start at (puzzle_kind; see `demands` and TicTacToeLab.puzzle)
PUZZLE_KINDS = ("block", "win", "threat", "opening", "second", "start")
EXPLOIT_RANKS = ("mistakes", "random_wins")  # rl.py --exploit's tie-break of lost lines (rank_of)
RULES_PLAYERS = ("rules", "rules_wins", "rules_then")  # warm-up teachers: format and rules only
# every scripted player: the game's, then the rules teachers (sft.py --teacher, replay_explore)
SCRIPTED_PLAYERS = (*TicTacToe.scripted_players, *RULES_PLAYERS)
# the game's evaluation settings, with no puzzles: the standard evaluations play full games
EVAL_SETTINGS = {name: {**setting, "puzzles": 0.0} for name, setting in ttt.EVAL_SETTINGS.items()}

# ----------------------------------------------------------------------------- puzzles


def demands(board, kind):
    """Does X to move on `board` face a puzzle of `kind`: "block" (O threatens one line, X has no
    win, and the game is not yet lost, so the block is the one move that keeps it), "win" (a line
    for X to complete now), "threat" (either), "opening" (X's first or second move, where some move
    loses the position's value) or "second" (X's second move, where some move loses it)?"""
    if kind in ("opening", "second"):
        x_moves = (0, 1) if kind == "opening" else (1,)
        return board.count("X") in x_moves and len(best_moves(board, "X")) < len(free_cells(board))
    wins, their_wins = threats(board, "X"), threats(board, "O")
    block = not wins and len(their_wins) == 1 and value(board, "X") > -1
    return (kind != "win" and block) or (kind != "block" and bool(wins))


def puzzle_line(rng, kind):
    """A line of uniformly random play, by both sides, to the first position that `demands` `kind`,
    X to move: (model_first, replies, board), the fields of a replayed line's example (see
    TicTacToeLab.first_moves). An "opening" puzzle is X's first or second move, drawn at random, so
    that the second moves are not all cut short by a first. A "second" puzzle's line has X's first
    move optimal, not random: the second moves a good first move leads to."""
    while True:
        model_first, board, replies = rng.random() < 0.5, "." * 9, {}
        nth = rng.randrange(2) if kind == "opening" else None
        if not model_first:
            replies[board] = rng.choice(free_cells(board))
            board = play(board, replies[board], "O")
        while winner(board) is None:
            if demands(board, kind) and nth in (None, board.count("X")):
                return model_first, replies, board
            board = play(board, rng.choice(best_moves(board, "X") if kind == "second"
                                           else free_cells(board)), "X")
            if winner(board) is not None:
                break
            replies[board] = rng.choice(free_cells(board))
            board = play(board, replies[board], "O")


def line_moves(model_first, replies, board):
    """The moves ["O 3", "X 4", ...] of a replayed line from the empty board to `board`, X to move:
    O's are the `replies` ({board: cell}, as certify records them), X's lead to the next board."""
    now, moves, x_to_move = "." * 9, [], model_first
    while now != board:
        if x_to_move:
            nxt = [c for c in free_cells(now)
                   if play(now, c, "X") in replies or play(now, c, "X") == board]
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


# -------------------------------------------------------------- the rules teachers and their checks

# rules_then's last words in a <think>: where X could complete a line after its move (then_check)
THEN_RE = re.compile(r"Then: me (?:[0-8](?: [0-8])*|none)\.(?=</think>)")


def then_check(board, cell):
    """Where X could complete a line after taking `cell`: 'Then: me 2 6.'"""
    return f"Then: me {' '.join(map(str, threats(play(board, cell, 'X'), 'X'))) or 'none'}."


def scripted_reply(name, board, cell):
    """The reply of scripted player `name` taking `cell` as X (the game's: player_reply). The rules
    players play a random free cell, knowing only the rules and the format (warm-up teachers with
    no strategy: docs/RANDOM_TEACHER.md): 'rules' lists the free cells in its <think>; 'rules_wins'
    first states where each side could complete a line now (`Wins: me 7, opponent none.`, a fact of
    the rules; what to do about it is left to RL); 'rules_then' also ends with where X could then
    complete a line (`Then: me 2 6.`): the next `me` is that less O's reply, a copy, no search."""
    if name not in RULES_PLAYERS:
        return ttt.player_reply(board, cell)
    check = f"{wins_check(board, 'X')} " if name != "rules" else ""
    then = f" {then_check(board, cell)}" if name == "rules_then" else ""
    return (f"<think>{check}Free cells: {' '.join(map(str, free_cells(board)))}. "
            f"I take cell {cell}.{then}</think><move>{cell}</move>")


def states_the_wins(reply, board):
    """Does the reply's <think> begin with a true `Wins: me A, opponent B.` for X on `board` (the
    game's check, env_tictactoe.states_the_wins), and, where it ends with `Then: me C.` (the
    rules_then teacher's words), is that true of the move it makes?"""
    if not ttt.states_the_wins(reply, board):
        return False
    then = THEN_RE.search(reply)
    if then is None:
        return True
    cell, _ = parse_move(reply, board)
    return cell is not None and then.group(0) == then_check(board, cell)


# ----------------------------------------------------------------------------- the environment


class TicTacToeLab(TicTacToe):
    """The game (TicTacToe, whose options **game are) with the research options, through its hooks:

    opening_player: who plays X's opening moves, "minimax" (the scripted player) or "random" (a
    random free cell: an opening with no strategy, for the rules teacher); replay_from: where rl.py
    --exploit's replays start, "start" (the empty board, the line's replies scripting the opponent)
    or "mistake" (the mistake's position, its moves listed as an opening's: every rollout makes that
    decision; the model must know the opening message, from SFT with opening > 0); check_reward:
    the weight of a reward "check", the share of the model's replies whose <think> begins with a
    true statement of where each side could complete a line (`Wins: me 7, opponent none.`, the
    rules_wins teacher's words; a rules_then `Then: me 2 6.` must be true of the move too): a
    verifiable fact of the rules, so RL does not rewrite it as it rewrites the rest of an unscored
    think (docs/RANDOM_TEACHER.md); loss_penalty: a lost (or cut-off) game's "win" reward is
    -loss_penalty instead of 0, so that a block that saves a game pays more than a win adds;
    optimal_reward: the weight of a reward "optimal", the share of replies that made a
    minimax-optimal move (one keeping the position's win/draw/loss value; an invalid move is not
    one): the solver scores every decision, so a missed block costs even when a weak opponent lets
    it go; the reward then knows the strategy RL has to find (docs/RANDOM_TEACHER.md); puzzles: the
    share of examples that are puzzles, games that start where uniformly random play first reached
    a position demanding puzzle_kind (see `demands`; "second": X's first move optimal; "start": no
    position, a game from the empty board against a uniformly random opponent, cut off after two
    replies), or a list of kinds (one drawn per puzzle), and end after puzzle_turns replies, so that
    a group's rollouts answer one decision (with optimal_reward, the solver scores it; the model
    must know the opening message); missed_win_penalty: the weight of a reward "missed_win", minus
    the share of replies whose `Wins:` check names a cell where X could complete a line and whose
    move is elsewhere (invalid moves aside): a cost for a stated win not taken; show_wins: every
    message also states where each side could complete a line now ("Wins now: you 7, opponent
    none."), read off the board, so that a small model need not find its lines itself (the
    rules_wins teacher's check then copies it); replay_explore: a scripted player's name (the SFT
    teacher's, whose words the model writes), or null: at each mistake's position that rl.py
    --exploit replays, every other rollout of the group plays a free cell in the policy's place, in
    that player's words (`forced_reply`), so the group compares the mistake with moves the policy
    is too sure of to sample; exploit_rank: how rl.py --exploit ranks certificates with as many lost
    lines, "mistakes" (fewer mistaken decisions) or "random_wins" (a higher exact win rate against
    the random opponent: of policies that never lose, the one that wins most against a weak one);
    exploit_stop: rl.py --exploit ends the run at the first certificate with no mistake (the
    exploiter has nothing left to teach)."""
    scripted_players = SCRIPTED_PLAYERS

    def __init__(self, opening_player="minimax", replay_from="start", check_reward=0.0,
                 loss_penalty=0.0, optimal_reward=0.0, puzzles=0.0, puzzle_kind="threat",
                 puzzle_turns=1, missed_win_penalty=0.0, show_wins=False, replay_explore=None,
                 exploit_rank="mistakes", exploit_stop=False, **game):
        super().__init__(**game)
        kinds = ([puzzle_kind] if isinstance(puzzle_kind, str)
                 else puzzle_kind if isinstance(puzzle_kind, list) else [])
        check_options([
            ("show_wins", show_wins, isinstance(show_wins, bool), "true or false"),
            ("opening_player", opening_player, opening_player in ("minimax", "random"),
             '"minimax" or "random"'),
            ("replay_from", replay_from, replay_from in ("start", "mistake"),
             '"start" or "mistake"'),
            ("replay_explore", replay_explore, replay_explore in (None, *SCRIPTED_PLAYERS),
             "null or a scripted player: " + ", ".join(map(repr, SCRIPTED_PLAYERS))),
            ("exploit_rank", exploit_rank, exploit_rank in EXPLOIT_RANKS,
             " or ".join(map(repr, EXPLOIT_RANKS))),
            ("exploit_stop", exploit_stop, isinstance(exploit_stop, bool), "true or false"),
            ("check_reward", check_reward, non_negative(check_reward), "a number >= 0"),
            ("loss_penalty", loss_penalty, non_negative(loss_penalty), "a number >= 0"),
            ("optimal_reward", optimal_reward, non_negative(optimal_reward), "a number >= 0"),
            ("missed_win_penalty", missed_win_penalty, non_negative(missed_win_penalty),
             "a number >= 0"),
            ("puzzles", puzzles, number(puzzles) and 0 <= puzzles <= 1, "a share in [0, 1]"),
            ("puzzle_kind", puzzle_kind, kinds and all(k in PUZZLE_KINDS for k in kinds),
             " or ".join(map(repr, PUZZLE_KINDS)) + ", or a list of them"),
            ("puzzle_turns", puzzle_turns, integer(puzzle_turns) and puzzle_turns >= 1,
             "a positive integer")])
        self.show_wins, self.opening_player = show_wins, opening_player
        self.replay_from, self.replay_explore = replay_from, replay_explore
        # rl.py's Exploiter reads exploit_stop
        self.exploit_rank, self.exploit_stop = exploit_rank, exploit_stop
        self.check_reward, self.loss_penalty = check_reward, loss_penalty
        self.optimal_reward = optimal_reward
        self.puzzles, self.puzzle_kinds, self.puzzle_turns = puzzles, kinds, puzzle_turns
        self.missed_win_penalty = missed_win_penalty
        # an instance's weights: the class's are every other game's
        extra = {name: w for name, w in (("check", check_reward), ("optimal", optimal_reward),
                                         ("missed_win", missed_win_penalty)) if w}
        if extra:
            self.reward_weights = {**TicTacToe.reward_weights, **extra}

    def examples(self, n, seed=0):
        """The game's examples; with `puzzles`, each is, with that probability, a `puzzle`."""
        rows, rng = super().examples(n, seed), stable_rng(seed, "puzzles")
        for row in rows if self.puzzles else []:
            if rng.random() < self.puzzles:
                row.update(self.puzzle(rng))
        return rows

    def puzzle(self, rng):
        """A puzzle's example fields: a game that starts where random play first reached a position
        demanding a `puzzle_kind` (`puzzle_line`; of a list, one drawn per puzzle), its moves listed
        as an opening's, cut off after `puzzle_turns` replies; or, "start", a game from the empty
        board against a uniformly random opponent, cut off after X's first two moves."""
        # one kind draws nothing: a one-kind list gives the same examples as that kind alone
        kind = (self.puzzle_kinds[0] if len(self.puzzle_kinds) == 1
                else rng.choice(self.puzzle_kinds))
        if kind == "start":
            return {"model_first": rng.random() < 0.5, "random_move_prob": 1.0, "max_turns": 2}
        model_first, replies, board = puzzle_line(rng, kind)
        return {"model_first": model_first, "replies": replies, "position": board,
                "max_turns": self.puzzle_turns}

    # --- the game's hooks
    def new_state(self, example):
        """The game's state, with an example's "max_turns" (a puzzle's), the extra rewards' counts
        (note_reply) and the board a replay explores at ("explore", forced_reply)."""
        return {**super().new_state(example), "max_turns": example.get("max_turns", self.max_turns),
                "true_checks": 0, "missed_wins": 0, "optimal_moves": 0,
                "explore": example.get("explore")}

    def first_moves(self, state, example):
        """With "position" (a board on the example's replayed line, X to move: a puzzle's, or a
        replay's from the mistake), the game starts there, its moves listed as an opening's."""
        if "position" not in example:
            return super().first_moves(state, example)
        state["board"] = example["position"]
        return line_moves(state["model_first"], state["replies"], example["position"])

    def opening_move(self, board, seed):
        """opening_player="random": a random free cell, seeded by (example seed, board)."""
        if self.opening_player == "random":
            return stable_rng(seed, board, "opening X").choice(free_cells(board))
        return super().opening_move(board, seed)

    def note_reply(self, state, reply, cell):
        """The counts of the extra rewards: true checks, optimal moves, stated wins not taken."""
        state["true_checks"] += self.check_is_true(reply, state["board"])
        if cell is not None:
            state["optimal_moves"] += cell in best_moves(state["board"], "X")
            named = stated_own_wins(reply) or []
            state["missed_wins"] += bool(named) and cell not in named

    def rewards(self, state):
        """The game's rewards, loss_penalty's "win", and the extra components with a weight set."""
        rewards = super().rewards(state)
        if state["winner"] not in ("X", "draw"):
            # a game neither won nor drawn (lost, or cut off) scores -loss_penalty: above 0, not
            # losing is worth more than winning is, the certificate's aim
            rewards["win"] = -self.loss_penalty
        if self.check_reward:
            rewards["check"] = state["true_checks"] / max(state["turns"], 1)
        if self.optimal_reward:
            rewards["optimal"] = state["optimal_moves"] / max(state["turns"], 1)
        if self.missed_win_penalty:
            rewards["missed_win"] = -state["missed_wins"] / max(state["turns"], 1)
        return rewards

    def check_is_true(self, reply, board):
        """The game's check, and rules_then's `Then:` where written (`states_the_wins`)."""
        return states_the_wins(reply, board)

    def scripted_reply(self, name, board, cell):
        """The rules players' words too (`scripted_reply`)."""
        return scripted_reply(name, board, cell)

    def notes(self, board):
        """show_wins: a line stating where each side could complete a line now, under the game's."""
        if not self.show_wins:
            return super().notes(board)
        mine, theirs = wins_now(board, "X")  # read off the board for the model: a fact of the rules
        return [*super().notes(board), f"Wins now: you {mine}, opponent {theirs}."]

    def rank_of(self, summary):
        """With exploit_rank="random_wins", lost lines, then the exact win rate against the random
        opponent, higher first."""
        if self.exploit_rank == "random_wins":
            return summary["lines_lost"], -summary["random_win_rate"]
        return super().rank_of(summary)

    def replay_of(self, mistake):
        """The game's replay; replay_from="mistake" starts it at the position of the mistake, and
        replay_explore marks that board for forced_reply."""
        replay = super().replay_of(mistake)
        if self.replay_from == "mistake":
            replay["position"] = mistake["board"]
        if self.replay_explore:
            replay["explore"] = mistake["board"]
        return replay

    # --- sample.rollout's hook
    def forced_reply(self, state, rollout):
        """sample.rollout's exploration hook (replay_explore): at a replayed mistake's position (the
        example's "explore" board), the group's odd rollouts play a free cell in the policy's place
        (in turn from one the seed picks), in replay_explore's words; rl.py trains such a reply as
        if sampled, with its advantage, no importance weight. Elsewhere None: the policy plays."""
        if state["explore"] != state["board"] or rollout % 2 == 0:
            return None
        cells = free_cells(state["board"])
        return scripted_reply(self.replay_explore, state["board"],
                              cells[(state["seed"] + rollout // 2) % len(cells)])


def load_environment(**env_args):
    """The game with the lab's options: env_tictactoe.load_environment's, and TicTacToeLab's."""
    return TicTacToeLab(**env_args)


# common.load_env reads the options off this signature (it passes rl.py's num_groups where named)
load_environment.__signature__ = inspect.Signature([
    *inspect.signature(ttt.load_environment).parameters.values(),
    *(p for p in inspect.signature(TicTacToeLab).parameters.values() if p.kind != p.VAR_KEYWORD)])


# --------------------------------------------------------------- the random-teacher recipe's checks

def puzzle_learnt(metrics_path, until):
    """Whether the solver's reward (reward_optimal) of an rl.py run averages `until` over its last
    10 steps (the block stage of speedrun_random_teacher.sh PUZZLE_UNTIL); says what it found."""
    rows = [json.loads(line) for line in open(metrics_path)]
    last = [r["reward_optimal"] for r in rows if "reward_optimal" in r][-10:]
    mean = sum(last) / max(len(last), 1)
    print(f"the block stage at step {rows[-1]['step'] if rows else 0}: solver reward {mean:.3f} "
          f"over its last {len(last)} steps (until {until})")
    return bool(last) and mean >= until


def lost_lines(certificate_path):
    """A certificate's lost lines (exploit.json or certificate.json: the recipe's third stage's
    best); says how many."""
    lost = json.load(open(certificate_path))["lines_lost"]
    print(f"the third stage's best certificate: {lost} lost lines")
    return lost


def main():
    import argparse
    import sys

    p = argparse.ArgumentParser(description="speedrun_random_teacher.sh's checks, answered by the "
                                "exit status (to play against a model trained here: python "
                                "play_tictactoe.py --env tictactoe_lab --model DIR)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--puzzle_learnt", nargs=2, default=None, metavar=("METRICS", "UNTIL"),
                       help="exit 0 if the solver reward (reward_optimal) averages at least UNTIL "
                       "over the last 10 steps of METRICS (an rl.py metrics.jsonl), else 1")
    which.add_argument("--lost_lines", default=None, metavar="CERT",
                       help="exit 0 if the certificate CERT (an exploit.json or certificate.json) "
                       "loses a line, else 1")
    args = p.parse_args()
    if args.puzzle_learnt:
        metrics, until = args.puzzle_learnt
        sys.exit(0 if puzzle_learnt(metrics, float(until)) else 1)
    sys.exit(0 if lost_lines(args.lost_lines) > 0 else 1)


if __name__ == "__main__":
    main()
