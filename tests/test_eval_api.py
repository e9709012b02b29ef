"""Tests for eval.py and policies.APIPolicy against a local fake OpenAI-compatible server.

The server (http.server in a thread, 127.0.0.1, a free port) answers POST /v1/chat/completions with a valid
chat.completion that plays tic-tac-toe legally (the lowest free cell named in the last user message). Faults
(429, 500, a slow response, a server that breaks after K requests, 401) are injected per test. Also: the
scripted baselines and the certificate. CPU only, offline, no model.
"""
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT

import eval as eval_mod
import common
import sample
from policies import APIPolicy, ScriptedPolicy

KEY = "sk-test"
SUMMARY_KEYS = {"n", "win_rate", "draw_rate", "loss_rate", "format_rate", "invalid_rate", "reward_mean"}

# ----------------------------------------------------------------------------- the fake server


def legal_reply(messages):
    """<think>t</think><move>N</move> with N the lowest free cell of the last user message."""
    last = [m["content"] for m in messages if m["role"] == "user"][-1]
    found = re.search(r"Free cells: ([0-9 ]+)\.", last)
    cell = found.group(1).split()[0] if found else "0"
    return f"<think>t</think><move>{cell}</move>"


class FakeOpenAI:
    """A threaded OpenAI-compatible chat server. fault(req) may return None (answer), an HTTP status to fail
    with, or ("sleep", seconds) to answer late; req has n (global request number), conv (number of the distinct
    conversation, in order of first arrival), attempt (1 for its first request) and messages."""

    def __init__(self, fault=None):
        self.fault = fault or (lambda req: None)
        self.lock = threading.Lock()
        self.log = []       # every request: dict(n, conv, attempt, turn, outcome)
        self.convs = {}     # conversation json -> [conv number, attempts]
        self.auth = set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, obj):
                data = json.dumps(obj).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout) before the answer

            def do_POST(self):
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                messages = body["messages"]
                key = json.dumps(messages)
                with server.lock:
                    server.auth.add(self.headers.get("Authorization"))
                    conv = server.convs.setdefault(key, [len(server.convs), 0])
                    conv[1] += 1
                    req = {"n": len(server.log), "conv": conv[0], "attempt": conv[1], "messages": messages,
                           "tools": body.get("tools"),
                           "turn": sum(m["role"] == "assistant" for m in messages) + 1, "outcome": None}
                    server.log.append(req)
                action = server.fault(req)
                if isinstance(action, int):
                    req["outcome"] = action
                    kind = "rate_limit_error" if action == 429 else "server_error"
                    return self._send(action, {"error": {"message": f"injected {action}", "type": kind, "code": None}})
                if isinstance(action, tuple) and action[0] == "sleep":
                    req["outcome"] = "slow"
                    time.sleep(action[1])
                else:
                    req["outcome"] = 200
                assert body["model"] and messages[0]["role"] == "system"
                content = legal_reply(messages)
                prompt_tokens = sum(len(m["content"].split()) for m in messages)
                self._send(200, {
                    "id": f"chatcmpl-{req['n']}", "object": "chat.completion", "created": int(time.time()),
                    "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 5, "total_tokens": prompt_tokens + 5}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def count(self, outcome=None):
        with self.lock:
            return sum(1 for r in self.log if outcome is None or r["outcome"] == outcome)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_api():
    servers = []

    def start(fault=None):
        servers.append(FakeOpenAI(fault))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


@pytest.fixture
def key_env(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)


def random_opponent_env():
    return common.load_env("tictactoe", common.eval_settings("tictactoe")["random"])


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def n_assistant(records):
    return sum(m["role"] == "assistant" for r in records for m in r["messages"])


def assert_replies_match(records):
    """Each model turn is the fake server's answer to exactly that episode's conversation so far."""
    for r in records:
        for i, m in enumerate(r["messages"]):
            if m["role"] == "assistant":
                assert m["content"] == legal_reply(r["messages"][:i])


# ----------------------------------------------------------------------------- the CLI against the fake API


def test_eval_cli_against_fake_api(fake_api, tmp_path):
    server = fake_api()
    out = tmp_path / "eval_api"
    env = {**os.environ, "OPENAI_API_KEY": KEY, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, "eval.py", "--model", "fake", "--api_base", server.base, "--setting", "random",
                        "-n", "6", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["n"] == 6
    assert summary["format_rate"] == 1.0 and summary["invalid_rate"] == 0.0
    assert summary["win_rate"] + summary["draw_rate"] + summary["loss_rate"] == pytest.approx(1.0)
    recs = read_jsonl(out / "rollouts.jsonl")
    assert len(recs) == 6 and sorted(r["index"] for r in recs) == list(range(6))
    # one request per model turn, each sent with the key, which is written nowhere
    assert server.count() == server.count(200) == n_assistant(recs)
    assert_replies_match(recs)
    assert server.auth == {f"Bearer {KEY}"}
    assert KEY not in p.stdout and KEY not in p.stderr
    for f in out.rglob("*"):
        if f.is_file():
            assert KEY not in f.read_text(errors="replace"), f"API key leaked into {f.name}"
    assert "win_rate" in p.stdout


# ----------------------------------------------------------------------------- retries, faults, resume


def test_evaluate_survives_429_500_and_timeout(fake_api, tmp_path, key_env):
    def fault(req):
        if req["conv"] == 0 and req["attempt"] == 1:
            return ("sleep", 1.5)  # longer than the client timeout: retried
        if req["conv"] % 3 == 1 and req["attempt"] == 1:
            return 429
        if req["conv"] % 3 == 2 and req["attempt"] <= (2 if req["conv"] % 2 == 0 else 1):
            return 500  # some conversations fail twice in a row
        return None
    server = fake_api(fault)
    env = random_opponent_env()
    policy = APIPolicy("fake", server.base, timeout=0.75, backoff=0.01, retries=6, concurrency=4)
    summary, recs = eval_mod.evaluate(env, policy, 6, out=str(tmp_path), progress=False)
    assert summary["n"] == 6 and len(read_jsonl(tmp_path / "rollouts.jsonl")) == 6
    assert summary["format_rate"] == 1.0 and summary["invalid_rate"] == 0.0
    assert server.count(429) >= 3 and server.count(500) >= 3 and server.count("slow") == 1
    slow = next(r for r in server.log if r["outcome"] == "slow")
    assert sum(1 for r in server.log if r["conv"] == slow["conv"]) >= 2, "the timed-out request was retried"
    # every conversation got an answer in the end, and each reply went to the episode that asked for it
    with server.lock:
        assert {r["conv"] for r in server.log if r["outcome"] == 200} == {r["conv"] for r in server.log}
    assert server.count(200) >= n_assistant(recs)
    assert_replies_match(recs)
    assert policy.gen_tokens == 5 * n_assistant(recs)  # usage.completion_tokens of the answers that arrived


def test_evaluate_fails_clearly_then_resumes(fake_api, tmp_path, key_env):
    n = 8
    env = random_opponent_env()
    # a healthy reference run: the game is deterministic (seeded opponent, deterministic fake model)
    ref_server = fake_api()
    ref_summary, ref = eval_mod.evaluate(env, APIPolicy("fake", ref_server.base, backoff=0.01), n,
                                         out=str(tmp_path / "ref"), progress=False)
    turns = {r["index"]: r["metrics"]["n_turns"] for r in ref}
    early = {i for i, t in turns.items() if t <= 3}
    assert 0 < len(early) < n, f"need games both shorter and longer than 3 turns, got {turns}"
    k = sum(min(t, 3) for t in turns.values())  # requests of the first three turns

    # a server that breaks for good after k answers: turn 4 never gets through
    broken = fake_api(lambda req: 500 if req["n"] >= k else None)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"still failing after 3 attempts") as e:
        eval_mod.evaluate(env, APIPolicy("fake", broken.base, backoff=0.01, retries=2), n, out=str(out), progress=False)
    assert broken.base in str(e.value) and "--resume" in str(e.value)
    assert broken.count(200) == k
    assert not (out / "summary.json").exists()
    kept = read_jsonl(out / "rollouts.jsonl")  # every line is valid JSON
    assert len(kept) > 0 and {r["index"] for r in kept} == early
    by_index = {r["index"]: r for r in ref}
    for r in kept:
        assert r["messages"] == by_index[r["index"]]["messages"]
    with open(out / "rollouts.jsonl", "a") as f:  # a line cut by a crash must not survive the resume
        f.write('{"index": 7, "rollout": 0, "messa')

    healthy = fake_api()
    summary, recs = eval_mod.evaluate(env, APIPolicy("fake", healthy.base, backoff=0.01), n, out=str(out),
                                      resume=True, progress=False)
    # only the unfinished games were played, from their start
    assert healthy.count() == sum(t for i, t in turns.items() if i not in early)
    lines = read_jsonl(out / "rollouts.jsonl")
    assert sorted((r["index"], r["rollout"]) for r in lines) == [(i, 0) for i in range(n)]
    assert [r["messages"] for r in recs] == [r["messages"] for r in ref]
    for key in SUMMARY_KEYS:
        assert summary[key] == pytest.approx(ref_summary[key])
    assert json.loads((out / "summary.json").read_text())["n"] == n


def test_resume_after_crash_inside_the_first_record(tmp_path):
    """A crash while the very first record was being written leaves only a cut line; resuming must not glue
    the next record onto it (eval.py used to rewrite the file only when it held a complete record)."""
    env = common.load_env("tictactoe")
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"index": 0, "rollout": 0, "mess')
    summary, recs = eval_mod.evaluate(env, ScriptedPolicy(env, "minimax"), 3, out=str(tmp_path), resume=True,
                                      progress=False)
    assert summary["n"] == 3
    lines = read_jsonl(path)  # raises on a glued line
    assert sorted(r["index"] for r in lines) == [0, 1, 2]


def test_resume_killed_while_rewriting_keeps_every_row(tmp_path, monkeypatch):
    """--resume rewrites rollouts.jsonl without its cut last line; a kill in that rewrite (raised where the new file
    would be swapped in) leaves every finished row in place, and the next resume goes on from them."""
    env = common.load_env("tictactoe")
    eval_mod.evaluate(env, ScriptedPolicy(env, "minimax"), 6, out=str(tmp_path), progress=False)
    path = tmp_path / "rollouts.jsonl"
    rows = path.read_text()
    path.write_text(rows + '{"index": 6, "rollout": 0, "mess')

    class Killed(Exception):
        pass

    def kill(*a, **kw):
        raise Killed
    monkeypatch.setattr(eval_mod.os, "replace", kill)
    with pytest.raises(Killed):
        eval_mod.evaluate(env, ScriptedPolicy(env, "minimax"), 8, out=str(tmp_path), resume=True, progress=False)
    monkeypatch.undo()
    assert path.read_text().startswith(rows) and len(read_jsonl_complete(path)) == 6
    summary, _ = eval_mod.evaluate(env, ScriptedPolicy(env, "minimax"), 8, out=str(tmp_path), resume=True, progress=False)
    assert summary["n"] == 8 and sorted(r["index"] for r in read_jsonl(path)) == list(range(8))


def read_jsonl_complete(path):
    """The lines of a JSONL file that parse."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def test_unreachable_endpoint(tmp_path, key_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    env = random_opponent_env()
    policy = APIPolicy("fake", f"http://127.0.0.1:{port}/v1", retries=1, backoff=0.01, timeout=5)
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"still failing after 2 attempts.*Is the server up"):
        eval_mod.evaluate(env, policy, 2, out=str(tmp_path), progress=False)
    assert time.time() - t0 < 10
    assert (tmp_path / "rollouts.jsonl").read_text() == ""


def test_non_retryable_status_fails_at_once(fake_api, key_env):
    server = fake_api(lambda req: 401)
    policy = APIPolicy("fake", server.base, retries=5, backoff=0.01)
    env = random_opponent_env()
    ep = sample.new_episode(env, env.examples(1)[0])
    with pytest.raises(RuntimeError, match=r"API error 401"):
        policy([ep])
    assert server.count() == 1, "a 401 is not retried"


# ----------------------------------------------------------------------------- baselines and the certificate


def _eval_main(monkeypatch, argv):
    monkeypatch.setattr(sys, "argv", ["eval.py", *argv])
    eval_mod.main()


def test_scripted_baselines(monkeypatch, tmp_path, capsys):
    _eval_main(monkeypatch, ["--model", "minimax", "--setting", "optimal", "-n", "50", "--out", str(tmp_path / "mm")])
    mm = json.loads((tmp_path / "mm" / "summary.json").read_text())
    _eval_main(monkeypatch, ["--model", "random", "--setting", "optimal", "-n", "50", "--out", str(tmp_path / "rnd")])
    rnd = json.loads((tmp_path / "rnd" / "summary.json").read_text())
    assert mm["n"] == rnd["n"] == 50
    assert mm["loss_rate"] == 0.0 and mm["win_rate"] == 0.0 and mm["draw_rate"] == 1.0  # optimal vs optimal
    assert rnd["loss_rate"] > 0.2
    assert mm["format_rate"] == rnd["format_rate"] == 1.0
    assert len(read_jsonl(tmp_path / "mm" / "rollouts.jsonl")) == 50
    assert "loss_rate" in capsys.readouterr().out


def test_several_opponents_and_exploit_in_one_run(monkeypatch, tmp_path):
    """--setting optimal random --exploit: one model load, each task in its own subdirectory, the same numbers
    as the separate runs."""
    _eval_main(monkeypatch, ["--model", "random", "--setting", "optimal", "random", "--exploit", "-n", "30", "--out", str(tmp_path / "all")])
    for task in ("optimal", "random"):
        _eval_main(monkeypatch, ["--model", "random", "--setting", task, "-n", "30", "--out", str(tmp_path / task)])
    _eval_main(monkeypatch, ["--model", "random", "--exploit", "--out", str(tmp_path / "exploit")])
    drop = lambda s: {k: v for k, v in s.items() if k not in ("wall_s", "episodes_per_s", "gen_tokens_per_s")}
    for task in ("optimal", "random", "exploit"):
        got = json.loads((tmp_path / "all" / task / "summary.json").read_text())
        assert drop(got) == drop(json.loads((tmp_path / task / "summary.json").read_text()))
    assert json.loads((tmp_path / "all" / "optimal" / "summary.json").read_text())["loss_rate"] > 0.3
    assert json.loads((tmp_path / "all" / "exploit" / "summary.json").read_text())["lines_lost"] > 100


def test_certificate(monkeypatch, tmp_path, capsys):
    _eval_main(monkeypatch, ["--model", "minimax", "--exploit", "--out", str(tmp_path / "mm")])
    mm = json.loads((tmp_path / "mm" / "summary.json").read_text())
    assert mm["lines"] > 100 and mm["lines_lost"] == 0 and mm["mistakes"] == 0 and mm["optimal_move_rate"] == 1.0
    assert mm["lines_won"] + mm["lines_drawn"] == mm["lines"]
    assert (tmp_path / "mm" / "lost_lines.jsonl").read_text() == ""
    env = common.load_env("tictactoe")
    rnd, mistakes = env.certify(ScriptedPolicy(env, "random"), out=str(tmp_path / "rnd"), progress=False)
    assert env.opponent is None, "certify leaves the seeded opponent in place"
    assert rnd["lines_lost"] > 100 and len(mistakes) == rnd["mistakes"] > 0
    assert rnd["optimal_move_rate"] < 0.9
    # each decision counted once by what its position demands; minimax gets every kind right
    for c in (mm, rnd):
        assert c["win_positions"] + c["block_positions"] + c["quiet_positions"] == c["decisions"]
    assert mm["wins_taken"] == mm["win_positions"] > 0 and mm["threats_blocked"] == mm["block_positions"] > 0
    assert mm["quiet_optimal"] == mm["quiet_positions"] > 0

    import env_tictactoe as ttt

    seen = {"win": 0, "block": 0, "forced block": 0}  # the policy's own count of the positions it is shown

    def wins_never_blocks(episodes):  # completes a line when it can, else a cell that does not block, if one is free
        def cell(b):
            unblocking = [c for c in ttt.free_cells(b) if c not in ttt.threats(b, "O")]
            seen["win"] += bool(ttt.threats(b, "X"))
            seen["block"] += not ttt.threats(b, "X") and bool(ttt.threats(b, "O"))
            seen["forced block"] += not ttt.threats(b, "X") and bool(ttt.threats(b, "O")) and not unblocking
            return (ttt.threats(b, "X") or unblocking or ttt.free_cells(b))[0]
        return [f"<think>x</think><move>{cell(ep['state']['board'])}</move>" for ep in episodes]
    greedy, _ = env.certify(wins_never_blocks, progress=False)
    assert greedy["wins_taken"] == greedy["win_positions"] == seen["win"] > 0
    assert greedy["checks_true"] == greedy["wins_stated"] == 0  # its <think> states no check
    # the minimax player's think opens with the true check (but for "Only cell 8 is free."); its `me` part, once
    # blanked, names no win it has
    minimax, last_cell = ScriptedPolicy(env, "minimax"), [0]

    def counted(episodes):
        last_cell[0] += sum(len(ttt.free_cells(ep["state"]["board"])) == 1 for ep in episodes)
        return minimax(episodes)
    mm2, _ = env.certify(counted, progress=False)
    assert mm2["checks_true"] == mm2["decisions"] - last_cell[0] and mm2["wins_stated"] == mm2["win_positions"] > 0
    blind = lambda episodes: [r.replace("Wins: me ", "Wins: me none, was ").replace("was none, ", "") for r in minimax(episodes)]
    half, _ = env.certify(blind, progress=False)
    assert half["wins_stated"] == 0 and half["checks_true"] == mm2["checks_true"] - half["win_positions"]
    assert greedy["block_positions"] == seen["block"] > greedy["threats_blocked"] == seen["forced block"] > 0
    lost = read_jsonl(tmp_path / "rnd" / "lost_lines.jsonl")
    assert len(lost) == rnd["lines_lost"] and all(r["metrics"]["loss"] == 1.0 for r in lost)
    with pytest.raises(SystemExit, match="--temp 0"):
        _eval_main(monkeypatch, ["--model", "minimax", "--exploit", "--temp", "1.0"])


def test_eval_cli_bad_env_args_is_a_clear_error(monkeypatch):
    with pytest.raises(SystemExit, match="not valid JSON"):
        _eval_main(monkeypatch, ["--model", "minimax", "-n", "1", "--env_args", "{max_turns: 3"])


def test_certificate_lines_replay_as_examples():
    """Each mistake comes with its line (model_first + the opponent's replies): as an example it replays from
    the empty board to the mistake, even where the environment has an opening; after it the seeded opponent plays."""
    env = common.load_env("tictactoe", {"opening": 3})
    first_free = lambda board: f"<think>The first free cell.</think><move>{board.index('.')}</move>"

    class FirstFree:  # deterministic and weak: it loses lines moving first and second
        gen_tokens = 0

        def __call__(self, episodes):
            return [first_free(ep["state"]["board"]) for ep in episodes]
    summary, mistakes = env.certify(FirstFree(), progress=False)
    assert summary["lines_lost"] > 0 and {m["model_first"] for m in mistakes} == {True, False}
    for m in mistakes:
        state, _ = env.reset({"seed": 7, "random_move_prob": 0.0, "model_first": m["model_first"], "replies": m["replies"]})
        while state["board"] != m["board"]:
            assert env.step(state, first_free(state["board"])) is not None, m
        while env.step(state, first_free(state["board"])) is not None:
            pass
        if m["value_after"] == -1:  # the optimal opponent after the line wins what the mistake lost
            assert state["winner"] == "O"
    with pytest.raises(ValueError, match="not a free cell"):
        env.reset({"seed": 7, "random_move_prob": 0.0, "model_first": False, "replies": {"." * 9: 9}})


def test_certificate_gives_the_exact_results_against_a_random_opponent():
    """random_win/draw/loss_rate: each certificate line weighted by its probability under a uniformly random
    opponent, who starts half the time; checked against a direct recursion over the boards."""
    import env_tictactoe as ttt
    env = common.load_env("tictactoe")
    results = []
    for pick in (lambda b: b.index("."), lambda b: ttt.free_cells(b)[-1], ttt.player_move):
        policy = lambda episodes: [f"<think>x</think><move>{pick(ep['state']['board'])}</move>" for ep in episodes]
        summary, _ = env.certify(policy, progress=False)

        def x_moves(board):  # (win, draw, loss) probabilities from here, X (the policy) to move
            board = ttt.play(board, pick(board), "X")
            w = ttt.winner(board)
            return (float(w == "X"), float(w == "draw"), 0.0) if w else o_moves(board)

        def o_moves(board):  # the same, the random opponent to move
            total = [0.0, 0.0, 0.0]
            for cell in ttt.free_cells(board):
                after = ttt.play(board, cell, "O")
                w = ttt.winner(after)
                result = (0.0, float(w == "draw"), float(w == "O")) if w else x_moves(after)
                total = [t + r / len(ttt.free_cells(board)) for t, r in zip(total, result)]
            return total
        want = [(a + b) / 2 for a, b in zip(x_moves("." * 9), o_moves("." * 9))]
        got = [summary[f"random_{k}_rate"] for k in ("win", "draw", "loss")]
        assert got == pytest.approx(want, abs=1e-12) and sum(got) == pytest.approx(1.0)
        results.append(got)
    assert results[0][2] > 0.1 and results[2][2] == 0.0 and results[2][0] > 0.8  # weak players lose; minimax never


def test_report_curves_put_the_stages_on_one_step_axis(tmp_path):
    """The speedrun report's curves draw its RL stages one after another: each stage's steps continue from the last
    step of the one before (a stage with no metrics file is left out); a PNG is written where matplotlib is installed."""
    for name, steps in (("rl", [0, 1, 2, 3]), ("rl_polish", [0, 5, 10])):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for s in steps:
                f.write(json.dumps({"step": s, "reward": float(s), "exploit_lines_lost": 10 - s}) + "\n")
    stages = [(d, str(tmp_path / d / "metrics.jsonl")) for d in ("rl_puzzles", "rl", "rl_polish")]
    rows, starts = eval_mod.stages_on_one_axis(stages)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 3, 8, 13]
    assert [r["reward"] for r in rows] == [0, 1, 2, 3, 0, 5, 10]  # the rows themselves unchanged
    assert starts == [(0, "rl"), (3, "rl_polish")]
    drawn = eval_mod.plot_curves(stages, str(tmp_path / "curves.png"))  # matplotlib is optional: drawn where installed
    assert drawn == os.path.exists(tmp_path / "curves.png") == (importlib.util.find_spec("matplotlib") is not None)


def test_an_environments_tools_are_offered_to_an_api_model(fake_api, key_env):
    pytest.importorskip("verifiers")
    from policies import make_policy
    from sample import rollout
    env = common.load_env("verifiers", {"path": os.path.join(ROOT, "tests", "verifiers_envs", "vf_tools.py")})
    api = fake_api()
    policy = make_policy("teacher", env, api_base=api.base, concurrency=2)
    records = rollout(env, env.examples(2, seed=0), policy, progress=False)
    assert len(records) == 2 and api.count(200) >= 2
    assert all([t["function"]["name"] for t in r["tools"]] == ["add", "multiply"] for r in api.log)
