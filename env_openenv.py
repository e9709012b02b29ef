"""
OpenEnv environments (Hugging Face/Meta's standard, https://github.com/meta-pytorch/OpenEnv), as
they are: the `Environment` class imported and stepped in the guard's worker, no server, no Docker.

    uv venv .venv-openenv && uv pip install --python .venv-openenv/bin/python openenv==0.10.0
    python eval.py --env openenv -n 20 --model tests/openenv_envs/players.py:look_up_and_submit \\
        --env_args '{"path": "tests/openenv_envs/lookup.py", "python": ".venv-openenv/bin/python"}'
    python rl.py --env openenv --batch 64 --group 8 --env_args '{"id": "my_env.server.env:MyEnv",
        "args": {"level": 2}, "python": ".venv-openenv/bin/python"}'

env_args: `id` ("module:Class", an installed module) or `path` (a .py file; `id` then optionally
the class's name, else the one Environment class the file defines); `args`: the class's keyword
arguments; `python`: the worker's interpreter (a venv with openenv: it brings ~110 packages, none
of which the trainer needs); `split`: a TaskProvider's split (default "train", else its first);
`system_prompt`; `max_turns` (default 16: replies after which an episode not done is cut off);
`timeout`: seconds a call may take (guard.py). A server URL (`url`, `base_url`) is refused: this
runs the class itself, so name it.

Each episode builds its own instance (as OpenEnv's HTTP server builds one per session) and resets
it with the example's seed, or with its TaskProvider's split and index where the class has one
(list_splits, num_tasks: examples walk its tasks). Seeding: the global `random`, and numpy's where
loaded, are the episode's own around every call into the environment (construction included),
seeded by the example's seed, so an environment that ignores the seed but draws from them is
seeded, episodes interleave as each alone, and a replay (guard.py) plays the same. Determinism is
probed at load: two instances reset with the same seed must show the same first observation; one
that still differs (a private or system RNG, the clock) is refused, with the reason.

The Action, from the reply: an Action with one field (besides metadata), a str, takes the whole
reply; any other is offered as a tool named after its class (parameters: its JSON schema), called
with a <tool_call>{"name": ..., "arguments": {...}}</tool_call> block (Hermes/Qwen3, through the
chat template's `tools`); an MCPEnvironment's tools (ListToolsAction at load) are offered as they
are and each call becomes a CallToolAction (the tool answers bad arguments itself). A reply whose
actions cannot all be built (no call, an unknown tool, arguments that do not validate) steps
nothing: it costs its turn, the next message says why, metric `n_invalid`. Each call is one step,
in order, until one ends the episode.

Observations: the fields other than done/reward/metadata, as text (the metadata where there are
none: a plain Observation); after a tool call each is a tool message. Reward `reward`: the sum of
the steps' rewards (None counts 0). Metrics: `n_invalid`, `n_steps`, `cut_off` (max_turns reached
before done). docs/OPENENV.md has more.
"""
import asyncio
import contextlib
import inspect
import json
import logging
import os
import random
import sys
import typing

from env_verifiers_v1 import DEFAULT_MAX_TURNS, parse_tool_calls, start_row
from guard import Guarded, import_source

# openenv's web UI (gradio: 6 of its 8 s import here) serves /web on an HTTP server, which never
# runs here: imported before openenv (as the guard's zygote imports this module first), openenv
# goes without it, as it does where gradio is not installed
sys.modules.setdefault("openenv.core.env_server.web_interface", None)
# the zygote's imports, once for every worker it forks (FastMCP's server too, which an MCP
# environment's first instance would import: 1 s)
PRELOAD = ("openenv.core.env_server", "fastmcp.server.server")
SHOWN = 2000  # characters of an invalid reply's reason, or of a description


def load_environment(id=None, path=None, args=None, python=None, split=None, system_prompt=None,
                     max_turns=DEFAULT_MAX_TURNS, timeout=30.0, url=None, base_url=None):
    """An OpenEnv Environment class behind the guard (see above)."""
    if url is not None or base_url is not None:
        raise ValueError(f"a server URL ({url or base_url}) is not run here: this runs the "
                         "Environment class itself, in-process; name it instead, e.g. "
                         '{"id": "my_env.server.my_environment:MyEnvironment"}')
    if python is not None and not (isinstance(python, str) and os.access(python, os.X_OK)):
        raise ValueError(f"python={python!r}: not an executable (a venv's interpreter with "
                         "openenv, e.g. .venv-openenv/bin/python)")
    kwargs = {"id": id, "path": os.path.abspath(path) if isinstance(path, str) else path,
              "args": args, "split": split, "system_prompt": system_prompt, "max_turns": max_turns}
    # a step may run several MCP tool calls, 5-10 ms of CPU each (FastMCP's in-memory client opens
    # a session a call), a reset builds an instance (70 ms for an MCP one): past its turn's spent
    # limit a call keeps 0.25 s of CPU
    return Guarded("env_openenv:open_environment", kwargs, timeout=timeout, python=python,
                   floor_cpu=0.25, preload=PRELOAD)


