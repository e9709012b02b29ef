"""
Verifiers v1 environments (verifiers 0.4's API), as they are: a `vf.Taskset` of `vf.Task`s whose
`@vf.reward(weight=...)` and `@vf.metric` methods score a trace, `@vf.stop` predicates, and
optionally a `vf.Env` subclass whose `run(task, agents)` plays the user turn by turn. Loaded by
`--env verifiers` (env_verifiers.py) when the module exports a Taskset; the classic API stays there.

    uv pip install verifiers==0.4.0    # or keep it in its own venv: env_args "python" (below)
    python eval.py --env verifiers --env_args '{"path": "docs/vf_v1_reverse.py"}' -n 20
    python rl.py --env verifiers --env_args '{"id": "my_taskset", "args": {"num_tasks": 500}}'

Verifiers' own code plays and scores every episode: `Env.run_episode` (setup, the Env's `run`,
the interception server that records each model call into the trace, `@vf.stop`, the seat's
`max_turns`, the Task's rewards and metrics, `finalize`) runs on a private event loop in the guard's
worker. The seat's program is the `null` harness's own chat loop (its bundled chat program, run
in-process instead of as a `uv` script: no subprocess, no network); its model calls reach the
interception server over loopback, which hands them to a `vf.Client` whose answer is the reply
our policy wrote. So an episode stays suspended inside Verifiers between two of our `step` calls.

Tools: a Task's or Taskset's `vf.Toolset` runs in the worker too (ToolServers: Verifiers would
serve each as an MCP server in a process of its own); the policy is offered its tools through the
chat template, and a reply's <tool_call> blocks become the assistant message's tool calls.

Nothing is sent anywhere: the seat runs in the local `subprocess` runtime, the model is our policy
and no result is pushed. Refused at load, with the reason: a seat pinned to another harness (`bash`
and the coding agents run programs), to a sandbox runtime or to a model of its own, several seats,
judges where none is named in env_args (env_verifiers.py: judge_api_base, judge_model; Prime's
DecisionJudge always), tasks in container images, remote or sandboxed tool servers, and prompts
that are not text with one system prompt for all tasks. An endless Taskset (INFINITE) is read as
far as the run's examples reach, never whole (`window`).
"""
import asyncio
import contextlib
import contextvars
import itertools
import json
import os
import random
import re
import secrets
import ssl
import sys
import time
import types

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)  # Hermes/Qwen3 text tool calls
HARNESS = "rlenvs_inprocess_null"  # the module name our in-process chat harness registers as
DEFAULT_MAX_TURNS = 16  # the cut-off for an environment with no turn limit of its own (both APIs)
# an endless Taskset's examples start among its first ENDLESS_WINDOW tasks (env_args "window"):
# a run draws from that many, so its rows are the same whatever the step, the process or a resume
ENDLESS_WINDOW = 4096
NAME_A_JUDGE = ("name one in env_args: judge_api_base (an OpenAI-compatible server), judge_model "
                "and, where it needs a key, judge_api_key_var (the variable that holds it)")


def start_row(seed, n_rows, num_groups):
    """The first of a step's consecutive rows (cyclic; both APIs), drawn from seed and aligned to
    num_groups: each step's examples cover the difficulty buckets as the dataset lays them out."""
    start = random.Random(f"verifiers/{seed}").randrange(n_rows)
    return start - start % num_groups


def parse_tool_calls(text):
    """(content, tool calls) of a reply: its well-formed <tool_call> blocks as
    [{"id", "name", "arguments"}] (the arguments a JSON string), the rest of the text as the
    content; a malformed block stays in the content."""
    calls, kept, last = [], [], 0
    for m in TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
            name, arguments = call["name"], call.get("arguments", {})
            assert isinstance(name, str) and isinstance(arguments, (dict, str))
        except (ValueError, KeyError, TypeError, AssertionError, RecursionError):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append({"id": f"call_{len(calls)}", "name": name, "arguments": arguments})
    content = ("".join(kept) + text[last:]).strip() if calls else text
    return content, calls


