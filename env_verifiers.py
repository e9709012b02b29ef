"""
Verifiers environments, as they are, of both generations: one written with Verifiers' classic API
(`load_environment`, SingleTurnEnv, MultiTurnEnv with `setup_state`/`env_response`/`@vf.stop`,
ToolEnv, StatefulToolEnv, a `Rubric` of weighted reward functions) runs here; one written with its
v1 API (a module exporting a `vf.Taskset`: verifiers 0.4) runs in env_verifiers_v1.py.

    uv pip install verifiers==0.3.1    # optional (many dependencies): not in requirements.txt
    python eval.py --env verifiers --model minimax_vf:play -n 20 \\
        --env_args '{"path": "tictactoe.py"}'
    python rl.py --env verifiers --batch 64 --group 8 \\
        --env_args '{"id": "tictactoe", "args": {"max_turns": 8}}'

env_args: `id` (an installed environment's module, as `pip install` or `prime env install`
installs it; a Hub id owner/name@version names the module `name`) or `path` (a .py file or a
package folder); `args`: its load_environment keyword arguments (v1: its TasksetConfig's fields);
`python`: the interpreter of the guard's worker (a venv whose verifiers fits the environment: the
two generations cannot share one installation, and the trainer needs none); `dataset_seed`
(default 0): the global `random` and numpy seeds while it builds its dataset
(environments that draw from the unseeded global `random`, as the course's tic-tac-toe does, then
build the same rows in every process); `max_turns`: the cut-off for an environment with no turn
limit of its own (default 16); `num_groups`: consecutive examples cycle through that many rows
(rl.py passes batch/group; forwarded to load_environment where it takes one: the course's
stratified buckets); `window` (default 4096): a v1 Taskset that is endless (INFINITE) is read
lazily, as far as the examples reach, and each call's examples start among its first `window`
tasks (a finite one is read whole at load).

Verifiers' own code plays every episode: its `_run_rollout_state` (setup_state, stop conditions,
env_response, final_env_response, tools, cleanup, then the rubric's score_rollout) runs on a
private event loop, and the model's turns go through a Verifiers Client whose response is the
reply our policy wrote. So an episode stays suspended inside Verifiers between two of our `step`
calls. A reply's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the
Hermes/Qwen3 text format) become the message's tool calls, the rest its content, as a server's
tool parser would; the tools are offered through the chat template (`tools`); each tool result is
one tool message.

Rewards: each rubric function by its own name with the rubric's weight (`reward_weights`);
weight-0 functions are metrics, named n_NAME (values, not rates: eval.py prints mean_NAME), with
`error` (1 where Verifiers recorded an error, or a reward
function or tool raised: Verifiers scores those 0 and logs them). Judges (a JudgeRubric; v1's
vf.Judge): they ask the judge named in env_args, `judge_api_base` (an OpenAI-compatible server),
`judge_model` and `judge_api_key_var` (the variable holding its key, where it needs one), from the
guard's worker: a judge's calls count in their step's limit, and a judge that fails costs its
episode (`error`). Refused at load, with the reason: judges where none is named, group reward
functions, few-shot prompts, sandboxes, environment groups, prompts that are not [system, user]
text, environments on the API before verifiers 0.1.8 (`is_completed(messages, state)`), and
verifiers outside 0.1.14-0.3.x (0.4 keeps only its v1 API). Every load failure is one line
(load_env's SystemExit), never a traceback. It runs behind guard.py like every third-party
environment: a hung reward function or tool costs its episode (metric `timeout`), never the run;
the library's signal handlers, atexit hooks and process pools stay in the guard's worker.
"""
import asyncio
import contextvars
import inspect
import logging
import os
import random
import re
import signal
import sys
import time

from env_verifiers_v1 import (DEFAULT_MAX_TURNS, ENDLESS_WINDOW, NAME_A_JUDGE, VerifiersV1Env,
                              is_v1_module, parse_tool_calls, start_row)
from guard import Guarded, import_source

SUPPORTED = ("verifiers>=0.1.14,<0.4 (checked with 0.1.14, 0.2.0 and 0.3.1; "
             "`uv pip install verifiers==0.3.1`)")  # named in every error about the classic API