def open_environment(id=None, path=None, args=None, split=None, system_prompt=None,
                     max_turns=DEFAULT_MAX_TURNS):
    """The guard worker's factory."""
    if args is not None and not isinstance(args, dict):
        raise ValueError(f"args={args!r}: must be a JSON object of the class's keyword arguments")
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
        raise ValueError(f"max_turns={max_turns!r}: must be an integer >= 1")
    # a tool that raises is the model's to read (its tool message says so), not the run's log,
    # where FastMCP would print each one's traceback
    logging.getLogger("fastmcp").setLevel(logging.CRITICAL)
    cls = environment_class(id, path)
    try:
        return OpenEnv(cls, args or {}, split, system_prompt, max_turns)
    except ValueError:
        raise
    except Exception as e:  # the library's failure at load (a constructor, list_tools): one line
        raise ValueError(f"{cls.__name__} failed to load: {type(e).__name__}: "
                         f"{str(e).strip()}".replace("\n", "; ")) from None


def import_openenv():
    """openenv.core's classes we use, or ValueError naming what to install."""
    try:
        from openenv.core.env_server import interfaces, mcp_types, types
    except ImportError as e:
        raise ValueError(f"--env openenv needs openenv ({e}): `uv pip install openenv==0.10.0`, "
                         'or env_args "python": an interpreter that has it') from None
    try:
        from openenv.core.env_server.mcp_environment import MCPEnvironment
    except ImportError:  # without fastmcp: no MCP environment can import either
        MCPEnvironment = None
    return interfaces.Environment, types.Action, MCPEnvironment, mcp_types


def environment_class(id, path):
    """The named Environment subclass; ValueError saying what to name otherwise."""
    Environment = import_openenv()[0]
    if path is not None:
        if not (isinstance(path, str) and path.endswith(".py") and os.path.isfile(path)):
            raise ValueError(f"path={path!r}: no such .py file")
        module = import_source(path)
        if id is None:
            found = [c for c in vars(module).values() if isinstance(c, type)
                     and issubclass(c, Environment) and c.__module__ == module.__name__
                     and not inspect.isabstract(c)]
            if len(found) != 1:
                raise ValueError(f"{path} defines {len(found)} Environment classes "
                                 f"({', '.join(c.__name__ for c in found)}): name one as id")
            return found[0]
        name = id
    else:
        if not (isinstance(id, str) and ":" in id):
            raise ValueError(f'id={id!r}: give "module:Class" (an installed module), or path '
                             "(a .py file)")
        where, name = id.rsplit(":", 1)
        try:
            module = import_source(where)
        except ModuleNotFoundError as e:
            raise ValueError(f"id={id!r}: {e} (install it, or give its file as path)") from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{name!r} in {module.__name__} is not an openenv Environment class "
                         "(a client class talks to a server: name the server's Environment)")
    return cls


def action_class(cls, Environment, Action):
    """The Action subclass an Environment class declares: Environment[MyAction, ...] or
    step(action: MyAction); None where it declares none."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin, params = typing.get_origin(base), typing.get_args(base)
            if isinstance(origin, type) and issubclass(origin, Environment) and params \
                    and isinstance(params[0], type) and issubclass(params[0], Action):
                return params[0]
    try:
        hint = typing.get_type_hints(cls.step).get("action")
    except Exception:  # noqa: BLE001 (an unresolvable annotation: as if there were none)
        hint = None
    return hint if isinstance(hint, type) and issubclass(hint, Action) else None


def resolved(value):
    """A TaskProvider method's result: a provider's methods may be async."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def render(value):
    """An observation's value as the model reads it."""
    if isinstance(value, str):
        return value
    content = getattr(value, "content", None)
    if isinstance(content, list) and all(hasattr(c, "text") for c in content):  # an MCP result
        return "\n".join(c.text for c in content)
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    return json.dumps(value, default=str)