def import_v1():
    """verifiers.v1, or ValueError naming what to install."""
    try:
        import verifiers.v1 as vf
        vf.Taskset  # noqa: B018  (0.3's early verifiers.v1 has no Taskset)
    except (ImportError, AttributeError):
        raise ValueError("a v1 environment (a vf.Taskset) needs verifiers 0.4: "
                         "`uv pip install verifiers==0.4.0`, or env_args \"python\": an "
                         "interpreter that has it") from None
    return vf


def is_v1_module(module):
    """Whether a module exports a verifiers.v1 Taskset in __all__ (and so is a v1 environment)."""
    v1 = sys.modules.get("verifiers.v1")
    return v1 is not None and any(
        isinstance(obj := getattr(module, name, None), type) and issubclass(obj, v1.Taskset)
        for name in getattr(module, "__all__", ()))


class Episode:
    """One rollout suspended inside Verifiers: its task, the future through which it asks for the
    model's turn (`turn`: the request's messages) and the one answering it (`reply`)."""

    def __init__(self, task):
        self.task, self.run, self.turn, self.reply = task, None, None, None
        self.traces = []  # its trace ids (the client's keys), dropped when it ends
        self.seen = []  # the messages Verifiers has, with our last reply: what a new turn adds to


class VerifiersV1Env:
    def __init__(self, module, args=None, dataset_seed=0, max_turns=DEFAULT_MAX_TURNS,
                 num_groups=None, window=ENDLESS_WINDOW, judge=None):
        vf = self.vf = import_v1()
        _register_harness(vf)
        self.judge = judge
        if judge:
            _rebase_judges(vf, judge)
        self.env = self._build(vf, module, args or {}, max_turns)
        taskset, self.window = self.env.taskset, window
        # an endless Taskset (INFINITE: load() a generator that never ends) is read as far as
        # the run's examples reach; a finite one is read whole, and checked, here
        self.endless = not getattr(taskset, "bounded", not getattr(taskset, "INFINITE", False))
        self.tasks, self.system_prompt = [], None
        outer = random.getstate()
        random.seed(dataset_seed)  # a load() drawing from the global random: the same tasks
        self.random = random.getstate()
        random.setstate(outer)
        self.reading = self._seeded(iter, taskset)  # calls load(): a list is built, a generator not
        while self._read() and not self.endless:  # endless: its first task only, for now
            pass
        if not self.tasks:
            raise ValueError(f"{module.__name__}: its Taskset loaded no tasks")
        seat = next(iter(self._seats(self.env.config).values()))
        self.max_turns, self.num_groups = seat.max_turns, num_groups or 1
        task = self.tasks[0]
        self.reward_weights = {f.__name__: float(getattr(f, "_vf_weight", 1.0))
                               for f in task.hooks("reward")}
        self.metric_names = [f.__name__ for f in task.hooks("metric")]
        self.episodes = {}  # trace id -> Episode, for the client (live episodes only)
        self.loop = asyncio.new_event_loop()
        self.tools = self._tool_schemas()
        import verifiers.v1.interception.server as interception
        interception.resolve_client = lambda config: _policy_client(vf, self)
        self.ctx = vf.ModelContext(model="policy", client=vf.TrainClientConfig(
            base_url="http://127.0.0.1:9/unused", api_key_var="RLENVS_NO_KEY"))
        self.serving = self.env.serving()
        self.loop.run_until_complete(self.serving.__aenter__())

    @staticmethod
    def _seats(config):
        try:
            from verifiers.v1.configs.agent import agent_config_fields
        except ImportError:  # 0.3's verifiers.v1
            from verifiers.v1.agent import agent_config_fields
        return agent_config_fields(config)

    def _build(self, vf, module, args, max_turns):
        """The Env of the module's Taskset, its one seat played by our in-process chat program in
        the local runtime; ValueError for what cannot run here, with the reason."""
        name = module.__name__
        try:
            config = vf.resolve_env_config({"taskset": {**args, "id": name}})
        except Exception as e:  # pydantic's ValidationError: an unknown or wrong setting
            raise ValueError(f"{name}: its settings (env_args \"args\") do not validate: "
                             f"{e}") from None
        seats = self._seats(config)
        if len(seats) != 1:
            raise ValueError(f"{name}: its Env has {len(seats)} seats ({', '.join(seats)}): "
                             "only one agent, the policy, plays here")
        (seat_name, seat), = seats.items()
        pinned = seat.model_fields_set
        harness = seat.harness.id if seat.harness is not None else None
        why = (f"its seat pins the {harness!r} harness, a program with tools of its own (only "
               "the null chat loop runs here)" if "harness" in pinned and harness != "null" else
               "its seat pins a runtime (a sandbox or container)" if "runtime" in pinned else
               "its seat pins a model or client of its own (a hosted model)"
               if pinned & {"model", "client"} else None)
        if why:
            raise ValueError(f"{name} cannot run here: {why}")
        update = {"harness": vf.harness_config_type(HARNESS)(id=HARNESS),
                  "runtime": vf.SubprocessConfig(),
                  "max_turns": seat.max_turns or max_turns}
        config = config.model_copy(update={seat_name: seat.model_copy(update=update)})
        env = vf.load_environment(config)
        for toolset in self._toolsets(env):
            why = ("it has tool servers: they run here on verifiers 0.4"
                   if sys.modules[HARNESS].tools is None else
                   f"its tool server {toolset.server_name!r} is a remote one ({toolset.config.url})"
                   if getattr(toolset.config, "url", None) else
                   f"its tool server {toolset.server_name!r} runs in a sandbox or container"
                   if not isinstance(toolset.config.runtime, vf.SubprocessConfig) else None)
            if why:
                raise ValueError(f"{name} cannot run here: {why}")
        return env

    @staticmethod
    def _toolsets(env):
        """Instances of the env's tool servers: the Taskset's (shared), a Task's (per episode)."""
        taskset, config = type(env.taskset), env.taskset.config
        return [*taskset.toolsets(config), *taskset.task_type().toolsets(config.task)]

    def _tool_schemas(self):
        """The tools' OpenAI schemas as the chat program offers them (named SERVER_TOOL), for the
        policy's chat template; None without tools."""
        schemas = [_tool_schema(toolset.server_name, tool)[1]
                   for toolset in self._toolsets(self.env)
                   for tool in self.loop.run_until_complete(_mcp_server(toolset).list_tools())]
        return schemas or None

    def _seeded(self, read, *args):
        """read(*args) under the Taskset's own random state: the same tasks in every process,
        whatever else drew from the global random between two reads."""
        outer = random.getstate()
        random.setstate(self.random)
        try:
            return read(*args)
        finally:
            self.random = random.getstate()
            random.setstate(outer)

    def _read(self):
        """Read and check the Taskset's next task (False where it has no more); ValueError for
        what the policy cannot be given."""
        task = self._seeded(next, self.reading, None)
        if task is None:
            return False
        data, i = task.data, len(self.tasks)
        judges = [type(j).__name__ for j in task.plugged_judges()]
        why = ("its prompt is not text" if not isinstance(data.prompt, str) else
               "it runs in a container image" if data.image else
               "its DecisionJudge posts to Prime's evaluations API, which a chat server does not "
               "serve" if "DecisionJudge" in judges else
               f"it asks a judge: {NAME_A_JUDGE}" if judges and not self.judge else
               "its system prompt is not the first task's: only one is supported"
               if self.tasks and (data.system_prompt or "") != self.system_prompt else None)
        if why:
            raise ValueError(f"task {i} cannot run here: {why}")
        self.system_prompt = data.system_prompt or ""
        self.tasks.append(task)
        return True

    # ------------------------------------------------------------------------- the contract

    def examples(self, n, seed=0):
        if self.endless:  # n consecutive tasks from the first `window`: read when first played
            start = start_row(seed, self.window, self.num_groups)
            return [{"seed": seed, "row": start + i} for i in range(n)]
        start = start_row(seed, len(self.tasks), self.num_groups)
        return [{"seed": seed, "row": (start + i) % len(self.tasks)} for i in range(n)]

    def reset(self, example):
        while len(self.tasks) <= example["row"]:
            if not self._read():
                raise ValueError(f"its endless Taskset ended after {len(self.tasks)} tasks")
        episode = Episode(self.tasks[example["row"]])

        def minted(trace):
            self.episodes[trace.id] = episode
            episode.traces.append(trace.id)
        episode.run = self.loop.create_task(
            self.env.run_episode(episode.task, self.ctx, on_trace=minted))
        messages = self._advance(episode)
        if messages is None:
            raise RuntimeError(f"the episode ended before the first model turn: "
                               f"{self.describe(episode)}")
        return episode, messages[-1]["content"]

    def step(self, episode, reply):
        if episode.run.done():
            return None
        reply = reply if isinstance(reply, str) else str(reply)
        # a text that cannot be UTF-8 (a lone surrogate) cannot cross HTTP: as a decoder writes it
        episode.reply.set_result(reply.encode("utf-8", "replace").decode("utf-8"))
        messages = self._advance(episode)
        if messages is None:
            return None
        if len(messages) == 1 and messages[0]["role"] == "user":
            return messages[0]["content"]
        return messages

    def _advance(self, episode):
        """Run the loop until the episode asks for the next reply (its new messages) or ends."""
        episode.turn = self.loop.create_future()
        self.loop.run_until_complete(asyncio.wait([episode.turn, episode.run],
                                                  return_when=asyncio.FIRST_COMPLETED))
        if not episode.turn.done():
            episode.run.exception()  # retrieved: an exception here is the episode's error
            for trace_id in episode.traces:  # ended: the client needs it no more
                self.episodes.pop(trace_id, None)
            return None
        prompt = episode.turn.result()
        new = [_plain(m) for m in prompt[len(episode.seen):]]
        if [_key(m) for m in prompt[:len(episode.seen)]] != [_key(m) for m in episode.seen]:
            new.append({"role": "user", "content": "(the environment rewrote earlier messages)"})
        return [m for m in new if m["role"] != "system"] or [{"role": "user", "content": ""}]

    def _trace(self, episode):
        run = episode.run
        if not run.done() or run.cancelled() or run.exception() is not None:
            return None, None
        result = run.result()
        return result, (result.traces[0] if result.traces else None)

    def rewards(self, episode):
        _, trace = self._trace(episode)
        rewards = {k: (r.score if r is not None else 0.0)
                   for k, r in (trace.rewards if trace else {}).items()}
        for k, r in (trace.rewards if trace else {}).items():  # keyed or recorded in run()
            if r is not None:
                self.reward_weights.setdefault(k, r.weight)
        return {**{k: 0.0 for k in self.reward_weights}, **rewards}

    def metrics(self, episode):
        result, trace = self._trace(episode)
        values = {k: v for k, v in (trace.metrics if trace else {}).items() if v is not None}
        error = result is None or not result.ok or trace is None or bool(trace.errors)
        return {**{f"n_{k}": float(values.get(k, 0.0)) for k in self.metric_names},
                **{f"n_{k}": float(v) for k, v in values.items()},
                "cut_off": float(trace is not None and trace.stop_condition == "max_turns"),
                "error": float(error)}

    def describe(self, episode):
        result, trace = self._trace(episode)
        if result is None:
            return f"the episode raised {episode.run.exception()!r}"[:500]
        errors = [*result.errors, *(trace.errors if trace else [])]
        return (f"stop: {trace.stop_condition if trace else None}, reward "
                f"{trace.reward if trace else None}"
                + (f", error: {errors[0].type}: {errors[0].message}"[:500] if errors else ""))