# the slow imports of each generation (v1's with its tool servers'), which the guard's zygote makes
# once for every worker it forks (preload_for: which; one the interpreter lacks is skipped)
CLASSIC_PRELOAD = ("verifiers.clients", "verifiers.legacy.envs")
V1_PRELOAD = ("verifiers.v1", "verifiers.v1.env", "verifiers.v1.rollout",
              "verifiers.v1.interception.server", "verifiers.v1.mcp.server",
              "mcp.server.mcpserver.server", "httpx")
CURRENT = contextvars.ContextVar("episode")  # the running rollout's episode (a task copies it)


def import_verifiers(classic=True):
    """verifiers and its classic API's Client (classic=False: verifiers installed, any version),
    or ValueError naming the version to install."""
    try:
        import verifiers as vf
    except ImportError:
        raise ValueError(f"--env verifiers needs the verifiers package: {SUPPORTED} for classic "
                         "environments, verifiers==0.4.0 for v1 ones") from None
    if not classic:
        return vf, None
    try:
        from verifiers.clients import Client  # 0.3 has the classic paths too (verifiers.legacy)
        vf.MultiTurnEnv  # noqa: B018  (0.4 has no classic classes: fails here)
    except (ImportError, AttributeError):
        version = getattr(vf, "__version__", "?")
        why = ("keeps only its new v1 API (no MultiTurnEnv, no verifiers.types): classic "
               "environments do not import"
               if tuple(map(int, re.findall(r"\d+", version)[:2])) >= (0, 4)
               else "predates the Client interface this runs on")
        raise ValueError(f"verifiers {version} {why}; this adapter runs {SUPPORTED}") from None
    return vf, Client


def plain(message):
    """A message as a plain dict (Verifiers' may be pydantic objects), its None fields dropped."""
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    return {k: v for k, v in dict(message).items() if v is not None}


def rubric_functions(rubric):
    """[(name, weight)] of every reward function of a rubric, through RubricGroups."""
    if hasattr(rubric, "rubrics"):
        return [f for r in rubric.rubrics for f in rubric_functions(r)]
    return [(getattr(f, "__name__", repr(f)), float(w))
            for f, w in zip(rubric.funcs, rubric.weights)]


def judge_rubrics(rubric, vf):
    """The JudgeRubrics of a rubric, through RubricGroups."""
    return ([rubric] if isinstance(rubric, vf.JudgeRubric) else
            [j for r in getattr(rubric, "rubrics", []) for j in judge_rubrics(r, vf)])


def named_judge(api_base, model, api_key_var, timeout):
    """The judge a user names in env_args ({"base_url", "model", "api_key_var", "timeout"}), or
    None where none is; ValueError saying what to change."""
    if (api_base, model, api_key_var) == (None, None, None):
        return None
    if not (isinstance(api_base, str) and api_base.startswith(("http://", "https://"))
            and isinstance(model, str) and model):
        raise ValueError(f"judge_api_base={api_base!r}, judge_model={model!r}: a judge is an "
                         "OpenAI-compatible server's URL and the model it serves, e.g. "
                         '{"judge_api_base": "http://localhost:8000/v1", "judge_model": "qwen3"}')
    if api_key_var is not None and not (isinstance(api_key_var, str) and api_key_var in os.environ):
        raise ValueError(f"judge_api_key_var={api_key_var!r}: no such environment variable is "
                         "set (it names the variable that holds the judge's API key)")
    return {"base_url": api_base, "model": model, "api_key_var": api_key_var, "timeout": timeout}


def judge_client(judge):
    """An OpenAI client for the named judge: one retry, each call at most the guard's timeout
    (the guard interrupts it there anyway; the error is then the client's, not a kill)."""
    from openai import AsyncOpenAI
    key = os.environ.get(judge["api_key_var"] or "", "") or "EMPTY"  # a local server needs none
    return AsyncOpenAI(base_url=judge["base_url"], api_key=key, timeout=judge["timeout"],
                       max_retries=1)


