"""
A guard for third-party environment code (reasoning-gym, TextArena, Verifiers): it runs in a worker
process, each call into it (load, examples, reset, step, scoring, scripted players) under a time
limit and, where the platform has one, a memory limit. A reply that hangs a scorer, a library that
crashes or eats the memory, costs its episode (every reward 0, metric `error` 1, `timeout` 1 if time
ran out), never the run. A call that overruns is interrupted in the worker (a timer signal raises
Overrun there), which drops its episode and goes on; where no signal reaches it (a loop in C: a big
power, a regex), or the worker dies, it is killed, a new one started, and the other live episodes
are rebuilt in it by replaying their replies (an environment must be deterministic given them).

    env = Guarded("env_textarena:TextArena", {"game": "Set-v0"}, timeout=30)  # load_environment()

No step waits long on replies that overrun, however many: the calls of one turn (sample.rollout's
steps of a wave's episodes, inside the optional turn() hook) share one limit, spent by the calls
that take longer than FLOOR (quick ones, however many, spend nothing); once it is spent, a call
still gets `floor_cpu` seconds of CPU time (and FLOOR of clock), several times what a step costs.
So replies that spin hold a step about one limit, not one limit each (docs/VERIFIERS.md, "The
guard", has the numbers). Why so: the calls take milliseconds, while a kill costs a worker start
(1-5 s) and a replay of every live episode, hence the interrupt; the floor is CPU time so that a
loaded machine does not cut an innocent call short. More workers were weighed and not chosen: each
costs memory and a start, and replies that spin would share the same cores. Once the limit is
spent, a reply that sleeps still costs FLOOR, one that hangs in C FLOOR + GRACE and a restart.

The worker imports only the environment's module, never torch; only JSON lines cross the pipes
(prints go to /dev/null). Its signal handlers, atexit hooks, pools and random state are its own: a
library's SIGTERM handler can't change how the trainer stops (SIGALRM and SIGPROF are the guard's
timers there). It is forked from a zygote (`python guard.py --zygote`), a fresh interpreter that
imported the environment's library once (`preload`), so that a worker killed for a hang is back
in milliseconds, not in the library's import time (verifiers.v1: seconds to tens of seconds). One
zygote serves every guard of the process with the same interpreter, path and library.
"""
import contextlib
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

LOAD_TIMEOUT = 300.0  # seconds to import the module, build the environment, play the probe episode
# once its turn's limit is spent, a call may still take FLOOR seconds, and FLOOR_CPU of CPU time:
# 7 x the slowest step measured (7 ms: 95 reasoning-gym tasks, 56 TextArena games, our Verifiers
# test environments)
FLOOR, FLOOR_CPU = 1.0, 0.05
GRACE = 1.0  # seconds past its limit before a worker that has not interrupted the call is killed