def _rebase_judges(vf, judge):
    """Every vf.Judge the environment builds (plugged in its TaskConfig, or made in its own
    reward code) asks the judge named in env_args: its endpoint, key variable and model."""
    if not hasattr(vf, "Judge") or getattr(vf.Judge.__init__, "rebased", False):
        return
    init = vf.Judge.__init__

    def rebased(self, config=None):
        init(self, config)
        update = {"base_url": judge["base_url"], "model": judge["model"],
                  "api_key_var": judge["api_key_var"] or "RLENVS_NO_KEY"}  # unset: key "EMPTY"
        if hasattr(self.config, "timeout"):  # 0.4's (0.3's waits until the guard interrupts it)
            update["timeout"] = self.config.timeout.model_copy(update={"read": judge["timeout"]})
        self.config = self.config.model_copy(update=update)
    rebased.rebased = True
    vf.Judge.__init__ = rebased


def _plain(message):
    """A wire message as our policy reads it: role and text content (tool results keep theirs)."""
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": message.get("role"), "content": content}


def _key(message):
    return (message.get("role"), _plain(message)["content"])


def _policy_client(vf, adapter):
    """A vf.Client whose model is our policy: a request awaits the reply given to step(); where the
    request offers tools, the reply's <tool_call> blocks become its tool calls."""
    from verifiers.v1.types import AssistantMessage, Response, ToolCall

    class PolicyClient(vf.Client):
        async def get_response(self, dialect, body, sampling, session_id=None, turn=None,
                               headers=None):
            episode = adapter.episodes[session_id]
            episode.reply = asyncio.get_running_loop().create_future()
            episode.turn.set_result(body.get("messages") or [])
            text = await episode.reply
            content, calls = parse_tool_calls(text) if body.get("tools") else (text, [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"]}} for c in calls]
            episode.seen = list(body.get("messages") or []) + [message]
            created, finish = int(time.time()), "tool_calls" if calls else "stop"
            raw = {"id": "policy", "object": "chat.completion", "created": created,
                   "model": "policy",
                   "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
            return Response(id="policy", created=created, model="policy", finish_reason=finish,
                            message=AssistantMessage(content=content, tool_calls=[
                                ToolCall(**c) for c in calls] or None), raw=raw)
    return PolicyClient()


def _mcp_server(toolset):
    """The MCPServer a toolset's own process serves: its tools, as its `register` adds them."""
    from mcp.server.mcpserver import MCPServer
    from verifiers import __version__
    mcp = MCPServer(toolset.server_name or type(toolset).__name__, version=__version__)
    toolset.register(mcp)
    return mcp


def _tool_schema(server_name, tool):
    """(a server's tool's name as the chat program qualifies it, its OpenAI function schema)."""
    name = f"{server_name}_{tool.name}" if server_name else tool.name
    return name, {"type": "function", "function": {
        "name": name, "description": tool.description or "", "parameters": tool.input_schema}}


class ToolServers:
    """Verifiers' tool servers (vf.Toolset) served in this process. Verifiers runs each as an MCP
    server in a process of its own (`python -m module`: one per episode for a Task's, one per run
    for a Taskset's) that the chat program reaches over HTTP. Here `serve_tools`/`serve_shared`
    stand in for Verifiers' own (same arguments): each server is set up as its process would set
    it up, and its MCPServer (the one that process would serve: the Toolset's `register`) is kept
    under a URL that the chat program's `connect`/`call` (its connect_mcp/call_mcp) look up. A
    call runs the Toolset's own wrapper, which pulls and pushes the episode's State over the
    interception server's /state channel as from its process; the channel is set per call."""

    def __init__(self, tls):
        """Stands in for Verifiers' serving; ImportError or AttributeError where this verifiers
        (0.3's early v1) or its mcp serves tools otherwise."""
        import mcp.server.mcpserver.server as mcp_server
        import verifiers.v1.env
        import verifiers.v1.rollout
        from verifiers.v1.mcp import server
        verifiers.v1.rollout.serve_tools, verifiers.v1.env.serve_shared  # noqa: B018 (both there)
        self.tls, self.served, self.ids = tls, {}, itertools.count()
        self.channel = contextvars.ContextVar("vf_tool_channel", default=None)
        own = server.ServerBase._state_channel  # a process's: from its environment variables
        server.ServerBase._state_channel = lambda toolset: self.channel.get() or own(toolset)
        verifiers.v1.rollout.serve_tools = self.serve_tools
        verifiers.v1.env.serve_shared = self.serve_shared
        # an MCPServer sets up logging for its process (the root logger at INFO): in this worker
        # it would print every loopback request
        mcp_server.configure_logging = lambda *args, **kwargs: None

    def _register(self, stack, mcp, channel):
        url = f"http://in-process.invalid/{next(self.ids)}/mcp"
        self.served[url] = (mcp, channel)
        stack.callback(self.served.pop, url, None)
        return url

    @contextlib.asynccontextmanager
    async def _running(self, toolset, state_url=None, secret=""):
        """The toolset set up as ServerBase._serve sets it up in its process; yields its
        MCPServer."""
        import httpx
        from verifiers.v1.mcp.server import STATE_TIMEOUT, _channel_request, _import_ref
        async with toolset._exit_stack, httpx.AsyncClient(timeout=STATE_TIMEOUT,
                                                          verify=self.tls) as client:
            toolset._state_client = client
            try:
                await toolset.setup()
                if state_url:  # a Task's server: the episode's task, from the /task channel
                    task_url = state_url[:-len("/state")] + "/task"
                    data = (await _channel_request("GET", task_url, secret, client=client)).json()
                    await toolset.setup_task(
                        _import_ref(data["cls"]).model_validate_json(data["task"]))
                yield _mcp_server(toolset)
            finally:
                toolset._state_client = None

    @contextlib.asynccontextmanager
    async def serve_shared(self, toolsets, harness_is_local=True):
        """verifiers.v1.mcp.serve_shared in this process: the Taskset's servers, once a run."""
        from verifiers.v1.errors import ToolsetError
        from verifiers.v1.mcp import SharedToolServer
        from verifiers.v1.state import State
        servers = {}
        async with contextlib.AsyncExitStack() as stack:
            for toolset in toolsets:
                name = toolset.server_name
                if name in servers:
                    raise ToolsetError(f"duplicate shared tool server name {name!r}")
                mcp = await stack.enter_async_context(self._running(toolset))
                secret = secrets.token_urlsafe(24) if toolset._state_cls is not State else ""
                servers[name] = SharedToolServer(url=self._register(stack, mcp, None),
                                                 local=True, state_secret=secret)
            yield servers

    @contextlib.asynccontextmanager
    async def serve_tools(self, toolsets, harness_runtime, shared=None, *, state_secret="",
                          state_route="", state_base=None):
        """verifiers.v1.mcp.serve_tools in this process: an episode's servers ({name: url}), the
        shared ones with the episode's state route, a Task's set up for its task."""
        from verifiers.v1.errors import ToolsetError
        state_url = f"{state_base.rstrip('/')}/state" if state_base else None
        urls = {}
        async with contextlib.AsyncExitStack() as stack:
            for name, server in (shared or {}).items():
                channel = (state_url, server.state_secret, state_route) \
                    if state_url and server.state_secret else None
                urls[name] = self._register(stack, self.served[server.url][0], channel)
            for toolset in toolsets:
                name = toolset.server_name
                if name in urls:
                    raise ToolsetError(f"tool server name {name!r} is declared both "
                                       "taskset-scoped (shared) and task-scoped")
                mcp = await stack.enter_async_context(
                    self._running(toolset, state_url, state_secret))
                urls[name] = self._register(stack, mcp, (state_url, state_secret, None)
                                            if state_url else None)
            yield urls

    async def _in_channel(self, served, operation):
        mcp, channel = served
        token = self.channel.set(channel)
        try:
            return await operation(mcp)
        finally:
            self.channel.reset(token)

    async def connect(self, config, stack, reserved=None):
        """The chat program's connect_mcp: (tool schemas, name -> (server, tool), servers)."""
        schemas, dispatch, servers = [], {}, {}
        for name, spec in config.get("mcpServers", {}).items():
            servers[name] = self.served[spec["url"]]
            for tool in await self._in_channel(servers[name], lambda mcp: mcp.list_tools()):
                full, schema = _tool_schema(name, tool)
                if full in (reserved or set()) or full in dispatch:
                    raise ValueError(f"duplicate tool name {full!r}; keep MCP tool names qualified")
                schemas.append(schema)
                dispatch[full] = (name, tool.name)
        return schemas, dispatch, servers

    async def call(self, servers, dispatch, name, arguments, to_chat):
        """The chat program's call_mcp: a tool that raises answers with its error, as MCPServer's
        request handler answers it (is_error); the protocol's own errors propagate. The time a
        call may take is the guard's limit on its turn."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CallToolResult, TextContent
        server, raw = dispatch[name]
        try:
            result = await self._in_channel(servers[server],
                                            lambda mcp: mcp.call_tool(raw, arguments))
        except MCPError:
            raise
        except Exception as e:
            result = CallToolResult(content=[TextContent(type="text", text=str(e))], is_error=True)
        return to_chat(result.content)


def _register_harness(vf):
    """The null harness with its bundled chat program run in-process: Verifiers loads harnesses
    by module name, so ours is registered as one (HARNESS)."""
    if HARNESS in sys.modules:
        return
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.harnesses.null import NullHarness, harness
    # the program's source as the harness gives it to uv (0.4: bundled modules, 0.3: one file)
    source = getattr(harness, "CHAT_PROGRAM_SOURCE", None) or harness.PROGRAM_SOURCE
    program = {"__name__": "vf_chat_program"}  # not __main__: its main() is ours to call
    exec(compile(source, "<verifiers chat program>", "exec"), program)
    # 0.4's model client loads the CA bundle anew each launch (about 0.1 s: most of an episode's
    # cost), for a loopback endpoint that never uses TLS: one context serves every launch.
    tls = ssl.create_default_context()
    if "DefaultAsyncHttpxClient" in program:
        new_client = program["DefaultAsyncHttpxClient"]
        program["DefaultAsyncHttpxClient"] = lambda **kw: new_client(**{**kw, "verify": tls})
    try:  # 0.4: tool servers served here; 0.3's early v1: refused at load
        tools = ToolServers(tls) if "connect_mcp" in program else None
    except (ImportError, AttributeError):
        tools = None
    if tools:
        program["connect_mcp"] = tools.connect

        async def call_mcp(servers, dispatch, name, arguments):
            return await tools.call(servers, dispatch, name, arguments,
                                    program["mcp_content_to_chat_content"])
        program["call_mcp"] = call_mcp

    class InProcessNull(NullHarness):
        async def setup(self, runtime):
            return None  # nothing to install: the program runs here

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                         tool_interception_url=None):
            system, prompt = self.resolve_prompt(data)
            argv = ["chat", f"--base-url={endpoint}", f"--api-key={secret}",
                    f"--model={ctx.model}"]
            if tool_interception_url:
                argv.append(f"--tool-interception-url={tool_interception_url}")
            if mcp_urls:  # the in-process servers' URLs (ToolServers)
                argv.append("--mcp-config=" + json.dumps({"mcpServers": {
                    name: {"url": url, "timeout": self.config.tool_timeout}
                    for name, url in mcp_urls.items()}}))
            if system:
                argv.append(f"--system-prompt={system}")
            if isinstance(prompt, str):
                argv.append(f"--prompt={prompt}")
            elif prompt is not None:  # a resumed conversation: the program reads it from a file
                path = os.path.join(runtime.info.id or "/tmp", f".vf-initial-{trace.id}.json")
                with open(path, "w") as f:
                    json.dump([message_to_wire(m) for m in prompt], f)
                argv.append(f"--initial-messages-file={path}")
            sys.argv = argv  # read by the program's parse_args before its first await
            try:  # ended as the program's process would end: Verifiers judges its exit
                await program["main"]()
            except SystemExit as e:
                return vf.ProgramResult(exit_code=int(e.code or 0), stdout="", stderr="")
            except Exception as e:  # a refused turn (a @vf.stop, max_turns) ends it so too
                return vf.ProgramResult(exit_code=1, stdout="", stderr=f"{type(e).__name__}: {e}")
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    module = types.ModuleType(HARNESS)
    module.InProcessNull, module.__all__ = InProcessNull, ["InProcessNull"]
    module.program, module.tools = program, tools  # the chat program's namespace, its tool servers
    sys.modules[HARNESS] = module