def pre_018_api(cls):
    """What of the MultiTurnEnv API before verifiers 0.1.8 a class overrides, or None:
    is_completed(messages, state), or an env_response returning (messages, state)."""
    import ast
    import textwrap
    completed = getattr(cls, "is_completed", None)
    if callable(completed) and "messages" in inspect.signature(completed).parameters:
        return "is_completed(messages, state)"
    respond = getattr(cls, "env_response", None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(respond)))
    except (TypeError, OSError, SyntaxError):  # not Python source we can read: no verdict
        return None
    function = tree.body[0]
    returns = [n.value for n in ast.walk(function) if isinstance(n, ast.Return)]
    annotation = ast.unparse(function.returns) if getattr(function, "returns", None) else ""
    if annotation.startswith(("tuple", "Tuple")) or any(
            isinstance(r, ast.Tuple) and len(r.elts) == 2 for r in returns):
        return "env_response returning (messages, state)"
    return None


class Episode:
    """One rollout suspended inside Verifiers between our calls: its task, the future through which
    it asks for the model's turn (`turn`, set to the prompt) and the one answering it (`reply`)."""

    def __init__(self, row):
        self.row, self.task, self.turn, self.reply = row, None, None, None
        self.seen, self.replies, self.errors, self.cut_off = [], 0, [], False


class ErrorLog(logging.Handler):
    """Verifiers logs a reward function or tool that raised (scoring 0): the `error` metric."""
    def emit(self, record):
        episode = CURRENT.get(None)
        if episode is not None:
            episode.errors.append(record.getMessage()[:300])


def open_environment(id=None, path=None, args=None, dataset_seed=0, max_turns=DEFAULT_MAX_TURNS,
                     num_groups=None, window=ENDLESS_WINDOW, judge=None):
    """The guard worker's factory: the environment module's generation decides its adapter, a v1
    one (it exports a vf.Taskset: env_verifiers_v1.py) or a classic one (load_environment)."""
    import_verifiers(classic=False)
    if (id is None) == (path is None):
        raise ValueError('give one of id (an installed environment module) or path '
                         '(a .py file or a package folder), e.g. {"path": "tictactoe.py"}')
    if args is not None and not isinstance(args, dict):
        raise ValueError(f"args={args!r}: must be a JSON object of the environment's settings")
    for name, value in (("max_turns", max_turns), ("num_groups", num_groups or 1),
                        ("dataset_seed", dataset_seed), ("window", window)):
        if (not isinstance(value, int) or isinstance(value, bool)
                or value < (name != "dataset_seed")):
            raise ValueError(f"{name}={value!r}: must be an integer >= "
                             f"{int(name != 'dataset_seed')}")
    module = environment_module(id, path)
    settings = {"args": args, "dataset_seed": dataset_seed, "max_turns": max_turns,
                "num_groups": num_groups, "judge": judge}
    if is_v1_module(module):
        sys.modules[module.__name__] = module  # Verifiers imports its taskset by name
        return VerifiersV1Env(module, **settings, window=window)
    return VerifiersEnv(module, **settings)


def environment_module(id, path):
    """The environment's module: an installed one by id (a Hub id owner/name@version names the
    module `name`) or a .py file or package folder by path; ValueError saying what to install."""
    if path is not None:
        if not (isinstance(path, str) and os.path.exists(path)):
            raise ValueError(f"path={path!r}: no such file or folder")
        if os.path.isdir(path):
            sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
            id = os.path.basename(os.path.abspath(path))
        else:
            return _import_classic_aware(path)
    if not isinstance(id, str):
        raise ValueError(f"id={id!r}: must be a module name")
    name = id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_")
    try:
        return _import_classic_aware(name)
    except ModuleNotFoundError as e:
        raise ValueError(f"no installed environment {id!r} ({e}): install it (pip install / "
                         "prime env install) or give its file as path") from None


def _import_classic_aware(where):
    """import_source, saying so where a classic environment meets verifiers 0.4 (no classic API)."""
    try:
        return import_source(where)
    except (AttributeError, ImportError) as e:
        if isinstance(e, ModuleNotFoundError) and "verifiers" not in str(e):
            raise
        import_verifiers()  # raises, naming the version, where the classic API is missing
        raise