def import_source(where):
    """A user-named module, by import name or .py path: an environment, a scripted teacher."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    name = os.path.basename(where)[:-3].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, where)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Guarded:
    """The environment contract (README) over a worker running FACTORY "module:callable"(**kwargs);
    `timeout`: seconds a call may take; `memory_mb`: its address-space limit (None: none)."""

    def __init__(self, factory, kwargs, timeout=30.0, memory_mb=16384, python=None,
                 floor_cpu=FLOOR_CPU, preload=()):
        self.factory, self.kwargs, self.timeout, self.memory_mb = factory, kwargs, timeout, memory_mb
        # the zygote imports these and the factory's module once; the worker forked from it, each
        # start (a missing one is the worker's to report, with its own error)
        self.preload = (factory.split(":")[0], *preload)
        self.floor_cpu = floor_cpu  # FLOOR_CPU, or more for a library whose steps cost more
        self.python = python  # the worker's interpreter (None: ours): one with the library
        self.proc, self.generation, self.next_id, self.live = None, 0, 0, {}
        self.calls, self.call_seconds, self.spent = 0, 0.0, None
        info = self._start()
        self.system_prompt, self.max_turns = info["system_prompt"], info["max_turns"]
        self.reward_weights, self.tools = info["reward_weights"], info.get("tools")
        self.reward_names, self.metric_names = info["reward_names"], info["metric_names"]
        self.scripted_players = tuple(info["scripted_players"])

    # ------------------------------------------------------------------------- the worker
    def _start(self):
        python, path = self.python or sys.executable, self._worker_path()
        self.proc = Zygote.shared(python, path, self.preload).fork()
        self.buffer, self.generation = b"", self.generation + 1
        # its stderr is the run's: warnings and tracebacks show, the datasets progress bars do not
        environ = {**os.environ, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        init = {"factory": self.factory, "kwargs": self.kwargs, "memory_mb": self.memory_mb,
                "path": path, "environ": environ, "cwd": os.getcwd()}
        kind, value = self._call("init", init, timeout=LOAD_TIMEOUT)
        if kind != "ok":  # one line for load_env to say (never a traceback): what to change
            self._kill()
            if kind in ("ValueError", "TypeError"):  # the adapter's own reason
                raise {"ValueError": ValueError, "TypeError": TypeError}[kind](value)
            raise ValueError(f"{self.factory} failed to load in its worker: {kind}: {value}")
        return value

    def _worker_path(self):
        """Our sys.path for the worker; for another interpreter only the entries outside our own
        installation (this project, a test's folders): its libraries are its own."""
        if not self.python:
            return list(sys.path)
        ours = tuple(p for p in {sys.prefix, sys.base_prefix, sys.exec_prefix} if p)
        return [p for p in sys.path if p and not p.startswith(ours)] + ["*"]

    @property
    def restarts(self):
        return self.generation - 1

    def _kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def _call(self, op, arg, timeout=None):
        """(kind, value): ("ok", result), (exception name, message) if the call raised, ("timeout",
        ...) if it overran (interrupted in the worker, or the worker killed), ("crash", ...) if the
        worker died (the next call then starts another)."""
        if self.proc is None:
            self._start()
        start, wall, cpu = time.perf_counter(), timeout or self.timeout, 0.0
        if self.spent:  # in a turn: what its calls before left of the limit, or the floors
            wall -= self.spent
            wall, cpu = (wall, 0.0) if wall > FLOOR else (FLOOR, self.floor_cpu)
        try:
            self.proc.stdin.write(json.dumps([op, arg, wall, cpu]).encode() + b"\n")
            reply = self._reply(op, wall, start)
        except (BrokenPipeError, OSError):
            code = self.proc.wait()
            self.proc = None
            reply = ["crash", f"the worker died in {op} (exit code {code}; out of memory?)"]
        seconds = time.perf_counter() - start
        self.calls, self.call_seconds = self.calls + 1, self.call_seconds + seconds
        if self.spent is not None and seconds > FLOOR:  # quick calls, however many, spend nothing
            self.spent += seconds
        return reply

    def _reply(self, op, wall, start):
        """The worker's reply to the call sent at `start`, or a timeout if the worker has not
        interrupted the call GRACE seconds after its limit (a hang in C): it is then killed."""
        left = wall + GRACE - (time.perf_counter() - start)
        line, self.buffer = _read_line(self.proc.stdout.fileno(), self.buffer, left)
        if line is None:
            self._kill()
            return ["timeout", f"{op} took over {wall:.3g} s (the worker was restarted)"]
        return json.loads(line)

    def _episode_call(self, state, op, arg):
        """A call for one live episode, first rebuilt if the worker is not the one it began in."""
        if state["generation"] != self.generation or self.proc is None:
            if not self._replay(state):
                return "crash", "could not be rebuilt after a restart"
        kind, value = self._call(op, arg)
        if kind in ("timeout", "crash"):
            self.live.pop(state["id"], None)
        return kind, value

    def _replay(self, state):
        if self.proc is None:
            self._start()
        state["generation"] = self.generation
        # these calls passed before: the full limit again, not the floors (some resets take 2 s)
        spent, self.spent = self.spent, None
        try:
            kind, _ = self._call("reset", [state["id"], state["example"]])
            for reply in state["replies"]:
                if kind != "ok":
                    break
                kind, value = self._call("step", [state["id"], reply])
                kind = kind if kind != "ok" or value[0] == "continue" else "ended"
        finally:
            self.spent = spent
        return kind == "ok"

    # ------------------------------------------------------------------------- the contract
    @contextlib.contextmanager
    def turn(self):
        """sample.rollout's optional hook around a turn's steps: the calls inside share one limit
        (`timeout`), a call gets at least the floors (steps that together take longer, legitimately,
        need a larger `timeout`)."""
        self.spent = 0.0
        try:
            yield
        finally:
            self.spent = None

    def examples(self, n, seed=0):
        kind, value = self._call("examples", [n, seed], timeout=max(self.timeout, LOAD_TIMEOUT))
        if kind != "ok":
            raise RuntimeError(f"{self.factory}: examples({n}, seed={seed}) failed in its worker: "
                               f"{value}")
        return value

    def reset(self, example):
        self.next_id += 1
        state = {"id": self.next_id, "guard": self, "example": example, "replies": [],
                 "generation": self.generation, "done": False, "error": None, "rewards": None,
                 "metrics": None, "describe": None}
        self.live[state["id"]] = state
        kind, value = self._episode_call(state, "reset", [state["id"], example])
        if kind != "ok":
            self._fail(state, kind, value)
            return state, f"(the environment failed to start this episode: {value})"
        return state, value

    def step(self, state, reply):
        if state["done"]:
            return None
        reply = reply if isinstance(reply, str) else str(reply)
        kind, value = self._episode_call(state, "step", [state["id"], reply])
        state["replies"].append(reply)
        if kind != "ok":
            return self._fail(state, kind, value)
        if value[0] == "continue":
            return value[1]
        state["done"] = True
        self.live.pop(state["id"], None)
        state["rewards"], state["metrics"], state["describe"] = value[1:]
        return None

    def _fail(self, state, kind, message):
        """End the episode as an error: every reward and metric 0, `error` (and `timeout`) 1."""
        state.update(done=True, error=f"{kind}: {message}", describe=f"{kind}: {message}",
                     rewards={k: 0.0 for k in self.reward_names},
                     metrics={k: 0.0 for k in self.metric_names})
        self.live.pop(state["id"], None)
        if kind not in ("timeout", "crash"):  # the worker is alive: let it drop the episode
            self._call("drop", state["id"])
        return None

    def rewards(self, state):
        return state["rewards"] or {k: 0.0 for k in self.reward_names}

    def metrics(self, state):
        error = state["error"] or ""
        metrics = state["metrics"] or {k: 0.0 for k in self.metric_names}
        return {**metrics, "error": max(float(bool(error)), metrics.get("error", 0.0)),
                "timeout": float(error.startswith("timeout"))}

    def describe(self, state):
        return state["describe"] or f"episode {state['id']} ({len(state['replies'])} replies so far)"

    def scripted_player(self, name):
        kind, value = self._call("player", [name])
        if kind != "ok":
            raise ValueError(value)

        def player(state):  # the episode's own guard plays: eval.py uses another instance's player
            if state["done"]:
                return ""
            kind, value = state["guard"]._episode_call(state, "play", [state["id"], name])
            return value if kind == "ok" else ""
        return player

    def close(self):
        self._kill()

    def __del__(self):
        self._kill()


def _read_line(fd, buffer, seconds=None):
    """(the next line, what follows it) from `buffer`, then from fd, within `seconds` (None: no
    limit), or (None, buffer) once they are up; BrokenPipeError where fd closes first."""
    start = time.perf_counter()
    while b"\n" not in buffer:
        left = None if seconds is None else seconds - (time.perf_counter() - start)
        if left is not None and left <= 0:
            return None, buffer
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise BrokenPipeError
            buffer += chunk
    return tuple(buffer.split(b"\n", 1))


class Zygote:
    """The process that forks a guard's workers: `python guard.py --zygote` on the worker's
    interpreter, which imports `preload` (the library: once), then forks a worker for each start.
    Forking after imports alone is safe; where an import started a thread, it is not, and each
    start is a fresh interpreter instead (as where the platform cannot fork)."""

    running = {}  # (python, path, preload) -> its Zygote: one for the process's life

    @classmethod
    def shared(cls, python, path, preload):
        key = (python, tuple(path), tuple(preload))
        zygote = cls.running.get(key)
        if zygote is None or (zygote.proc is not None and zygote.proc.poll() is not None):
            zygote = cls.running[key] = cls(python, path, preload)
        return zygote

    def __init__(self, python, path, preload):
        self.python, self.preload, self.forks = python, preload, None  # forks: known once ready
        if not hasattr(os, "fork"):
            self.proc, self.forks = None, False
            return
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--zygote",
                                      str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.sock.sendall(json.dumps({"path": path, "preload": preload}).encode() + b"\n")
        self.buffer = b""

    def _ask(self, what, fds=(), timeout=None):
        """Send one request (with file descriptors), return its reply line's words."""
        socket.send_fds(self.sock, [what.encode() + b"\n"], list(fds))
        return self._line(timeout)

    def _line(self, timeout):
        line, self.buffer = _read_line(self.sock.fileno(), self.buffer, timeout)
        if line is None:
            self.proc.kill()
            raise ValueError(f"importing {', '.join(self.preload)} in the guard's worker took "
                             f"over {timeout:g} s (guard.LOAD_TIMEOUT)")
        return line.decode().split()

    def fork(self):
        """A new worker: stdin, stdout, kill() and wait(), as a Popen has them."""
        if self.forks is None:
            try:
                self.forks = int(self._line(LOAD_TIMEOUT)[1]) == 1  # "ready THREADS"
            except OSError:  # an import killed it: the worker's own import says how
                self.forks = False
        if self.forks:
            requests, replies = os.pipe(), os.pipe()  # (read, write) each
            try:
                _, pid = self._ask("fork", fds=(requests[0], replies[1]), timeout=LOAD_TIMEOUT)
                os.close(requests[0])
                os.close(replies[1])
                return Forked(self, int(pid), os.fdopen(requests[1], "wb", 0),
                              os.fdopen(replies[0], "rb", 0))
            except OSError:  # the zygote died (an interpreter without file-descriptor passing)
                self.forks = False
                for fd in (*requests, *replies):
                    os.close(fd)
        return subprocess.Popen([self.python, os.path.abspath(__file__)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)


class Forked:
    """A worker forked by a zygote, which alone can wait for it."""

    def __init__(self, zygote, pid, stdin, stdout):
        self.zygote, self.pid, self.stdin, self.stdout = zygote, pid, stdin, stdout

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self):
        self.stdin.close()
        self.stdout.close()
        try:
            return int(self.zygote._ask(f"wait {self.pid}", timeout=GRACE + 5)[1])
        except Exception:  # the zygote is gone (or the interpreter exiting): its status with it
            return None


# ----------------------------------------------------------------------------- the worker's side
class Overrun(BaseException):
    """A call's time is up, raised in the worker by its timers: a BaseException, which a library's
    `except Exception` lets through."""


TIMER = {"armed": False, "fired": None, "where": ""}  # "fired": the signal that interrupted it


def _overrun(signum, frame):
    if TIMER["armed"]:  # once a call: a timer that fires after it is ignored
        TIMER.update(armed=False, fired=signum, where=_where(frame))
        raise Overrun


def _where(frame):
    """Where an overrun call was, for its error: the line running (mostly the library's) and the
    innermost line of this project's adapter that led there (the step that was slow)."""
    def line(f):
        path = f.f_code.co_filename
        path = path.split("site-packages" + os.sep)[-1] if "site-packages" in path else (
            os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path)
        return f"{path}:{f.f_lineno} ({f.f_code.co_name})"
    if frame is None:
        return ""
    here, ours, f = os.path.abspath(__file__), None, frame
    while f is not None and ours is None:
        path = os.path.abspath(f.f_code.co_filename)
        ours = f if os.path.dirname(path) == os.path.dirname(here) and path != here else None
        f = f.f_back
    return f", in {line(frame)}" + (f", from {line(ours)}" if ours not in (None, frame) else "")


def _arm(wall, cpu):
    TIMER["fired"] = None
    signal.setitimer(signal.ITIMER_REAL, wall)
    signal.setitimer(signal.ITIMER_PROF, cpu)  # 0: none
    TIMER["armed"] = True


def _disarm():
    TIMER["armed"] = False
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.setitimer(signal.ITIMER_PROF, 0)


def _serve(requests, proto):
    """Answer [op, arg, wall, cpu] lines from `requests` on `proto` until it closes, each call
    interrupted after `wall` seconds, or `cpu` seconds of CPU time (0: no such limit)."""
    env, states, players = None, {}, {}
    signal.signal(signal.SIGALRM, _overrun)
    signal.signal(signal.SIGPROF, _overrun)
    for line in requests:
        op, arg, wall, cpu = json.loads(line)
        try:
            _arm(wall, cpu)
            try:
                if op == "init":  # a forked worker takes the trainer's environment as it is now
                    os.environ.clear()
                    os.environ.update(arg["environ"])
                    os.chdir(arg["cwd"])
                    _set_path(arg["path"])
                    if arg["memory_mb"] and sys.platform.startswith("linux"):
                        import resource
                        limit = arg["memory_mb"] << 20
                        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                    module, name = arg["factory"].split(":")
                    env = getattr(import_source(module), name)(**arg["kwargs"])
                    result = _describe_env(env)
                elif op == "examples":
                    result = env.examples(*arg)
                elif op == "reset":
                    states[arg[0]], result = env.reset(arg[1])
                elif op == "step":
                    result = _step(env, states, *arg)
                elif op == "drop":
                    result = states.pop(arg, None) and None
                elif op in ("player", "play"):  # "player" checks, "play" plays (after restarts too)
                    if arg[-1] not in players:
                        players[arg[-1]] = env.scripted_player(arg[-1])
                    result = players[arg[-1]](states[arg[0]]) if op == "play" else None
            finally:
                _disarm()
            reply = ["ok", result]
        except Overrun:
            pass
        except Exception as e:  # the library raised: this call fails, the worker goes on
            kind = type(e).__name__ if type(e) in (ValueError, TypeError) else "error"
            reply = [kind, (str(e) if kind != "error" else f"{type(e).__name__}: {e}")[:2000]]
        if TIMER["fired"]:  # also where the library caught Overrun and went on: the episode ends
            if op in ("reset", "step", "play"):
                states.pop(arg[0], None)
            reply = ["timeout", (f"{op} took over {wall:.3g} s" if TIMER["fired"] == signal.SIGALRM
                                 else f"{op} took over {cpu:g} s of CPU time (its turn's limit "
                                 "was spent)") + TIMER["where"]]
        proto.write(json.dumps(reply).encode() + b"\n")
        proto.flush()


def _step(env, states, id, reply):
    state = states[id]
    message = env.step(state, reply)
    if message is not None:
        return ["continue", message]
    del states[id]
    return ["done", _floats(env.rewards(state)), _floats(_metrics(env, state)),
            env.describe(state) if hasattr(env, "describe") else None]


def _metrics(env, state):
    return env.metrics(state) if hasattr(env, "metrics") else {}


def _floats(d):
    return {k: float(v) for k, v in d.items()}


def _describe_env(env):
    """What the parent needs to know of the environment, with its reward and metric names from a
    probe episode (blank replies): an episode that fails later still reports the same names."""
    state, _ = env.reset(env.examples(1, seed=0)[0])
    for _ in range(env.max_turns):
        if env.step(state, "") is None:
            break
    return {"system_prompt": env.system_prompt, "max_turns": env.max_turns,
            "reward_weights": env.reward_weights, "tools": getattr(env, "tools", None),
            "reward_names": list(env.rewards(state)), "metric_names": list(_metrics(env, state)),
            "scripted_players": list(getattr(env, "scripted_players", ()))}


def _set_path(path):
    """sys.path as the trainer sent it ("*" last: the worker's own entries follow)."""
    if path[-1:] == ["*"]:
        path = path[:-1] + [p for p in sys.path if p not in path]
    sys.path[:] = path


def _zygote(fd):
    """Import the library once, then fork a worker for each "fork" request (its pipes come with
    it), report each one's exit status on "wait PID"; exit when the trainer's end closes."""
    sock = socket.socket(fileno=fd)
    setup = json.loads(_read_line(fd, b"")[0])
    _set_path(setup["path"])
    for name in setup["preload"]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: S110 (the worker's own import reports it, as it would unforked)
            pass
    sock.sendall(f"ready {threading.active_count()}\n".encode())
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 10, 2)
        if not message:
            return
        words = message.decode().split()
        if words[0] == "wait":
            code = os.waitstatus_to_exitcode(os.waitpid(int(words[1]), 0)[1])
            sock.sendall(f"exit {code}\n".encode())
            continue
        pid = os.fork()
        if pid == 0:  # the worker: its pipes as stdin and stdout
            try:
                sock.close()
                os.dup2(fds[0], 0)
                os.dup2(fds[1], 1)
                for f in fds:
                    os.close(f)
                _worker()
            finally:
                os._exit(0)
        for f in fds:
            os.close(f)
        sock.sendall(f"pid {pid}\n".encode())


def _worker():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it stops the worker
    proto = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the library's prints, and ours, never reach the protocol
    _serve(os.fdopen(0, "rb"), proto)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _zygote(int(sys.argv[2]))
    else:
        _worker()