class OpenEnv:
    reward_weights = {"reward": 1.0}

    def __init__(self, cls, args, split, system_prompt, max_turns):
        Environment, Action, MCPEnvironment, self.mcp_types = import_openenv()
        self.cls, self.args, self.max_turns, self.name = cls, args, max_turns, cls.__name__
        self.is_mcp = MCPEnvironment is not None and issubclass(cls, MCPEnvironment)
        probe = self._instance(0)
        self.action = self.mcp_types.CallToolAction if self.is_mcp else action_class(
            cls, Environment, Action)
        if self.action is None:
            raise ValueError(f"{self.name} declares no Action class: subclass Environment"
                             "[MyAction, MyObservation, MyState] or annotate its step's action")
        fields = {k: f.annotation for k, f in self.action.model_fields.items() if k != "metadata"}
        self.text_field = next(iter(fields)) if list(fields.values()) == [str] else None
        if self.is_mcp:
            self.tools = self._list_tools(probe)
        elif self.text_field:
            self.tools = None
        else:
            self.tools = [self._tool(self.action.__name__, self.action.__doc__,
                                     self.action.model_json_schema())]
        self.tasks = self._tasks(probe, split)
        description = probe.get_metadata().description
        hint = (" Act by calling a tool: <tool_call>{\"name\": ..., \"arguments\": {...}}"
                "</tool_call>." if self.tools else "")
        self.system_prompt = system_prompt if system_prompt is not None else description + hint
        probe.close()
        self._refuse_nondeterminism()

    def render(self, observation):
        """What the model reads of an observation: its fields but done/reward/metadata, each
        `name: value` where there are several, the metadata where there are none; a tool call's
        result or error."""
        if isinstance(observation, self.mcp_types.CallToolObservation):
            error = observation.error
            return f"error: {error.message}" if error else render(observation.result)
        fields = {k: getattr(observation, k) for k in type(observation).model_fields
                  if k not in ("done", "reward", "metadata")} or observation.metadata
        if len(fields) == 1:
            return render(next(iter(fields.values())))
        return "\n".join(f"{k}: {render(v)}" for k, v in fields.items())

    @staticmethod
    def _tool(name, description, schema):
        schema = {**schema, "properties": {k: v for k, v in schema.get("properties", {}).items()
                                           if k != "metadata"}}
        schema.pop("title", None)
        return {"type": "function", "function": {"name": name, "description": (
            description or "").strip(), "parameters": schema}}

    def _list_tools(self, probe):
        listed = probe.step(self.mcp_types.ListToolsAction())
        if not listed.tools:
            raise ValueError(f"{self.name} lists no MCP tools ({listed.metadata or 'none'})")
        return [self._tool(t.name, t.description, t.input_schema) for t in listed.tools]

    def _tasks(self, probe, split):
        """(split, its number of tasks) of a TaskProvider, None without one."""
        if not (callable(getattr(probe, "num_tasks", None))
                and callable(getattr(probe, "list_splits", None))):
            return None
        names = [s if isinstance(s, str) else s["name"] if isinstance(s, dict) else s.name
                 for s in resolved(probe.list_splits())]
        split = split if split is not None else "train" if "train" in names else names[0]
        if split not in names:
            raise ValueError(f"split={split!r}: {self.name} has the splits {names}")
        count = resolved(probe.num_tasks(split))
        if not (isinstance(count, int) and count > 0):
            raise ValueError(f"{self.name}.num_tasks({split!r}) is {count!r}: no tasks to play")
        return split, count

    def _refuse_nondeterminism(self):
        example = self.examples(1, seed=0)[0]
        (one, first), (two, again) = self.reset(example), self.reset(example)
        self._close(one)
        self._close(two)
        if first != again:
            raise ValueError(
                f"{self.name} is not deterministic: two resets with the same seed (python's "
                "random and numpy seeded alike) began differently, so its episodes cannot be "
                "replayed; draw from its seed, not a private or system RNG "
                f"({first[:80]!r} then {again[:80]!r})")

    @contextlib.contextmanager
    def _seeded(self, state):
        """The episode's random states in the global `random` and numpy's, the outer ones back
        after (numpy's where it is loaded: an environment that uses it has imported it)."""
        np = sys.modules.get("numpy")
        outer = random.getstate(), np.random.get_state() if np else None
        random.setstate(state["random"])
        if np:
            np.random.set_state(state["numpy"] or np.random.RandomState(
                state["seed"] % 2**32).get_state())
        try:
            yield
        finally:
            state["random"] = random.getstate()
            random.setstate(outer[0])
            if np:
                state["numpy"] = np.random.get_state()
                np.random.set_state(outer[1])

    @staticmethod
    def _new_state(seed):
        return {"seed": seed, "random": random.Random(seed).getstate(), "numpy": None,
                "env": None, "reward": 0.0, "turns": 0, "steps": 0, "invalid": 0, "done": False,
                "cut_off": False, "last": ""}

    def _instance(self, seed):
        with self._seeded(self._new_state(seed)):
            return self.cls(**self.args)

    # ------------------------------------------------------------------------- the contract
    def examples(self, n, seed=0):
        rng = random.Random(seed)
        rows = [{"seed": rng.randrange(2**31)} for _ in range(n)]
        if self.tasks:
            split, count = self.tasks
            start = start_row(seed, count, 1)
            rows = [{**row, "split": split, "index": (start + i) % count}
                    for i, row in enumerate(rows)]
        return rows

    def reset(self, example):
        state = self._new_state(example["seed"])
        with self._seeded(state):
            state["env"] = self.cls(**self.args)
            task = {k: example[k] for k in ("split", "index") if k in example}
            observation = state["env"].reset(seed=example["seed"], **task)
        state["done"], state["last"] = observation.done, self.render(observation)
        return state, state["last"]

    def step(self, state, reply):
        messages = [] if state["done"] else self._act(state, str(reply))
        if not (state["done"] or state["turns"] >= self.max_turns):
            return messages[0] if len(messages) == 1 else messages
        state["cut_off"] = not state["done"]
        self._close(state)
        return None

    def _act(self, state, reply):
        """Step the reply's actions until one ends the episode: the messages that answer it."""
        state["turns"] += 1
        actions, why = self._actions(reply)
        if not actions:
            state["invalid"] += 1
            return [f"(invalid action: {why})".replace("\n", "; ")[:SHOWN]]
        messages = []
        with self._seeded(state):
            for action in actions:
                observation = state["env"].step(action)
                state["steps"], state["last"] = state["steps"] + 1, self.render(observation)
                state["reward"] += float(observation.reward or 0.0)
                messages.append(state["last"] if self.text_field else
                                {"role": "tool", "content": state["last"]})
                if observation.done:
                    state["done"] = True
                    break
        return messages

    def _close(self, state):
        with self._seeded(state), contextlib.suppress(Exception):  # a failed cleanup costs nothing
            state["env"].close()

    def _actions(self, reply):
        """(the reply's Actions, None), or ([], why not) where one of them cannot be built."""
        if self.text_field:
            try:
                return [self.action(**{self.text_field: reply})], None
            except Exception as e:  # noqa: BLE001 (pydantic's ValidationError: a constraint)
                return [], f"{type(e).__name__}: {e}"
        _, calls = parse_tool_calls(reply)
        if not calls:
            return [], f"no <tool_call> block; the tools: {', '.join(self.tools_named)}"
        actions = []
        for call in calls:
            name = call["name"]
            try:
                arguments = json.loads(call["arguments"])
                assert isinstance(arguments, dict)
            except (ValueError, AssertionError):
                return [], f"the arguments of {name[:100]!r} are not a JSON object"
            if name not in self.tools_named:
                return [], f"unknown tool {name[:100]!r} (tools: {', '.join(self.tools_named)})"
            try:
                actions.append(self.action(tool_name=name, arguments=arguments) if self.is_mcp
                               else self.action.model_validate(arguments))
            except Exception as e:  # noqa: BLE001 (pydantic's ValidationError)
                return [], f"{name}: {type(e).__name__}: {e}"
        return actions, None

    @property
    def tools_named(self):
        return [t["function"]["name"] for t in self.tools]

    def rewards(self, state):
        return {"reward": state["reward"]}

    def metrics(self, state):
        return {"n_invalid": state["invalid"], "n_steps": state["steps"],
                "cut_off": float(state["cut_off"])}

    def describe(self, state):
        end = "done" if state["done"] else "cut off at max_turns" if state["cut_off"] else "live"
        return (f"{end} after {state['steps']} steps ({state['invalid']} invalid replies), "
                f"reward {state['reward']:g}; last observation: {state['last']}")[:SHOWN]
