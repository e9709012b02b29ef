"""guard.py: third-party environment code in a worker process, every call under a time limit. A reply that hangs,
crashes or eats the memory costs its own episode (reward 0, metric error/timeout), never the run; the other live
episodes go on in a new worker, rebuilt from their replies. Then a fuzz of adversarial replies over reasoning-gym
tasks and TextArena games, with the guard's overhead per call."""
import math
import random
import textwrap
import time

import pytest

import guard
from guard import FLOOR_CPU, GRACE, Forked, Guarded
from sample import rollout

MISBEHAVING = textwrap.dedent('''
    import os, signal, time

    class Env:
        """Count to 3, one reply a turn; some replies misbehave."""
        system_prompt, max_turns, reward_weights = "Count.", 4, {"count": 1.0}

        def __init__(self, start=0, reset_cpu=0.0):
            self.start, self.reset_cpu = start, reset_cpu

        def examples(self, n, seed=0):
            return [{"seed": seed * 1000 + i} for i in range(n)]

        def reset(self, example):
            begin = time.process_time()
            while time.process_time() - begin < self.reset_cpu:  # a slow one: some tasks' take 2 s
                pass
            return {"n": self.start, "seed": example["seed"]}, "Go."

        def step(self, state, reply):
            if reply == "spin":  # a runaway loop in Python: the worker interrupts it
                while True:
                    pass
            if reply == "slow":  # 1.5 s of CPU time, then one more: alone, within a 2 s limit
                begin = time.process_time()
                while time.process_time() - begin < 1.5:
                    pass
                reply = "one more"
            if reply == "quick":  # 0.1 s of CPU time: over the CPU floor, well under FLOOR
                begin = time.process_time()
                while time.process_time() - begin < 0.1:
                    pass
                reply = "one more"
            if reply == "hang":  # a hang no signal reaches (a loop in C): the worker is killed
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGPROF})
                time.sleep(3600)
            if reply == "crash":
                os._exit(3)
            if reply == "eat":
                hog = bytearray(1 << 36)
            if reply == "raise":
                raise RuntimeError("a library bug")
            state["n"] += reply == "one more"
            return None if state["n"] >= 3 else f"{state['n']} so far"

        def rewards(self, state):
            return {"count": state["n"] / 3}

        def metrics(self, state):
            return {"n_count": state["n"]}

        def scripted_player(self, name, random_move_prob=0.0):
            if name != "counter":
                raise ValueError(f"no player {name!r}")
            return lambda state: "one more"
''')


@pytest.fixture
def guarded(tmp_path, monkeypatch):
    (tmp_path / "misbehaving.py").write_text(MISBEHAVING)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = Guarded("misbehaving:Env", {}, timeout=2.0, memory_mb=2048)
    yield env
    env.close()


@pytest.mark.parametrize("bad", ["spin", "hang", "crash", "eat", "raise"])
def test_a_misbehaving_reply_costs_its_episode_only(guarded, bad):
    env = guarded
    a, _ = env.reset({"seed": 1})
    b, _ = env.reset({"seed": 2})
    assert env.step(a, "one more") == "1 so far" and env.step(b, "one more") == "1 so far"
    start = time.perf_counter()
    assert env.step(b, bad) is None  # b ends at once, within its time limit
    assert time.perf_counter() - start < env.timeout + GRACE + 1.0
    assert env.rewards(b) == {"count": 0.0}
    assert env.metrics(b) == {"n_count": 0.0, "error": 1.0, "timeout": float(bad in ("spin", "hang"))}
    assert env.step(b, "one more") is None  # an ended episode stays ended
    # a goes on where it was (rebuilt in a new worker where the old one was killed) and ends normally
    assert env.step(a, "one more") == "2 so far" and env.step(a, "one more") is None
    assert env.rewards(a) == {"count": 1.0} and env.metrics(a)["error"] == 0
    assert env.restarts == (bad in ("hang", "crash"))  # interrupted, out of memory or raising: the worker goes on