class VerifiersEnv:
    def __init__(self, module, args=None, dataset_seed=0, max_turns=DEFAULT_MAX_TURNS,
                 num_groups=None, judge=None):
        vf, Client = import_verifiers()
        self.vf, self.judge = vf, judge
        load = getattr(module, "load_environment", None)
        if not callable(load):
            raise ValueError(f"{module.__name__} has no load_environment() function and exports "
                             "no vf.Taskset: not a Verifiers environment")
        args = dict(args or {})
        if num_groups and "num_groups" in inspect.signature(load).parameters:
            args.setdefault("num_groups", num_groups)
        self.env = self._build(load, args, dataset_seed)
        self._refuse_what_cannot_run()
        for rubric in judge_rubrics(self.env.rubric, vf) if judge else ():  # the judge named
            rubric.judge_client, rubric.judge_model = judge_client(judge), judge["model"]
            rubric.class_objects.update(judge_client=rubric.judge_client, judge_model=judge["model"])
        dataset = (self.env.get_dataset() if self.env.dataset is not None
                   else self.env.get_eval_dataset())
        self.rows = dataset.to_list()
        self.system_prompt = self._check_prompts()
        self.max_turns = self.env.max_turns if getattr(self.env, "max_turns", -1) > 0 else max_turns
        self.num_groups = num_groups or 1
        functions = rubric_functions(self.env.rubric)
        self.reward_weights = {}
        for name, weight in functions:
            if self.reward_weights.setdefault(name, weight) != weight:
                raise ValueError(f"two reward functions named {name!r} with different weights: "
                                 "rename one")
        self.metric_names = [n for n, w in self.reward_weights.items() if w == 0]
        self.reward_weights = {n: w for n, w in self.reward_weights.items() if w != 0}
        self.tools = [{"type": "function",
                       "function": {"name": t.name, "description": t.description,
                                    "parameters": t.parameters}}
                      for t in self.env.tool_defs or []] or None
        self.loop = asyncio.new_event_loop()
        self.client = _client_class(Client, vf)(None)
        logger = logging.getLogger("verifiers")
        if not any(isinstance(h, ErrorLog) for h in logger.handlers):
            logger.addHandler(ErrorLog(logging.ERROR))

    @staticmethod
    def _build(load, args, dataset_seed):
        """load_environment(**args) with the global random and numpy seeded (its dataset the same
        in every process), our signal handlers put back (Verifiers installs its own for SIGINT and
        SIGTERM)."""
        import numpy as np
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        outer, outer_np = random.getstate(), np.random.get_state()
        random.seed(dataset_seed)
        np.random.seed(dataset_seed)
        # a JudgeRubric builds its OpenAI client as it is made, which fails without a key: its
        # calls go to the judge named in env_args, or it is refused, so a placeholder does
        no_key = "OPENAI_API_KEY" not in os.environ
        if no_key:
            os.environ["OPENAI_API_KEY"] = "unused: the judge named in env_args is asked"
        try:
            return load(**args)
        finally:
            random.setstate(outer)
            np.random.set_state(outer_np)
            for s, h in handlers.items():
                signal.signal(s, h)
            if no_key:
                del os.environ["OPENAI_API_KEY"]

    def _refuse_what_cannot_run(self):
        vf, env = self.vf, self.env
        names = {c.__name__ for c in type(env).__mro__}
        old = pre_018_api(type(env))
        why = ("it is not a Verifiers Environment" if not isinstance(env, vf.Environment) else
               f"it is written for the API of verifiers 0.1.7 and older ({old}), which 0.1.8 "
               "replaced: port it (a @vf.stop method for is_completed, env_response returning "
               "only its messages); a venv with 0.1.7 does not help: it predates the Client "
               "interface this adapter runs on" if old else
               "an environment group: load each environment on its own" if "EnvGroup" in names else
               "it runs code in a remote sandbox"
               if names & {"SandboxEnv", "PythonEnv", "CliAgentEnv"} else
               "its rubric has group reward functions (rewards of a whole group at once)"
               if env.rubric.has_group_rewards else
               f"its rubric asks a judge model: {NAME_A_JUDGE}"
               if judge_rubrics(env.rubric, vf) and self.judge is None else
               "it has few-shot prompts" if env.few_shot else None)
        if why:
            raise ValueError(f"this Verifiers environment cannot run here: {why}")

    def _check_prompts(self):
        """The rows' one system prompt; ValueError for a prompt that is not [system, user] text."""
        systems = set()
        for i, row in enumerate(self.rows):
            prompt = [plain(m) for m in row.get("prompt") or []]
            roles = [m.get("role") for m in prompt]
            text = all(isinstance(m.get("content"), str) for m in prompt)
            if roles not in (["system", "user"], ["user"]) or not text:
                raise ValueError(f"row {i}'s prompt is {roles} (or not text): only [system, user] "
                                 "text prompts run here")
            systems.add(prompt[0]["content"] if roles[0] == "system" else "")
            info = row.get("info")
            if isinstance(info, dict) and "tool_defs" in info:
                raise ValueError(f"row {i} brings its own tools (info['tool_defs']): "
                                 "not supported here")
        if len(systems) > 1:
            raise ValueError(f"the rows have {len(systems)} different system prompts: "
                             "only one is supported")
        return systems.pop() if systems else ""

    # ------------------------------------------------------------------------- the contract

    def examples(self, n, seed=0):
        start = start_row(seed, len(self.rows), self.num_groups)
        return [{"seed": seed, "row": (start + i) % len(self.rows)} for i in range(n)]

    def reset(self, example):
        episode = Episode(self.rows[example["row"]])
        token = CURRENT.set(episode)
        try:
            episode.task = self.loop.create_task(
                self.env._run_rollout_state(episode.row, self.client, "policy", {}))
        finally:
            CURRENT.reset(token)
        messages = self._advance(episode)
        if messages is None:
            raise RuntimeError(f"the rollout ended before the first model turn: "
                               f"{episode.task.exception()!r} (with verifiers "
                               f"{getattr(self.vf, '__version__', '?')}: one written for another "
                               "version runs in a venv with it, env_args \"python\")")
        return episode, messages[-1]["content"]

    def step(self, episode, reply):
        if episode.task.done():
            return None
        episode.replies += 1
        if episode.replies >= self.max_turns and not self.env.max_turns > 0:
            episode.cut_off = True  # Verifiers goes on: end it as an overlong prompt does, scored
        episode.reply.set_result(reply if isinstance(reply, str) else str(reply))
        messages = self._advance(episode)
        if messages is None:
            return None
        if len(messages) == 1:
            return messages[0]["content"] if messages[0]["role"] == "user" else messages[0]
        return messages

    def _advance(self, episode):
        """Run the loop until the episode asks for the next reply (new messages) or ends (None)."""
        episode.turn = self.loop.create_future()
        self.loop.run_until_complete(asyncio.wait([episode.turn, episode.task],
                                                  return_when=asyncio.FIRST_COMPLETED))
        if episode.task.done():
            episode.task.exception()  # retrieved: an exception here is the episode's error
            return None
        prompt = episode.turn.result()
        if prompt[:len(episode.seen)] != episode.seen:
            episode.errors.append("the environment rewrote earlier messages")
        new = [{"role": m["role"], "content": m.get("content") or ""}
               for m in prompt[len(episode.seen):]]
        return new

    def _final_state(self, episode):
        task = episode.task
        return (task.result() if task.done() and not task.cancelled() and task.exception() is None
                else None)

    def rewards(self, episode):
        state = self._final_state(episode)
        metrics = (state or {}).get("metrics") or {}
        return {n: float(metrics.get(n, 0.0)) for n in self.reward_weights}

    def metrics(self, episode):
        state = self._final_state(episode)
        metrics = (state or {}).get("metrics") or {}
        error = state is None or state.get("error") is not None or bool(episode.errors)
        return {**{f"n_{n}": float(metrics.get(n, 0.0)) for n in self.metric_names},
                "cut_off": float(episode.cut_off), "error": float(error)}

    def describe(self, episode):
        state = self._final_state(episode)
        if state is None:
            return f"the rollout raised {episode.task.exception()!r}"[:500]
        return (f"stop: {state.get('stop_condition')}, reward {state.get('reward')}"
                + (f", error: {state.get('error')!r}" if state.get("error") is not None else "")
                + (f", logged: {episode.errors[0]}" if episode.errors else ""))


