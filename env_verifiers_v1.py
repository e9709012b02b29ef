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

Nothing is sent anywhere: the seat runs in the local `subprocess` runtime, the model is our policy
and no result is pushed. Refused at load, with the reason: a seat pinned to another harness (`bash`
and the coding agents run programs), to a sandbox runtime or to a model of its own, several seats,
hosted judges, tasks in container images, task-scoped tool servers (each one a process per
episode), and prompts that are not text with one system prompt for all tasks.
"""
import asyncio
import json
import os
import random
import ssl
import sys
import time
import types

HARNESS = "rlenvs_inprocess_null"  # the module name our in-process chat harness registers as
DEFAULT_MAX_TURNS = 16  # the cut-off for an environment with no turn limit of its own (both APIs)


def start_row(seed, n_rows, num_groups):
    """The first of a step's consecutive rows (cyclic; both APIs), drawn from seed and aligned to
    num_groups: each step's examples cover the difficulty buckets as the dataset lays them out."""
    start = random.Random(f"verifiers/{seed}").randrange(n_rows)
    return start - start % num_groups


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
                 num_groups=None):
        vf = self.vf = import_v1()
        _register_harness(vf)
        self.env = self._build(vf, module, args or {}, max_turns)
        outer = random.getstate()
        random.seed(dataset_seed)  # a load() drawing from the global random: the same tasks
        try:
            self.tasks = list(self.env.taskset)
        finally:
            random.setstate(outer)
        if not self.tasks:
            raise ValueError(f"{module.__name__}: its Taskset loaded no tasks")
        self.system_prompt = self._check_tasks()
        seat = next(iter(self._seats(self.env.config).values()))
        self.max_turns, self.num_groups = seat.max_turns, num_groups or 1
        task = self.tasks[0]
        self.reward_weights = {f.__name__: float(getattr(f, "_vf_weight", 1.0))
                               for f in task.hooks("reward")}
        self.metric_names = [f.__name__ for f in task.hooks("metric")]
        self.tools = None
        self.episodes = {}  # trace id -> Episode, for the client (live episodes only)
        self.loop = asyncio.new_event_loop()
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
        task_cls = type(env.taskset).task_type()
        why = ("its taskset serves tool servers (a process each): not run here"
               if type(env.taskset).toolsets(env.taskset.config) else
               "its tasks serve tool servers (a process per episode): not run here"
               if task_cls.toolsets(env.taskset.config.task) else None)
        if why:
            raise ValueError(f"{name} cannot run here: {why}")
        return env

    def _check_tasks(self):
        """The tasks' one system prompt; ValueError for what the policy cannot be given."""
        systems = set()
        for i, task in enumerate(self.tasks):
            data = task.data
            why = ("its prompt is not text" if not isinstance(data.prompt, str) else
                   "it runs in a container image" if data.image else
                   "it asks a hosted judge" if task.plugged_judges() else None)
            if why:
                raise ValueError(f"task {i} cannot run here: {why}")
            systems.add(data.system_prompt or "")
        if len(systems) > 1:
            raise ValueError(f"the tasks have {len(systems)} different system prompts: "
                             "only one is supported")
        return systems.pop()

    # ------------------------------------------------------------------------- the contract

    def examples(self, n, seed=0):
        start = start_row(seed, len(self.tasks), self.num_groups)
        return [{"seed": seed, "row": (start + i) % len(self.tasks)} for i in range(n)]

    def reset(self, example):
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


def _plain(message):
    """A wire message as our policy reads it: role and text content (tool results keep theirs)."""
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": message.get("role"), "content": content}


def _key(message):
    return (message.get("role"), _plain(message)["content"])


def _policy_client(vf, adapter):
    """A vf.Client whose model is our policy: a request awaits the reply given to step()."""
    from verifiers.v1.types import AssistantMessage, Response

    class PolicyClient(vf.Client):
        async def get_response(self, dialect, body, sampling, session_id=None, turn=None,
                               headers=None):
            episode = adapter.episodes[session_id]
            episode.reply = asyncio.get_running_loop().create_future()
            episode.turn.set_result(body.get("messages") or [])
            text = await episode.reply
            message = {"role": "assistant", "content": text}  # text: tool servers are refused
            episode.seen = list(body.get("messages") or []) + [message]
            created = int(time.time())
            raw = {"id": "policy", "object": "chat.completion", "created": created,
                   "model": "policy",
                   "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
            return Response(id="policy", created=created, model="policy", finish_reason="stop",
                            message=AssistantMessage(content=text), raw=raw)
    return PolicyClient()


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
    if "DefaultAsyncHttpxClient" in program:
        new_client, tls = program["DefaultAsyncHttpxClient"], ssl.create_default_context()
        program["DefaultAsyncHttpxClient"] = lambda **kw: new_client(**{**kw, "verify": tls})

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
    sys.modules[HARNESS] = module