def test_a_load_that_overruns_fails_in_one_line_naming_where_it_was(tmp_path, monkeypatch):
    """As an endless generator listed whole would: the error names the line that ran on."""
    (tmp_path / "slow_load.py").write_text("import time\n\n\ndef read_every_task():\n    while True:\n"
                                           "        time.sleep(0.05)\n\n\n"
                                           "class Env:\n    def __init__(self):\n        read_every_task()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # the limit also covers the zygote's start (an interpreter, then this module): 3 s, ample on a loaded CPU
    monkeypatch.setattr(guard, "LOAD_TIMEOUT", 3.0)
    with pytest.raises(ValueError, match=r"^slow_load:Env failed to load in its worker: timeout: init took over "
                                         r"3 s, in /\S*slow_load.py:[56] \(read_every_task\)$"):
        Guarded("slow_load:Env", {})


def test_workers_are_forked_unless_the_library_starts_a_thread(guarded, tmp_path):
    """A worker is forked from the zygote that imported the environment's module; where that import starts a
    thread, forking is not safe, and each worker is a fresh interpreter, which works the same."""
    assert isinstance(guarded.proc, Forked)
    (tmp_path / "threaded.py").write_text("import threading, time\n"
                                         "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
                                         + MISBEHAVING)
    env = Guarded("threaded:Env", {}, timeout=2.0, memory_mb=2048)
    try:
        assert not isinstance(env.proc, Forked)
        a, _ = env.reset({"seed": 1})
        assert env.step(a, "one more") == "1 so far" and env.step(a, "crash") is None
        b, _ = env.reset({"seed": 2})  # a fresh worker again
        assert env.step(b, "one more") == "1 so far" and env.restarts == 1 and not isinstance(env.proc, Forked)
    finally:
        env.close()


def test_a_turn_of_slow_replies_waits_about_one_limit(guarded):
    """16 slow replies in one turn (1.5 s of CPU time each, within the 2 s limit alone) among 16
    innocent ones: the turn's calls share one limit, so the first slow reply passes, the second
    overruns what is left and each later one gets the floor. The rollout waits about one limit, not
    16 x 1.5 s; each slow episode but the first scores 0 with `timeout` 1, no worker restarts."""
    env = guarded

    def policy(episodes):  # episodes 0, 2, 4, ... are slow in their first turn; the others count
        return ["slow" if ep["index"] % 2 == 0 and len(ep["messages"]) == 2 else "one more"
                for ep in episodes]
    start = time.perf_counter()
    records = rollout(env, env.examples(32), policy, progress=False)
    seconds = time.perf_counter() - start
    # one limit, the floor for each slow reply after it, slack for a loaded machine (one by one:
    # 16 x 1.5 s = 24 s)
    assert seconds < env.timeout + 16 * FLOOR_CPU + 2.0, seconds
    for r in records[1:]:  # the first slow reply passes unless a loaded machine stretches its 1.5 s
        cut = r["index"] % 2 == 0
        assert r["reward"] == (0.0 if cut else 1.0) and r["metrics"]["timeout"] == float(cut)
        assert r["metrics"]["error"] == float(cut)
    assert env.restarts == 0


def test_quick_calls_however_many_never_spend_a_turns_limit(guarded):
    """32 replies of 0.1 s of CPU time each in one turn (3.2 s in all, over the 2 s limit; each over
    the CPU floor a call keeps once its turn's limit is spent): a call spends the limit only when it
    takes longer than FLOOR, so none is cut (a teacher's thousands of quick calls in one wave)."""
    env = guarded

    def policy(episodes):  # every episode's first reply is a quick one
        return ["quick" if len(ep["messages"]) == 2 else "one more" for ep in episodes]
    start = time.perf_counter()
    records = rollout(env, env.examples(32), policy, progress=False)
    assert time.perf_counter() - start > env.timeout  # the turn's calls together outlast the limit
    assert all(r["reward"] == 1.0 and r["metrics"]["timeout"] == 0 for r in records)
    assert env.restarts == 0


def test_a_kill_late_in_a_turn_still_rebuilds_the_others(tmp_path, monkeypatch):
    """After a reply spent its turn's limit, one that hangs where no signal reaches gets the floor and
    the worker is killed; the others are rebuilt in the new worker with the full limit, not the
    floor: their reset takes longer than the floor's CPU time, yet they score normally."""
    (tmp_path / "misbehaving.py").write_text(MISBEHAVING)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = Guarded("misbehaving:Env", {"reset_cpu": 1.5 * FLOOR_CPU}, timeout=1.0, memory_mb=2048)
    replies = {0: "spin", 1: "hang"}
    records = rollout(env, env.examples(3), lambda eps: [replies.get(ep["index"], "one more")
                                                         for ep in eps], progress=False)
    assert [r["metrics"]["timeout"] for r in records] == [1, 1, 0]
    assert [r["reward"] for r in records] == [0, 0, 1] and env.restarts == 1
    env.close()


def test_contract_through_the_guard(guarded):
    env = guarded
    assert (env.system_prompt, env.max_turns, env.reward_weights) == ("Count.", 4, {"count": 1.0})
    assert env.reward_names == ["count"] and env.metric_names == ["n_count"]
    assert env.examples(2, seed=3) == [{"seed": 3000}, {"seed": 3001}]
    player = env.scripted_player("counter")
    state, first = env.reset({"seed": 0})
    while env.step(state, player(state)) is not None:
        pass
    assert env.rewards(state) == {"count": 1.0}
    with pytest.raises(ValueError, match="no player 'nobody'"):
        env.scripted_player("nobody")


def test_bad_arguments_are_a_value_error_at_load(tmp_path, monkeypatch):
    (tmp_path / "misbehaving.py").write_text(MISBEHAVING)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        Guarded("misbehaving:Env", {"nope": 1})


# ----------------------------------------------------------------------------- the fuzz

ADVERSARIAL = ['<tool_call>{"name": "add", "arguments": {"a": 1e999, "b": []}}</tool_call>',
               '<tool_call>{"name": "multiply", "arguments": {"a": 99999999, "b": 99999999}}</tool_call>' * 20,
               "<guess>" + "9" * 5000 + "</guess>", "<guess>-1</guess>", "<answer>9 * * 9 * * 9</answer>",
               "<answer>9**9**9**9</answer>", "<answer>" + "9" * 5000 + "</answer>",
               "<answer>__import__('os').system('true')</answer>", "<answer>[" * 500 + "</answer>",
               "<answer>1e999999</answer>", "<answer>(" * 200 + ")" * 200 + "</answer>", "\x00\ud800", "",
               "[" + "9" * 4500 + "]", "[up]" * 1000, "[1, 2, 3]", "[A C]", "[999999999999 999999999999]",
               "<answer>nan</answer>", "<answer>-inf</answer>", "[0 0 d]" * 50, "<answer>" + "A" * 10**5 + "</answer>"]


def fuzz(env, n_episodes, rng):
    worst = 0.0
    for i in range(n_episodes):
        state, _ = env.reset(env.examples(1, seed=i)[0])
        for _ in range(min(env.max_turns, 6)):
            reply = rng.choice(ADVERSARIAL) if rng.random() < 0.7 else "".join(rng.sample(ADVERSARIAL, 2))
            start = time.perf_counter()
            message = env.step(state, reply)
            worst = max(worst, time.perf_counter() - start)
            if message is None:
                break
        rewards = env.rewards(state)
        assert all(math.isfinite(v) for v in rewards.values()) and set(env.metrics(state)) >= {"error", "timeout"}
    return worst


def test_fuzz_reasoning_gym_textarena_and_verifiers_never_raise_or_overrun():
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("textarena")
    pytest.importorskip("verifiers")
    import env_reasoning_gym
    import env_textarena
    import env_verifiers
    from conftest import ROOT
    rng, replies, seconds = random.Random(0), 0, 0.0
    envs = [env_reasoning_gym.load_environment(task=t, timeout=5.0) for t in ("countdown", "basic_arithmetic",
                                                                                  "puzzle24", "leg_counting")]
    envs += [env_textarena.load_environment(game=g, timeout=5.0) for g in ("GuessTheNumber-v0", "TowerOfHanoi-v0",
                                                                           "Set-v0", "2048-v0", "Minesweeper-v0")]
    envs += [env_verifiers.load_environment(path=str(ROOT / "tests" / "verifiers_envs" / f"{name}.py"), timeout=5.0)
             for name in ("vf_game", "vf_tools")]
    for env in envs:
        calls, spent = env.calls, env.call_seconds
        worst = fuzz(env, 80, rng)
        replies, seconds = replies + env.calls - calls, seconds + env.call_seconds - spent
        assert worst < env.timeout + GRACE + 1.0
        env.close()
    print(f"fuzz: {replies} guarded calls, {1e3 * seconds / replies:.2f} ms a call on average")
    assert replies > 1000, replies