def _client_class(Client, vf):
    """A Verifiers Client whose model is our policy: a request awaits the reply given to step()."""
    from verifiers.types import Response, ResponseMessage, ToolCall

    class PolicyClient(Client):
        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return {"type": "function", "function": {"name": tool.name,
                                                     "description": tool.description,
                                                     "parameters": tool.parameters}}

        async def to_native_prompt(self, messages):
            return [plain(m) for m in messages], {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            episode = CURRENT.get()
            if episode.cut_off:
                raise vf.OverlongPromptError("cut off at max_turns")
            episode.reply = asyncio.get_running_loop().create_future()
            episode.turn.set_result(prompt)
            text = await episode.reply
            content, calls = parse_tool_calls(text) if tools else (text, [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            episode.seen = prompt + [message]
            return content, calls

        async def raise_from_native_response(self, response):
            return None  # an empty reply is the model's answer, scored as such, not an error

        async def from_native_response(self, response):
            content, calls = response
            message = ResponseMessage(
                content=content, tool_calls=[ToolCall(**c) for c in calls] or None,
                finish_reason="tool_calls" if calls else "stop", is_truncated=False)
            return Response(id="policy", created=int(time.time()), model="policy", message=message)

        async def close(self):
            return None
    return PolicyClient


def load_environment(id=None, path=None, args=None, dataset_seed=0, max_turns=DEFAULT_MAX_TURNS,
                     num_groups=None, timeout=60.0, python=None, window=ENDLESS_WINDOW,
                     judge_api_base=None, judge_model=None, judge_api_key_var=None):
    """A Verifiers environment behind the guard (guard.py): `timeout` seconds a call (a step, with
    its reward functions, tools and judge) may take before its episode scores 0 (metric
    `timeout`); `python`: the interpreter its worker runs (a venv with the verifiers the
    environment needs); judge_*: the judge its judge rubrics or v1 judges ask instead of theirs."""
    if python is not None and not (isinstance(python, str) and os.access(python, os.X_OK)):
        raise ValueError(f"python={python!r}: not an executable (the interpreter of a venv with "
                         "verifiers, e.g. .venv-vf/bin/python)")
    kwargs = {"id": id, "path": os.path.abspath(path) if isinstance(path, str) else path,
              "args": args, "dataset_seed": dataset_seed, "max_turns": max_turns,
              "num_groups": num_groups, "window": window,
              "judge": named_judge(judge_api_base, judge_model, judge_api_key_var, timeout)}
    # a v1 step runs Verifiers' chat loop, interception and scoring: up to 0.1 s of CPU here, so
    # past its turn's spent limit a step keeps 0.25 s of CPU (guard.FLOOR_CPU fits lighter ones)
    return Guarded("env_verifiers:open_environment", kwargs, timeout=timeout, python=python,
                   floor_cpu=0.25, preload=preload_for(id, path))


def preload_for(id, path):
    """What the guard's zygote imports for this environment: the generation its source names
    (a guess from the text, which costs only time where wrong; both where it cannot be read)."""
    import importlib.util
    try:
        if path is not None:
            source = os.path.join(path, "__init__.py") if os.path.isdir(path) else path
        else:
            name = id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_")
            source = importlib.util.find_spec(name).origin
        with open(source) as f:
            text = f.read()
    except Exception:  # noqa: BLE001 (not found, not text: the worker's own load says what)
        return CLASSIC_PRELOAD + V1_PRELOAD
    v1 = re.search(r"verifiers\.v1|from verifiers import v1", text)
    return V1_PRELOAD if v1 else CLASSIC_PRELOAD
