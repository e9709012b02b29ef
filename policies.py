"""Policies besides a local Hugging Face model (sample.HFPolicy), for eval.py and sft.py's teachers:
an OpenAI-compatible API and scripted players; make_policy picks one from a --model string."""
import concurrent.futures
import json
import os
import random
import threading
import time

from common import TRAIN_FLAG_RULES, at_least, load_model, non_negative
from guard import import_source
from sample import HFPolicy


# ------------------------------------------------------------------ an OpenAI-compatible server
class APIError(RuntimeError):
    """Refused by the server or unreachable through all retries; the message says what to change."""


class APIPolicy:
    """Chat completions from an OpenAI-compatible server: concurrent requests, retries with backoff,
    a seed per request. A server takes text, not tokens: it re-tokenizes it all each turn."""
    RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}  # timeouts, rate limits, server errors
    REASONING_FIELDS = ("reasoning_content", "reasoning")  # transformers serve, vLLM; hosted APIs

    def __init__(self, model, api_base, key_env="OPENAI_API_KEY", temp=1.0, max_new_tokens=1024,
                 concurrency=16, top_p=1.0, seed=0, send_seed=True, retries=6, timeout=120.0,
                 backoff=1.0, tools=None):
        import openai
        self.openai, self.model, self.temp, self.top_p = openai, model, temp, top_p
        self.client = openai.OpenAI(base_url=api_base, api_key=os.environ.get(key_env) or "EMPTY",
                                    max_retries=0, timeout=timeout)
        self.max_new_tokens, self.api_base, self.tools = max_new_tokens, api_base, tools
        self.concurrency, self.retries, self.backoff = concurrency, retries, backoff
        self.seed, self.send_seed, self.gen_tokens, self.lock = seed, send_seed, 0, threading.Lock()

    def __call__(self, episodes):
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda ep: self._one(ep["messages"], self._request_seed(ep))
                                 if ep.get("force") is None else ep["force"], episodes))

    def _request_seed(self, ep):
        """Keyed by (seed, episode, rollout, turn): a rerun sends the same, in any answer order."""
        turn = sum(m["role"] == "assistant" for m in ep["messages"])
        return random.Random(f"{self.seed}/{ep['index']}/{ep['rollout']}/{turn}").randrange(2**31)

    def _one(self, messages, seed):
        # a tool result goes as a user message: an API's tool role needs an id our text calls lack
        sent = [{"role": "user", "content": m["content"]} if m["role"] == "tool" else m for m in messages]
        opts = {"temperature": self.temp, "max_tokens": self.max_new_tokens}
        if self.top_p < 1.0:  # not sent at 1.0: some servers refuse top_p for some models
            opts["top_p"] = self.top_p
        if self.send_seed:
            opts["seed"] = seed
        if self.tools:  # an environment's tools (a Verifiers ToolEnv's), as a local model gets them
            opts["tools"] = self.tools
        for attempt in range(self.retries + 1):
            try:
                resp = self.client.chat.completions.create(model=self.model, messages=sent, **opts)
                with self.lock:
                    self.gen_tokens += getattr(resp.usage, "completion_tokens", 0) or 0
                return self._as_written(resp.choices[0].message)
            except (self.openai.APITimeoutError, self.openai.APIConnectionError, self.openai.APIStatusError) as e:
                status = getattr(e, "status_code", None)
                if status is not None and status not in self.RETRYABLE_STATUS:
                    reason = server_reason(e)
                    raise APIError(f"API error {status} from {self.api_base} for model {self.model!r}: "
                                   f"{reason}. {self._what_to_change(reason, status)}") from e
                if attempt == self.retries:
                    raise APIError(f"API at {self.api_base} still failing after "
                                   f"{self.retries + 1} attempts ({type(e).__name__}: "
                                   f"{server_reason(e)}). Is the server up? Retry later; finished "
                                   "rollouts are kept (eval.py --resume continues).") from e
                time.sleep(min(self.backoff * 2 ** attempt, 30.0) * (0.5 + random.random()))

    def _as_written(self, message):
        """The reply as written, to be scored, shown and resent: <think> and <tool_call> blocks (as
        Hermes/Qwen3 write them) back from the fields a server's parsers move them to."""
        think = next(filter(None, (getattr(message, f, None) for f in self.REASONING_FIELDS)), None)
        calls = "".join(f'<tool_call>{{"name": {json.dumps(c.function.name)}, '
                        f'"arguments": {c.function.arguments}}}</tool_call>'
                        for c in (getattr(message, "tool_calls", None) or []))
        return (f"<think>{think}</think>" if think else "") + (message.content or "") + calls

    def _what_to_change(self, reason, status):
        reason = reason.lower()
        if "seed" in reason and self.send_seed:
            return ("The server refuses the `seed` parameter: rerun with --no_api_seed "
                    "(its games are then not reproducible).")
        if "top_p" in reason and self.top_p < 1.0:
            return "The server refuses the `top_p` parameter: rerun with --top_p 1 (it is then not sent)."
        if status in (401, 403):
            return "Check the key in the environment variable that --api_key_env names."
        return (f"--model must be the name the server serves (GET {self.api_base.rstrip('/')}/"
                "models lists them); check --api_base and the key in --api_key_env.")


def server_reason(e):
    """The server's explanation of an error on one line: the body's message or detail, or str(e)."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        body = body.get("error", body)
        if isinstance(body, dict):
            body = body.get("message") or body.get("detail") or json.dumps(body)
    text = body if isinstance(body, str) and body else str(e)
    return " ".join(text.split())[:400].rstrip(".")


# ------------------------------------------------------------ the environment's scripted players
class ScriptedPolicy:
    """One of the environment's scripted players (its `scripted_players`), by name."""

    def __init__(self, env, name):
        try:
            self.player = env.scripted_player(name)
        except ValueError as e:  # a player this environment does not have
            raise SystemExit(str(e)) from None
        self.gen_tokens = 0

    def __call__(self, episodes):
        return [self.player(ep["state"]) if ep.get("force") is None else ep["force"]
                for ep in episodes]


class FunctionPolicy:
    """A scripted player given as "module:function" or "path/file.py:function": the conversation so
    far ({"role", "content"} messages) -> the reply. It sees only what the model would see."""

    def __init__(self, spec):
        where, _, name = spec.rpartition(":")
        try:
            module = import_source(where)
        except (ImportError, OSError) as e:
            raise SystemExit(f"scripted player {spec!r}: cannot import {where!r} ({e})") from None
        self.function = getattr(module, name, None)
        if not callable(self.function):
            raise SystemExit(f"scripted player {spec!r}: {where} has no function {name!r}")
        self.gen_tokens = 0

    def __call__(self, episodes):
        return [self.function([dict(m) for m in ep["messages"]]) if ep.get("force") is None
                else ep["force"] for ep in episodes]


def is_function_spec(model):
    """A --model/--teacher naming a Python function ("module:function"), not a hub id or a dir."""
    return ":" in model and "://" not in model and not os.path.isdir(model)


def make_policy(model, env, device="auto", temp=1.0, top_p=1.0, max_new_tokens=128, batch_size=256,
                api_base=None, api_key_env="OPENAI_API_KEY", concurrency=16, seed=0, send_seed=True,
                engine="auto"):
    """A policy from a --model string: a function, scripted player, API model or HF model."""
    if is_function_spec(model):
        return FunctionPolicy(model)
    if model in getattr(env, "scripted_players", ()) and not os.path.isdir(model):
        return ScriptedPolicy(env, model)
    if api_base:
        return APIPolicy(model, api_base, api_key_env, temp, max_new_tokens, concurrency, top_p,
                         seed, send_seed, tools=getattr(env, "tools", None))
    try:
        lm, tokenizer = load_model(model, device)
    except SystemExit as e:  # perhaps meant as a scripted player: say which the environment has
        players = ", ".join(getattr(env, "scripted_players", ())) or "none"
        raise SystemExit(f"{e} (this environment's scripted players: {players})") from None
    return HFPolicy(lm, tokenizer, env.system_prompt, temp, top_p, max_new_tokens, batch_size,
                    seed=seed, engine=engine, tools=getattr(env, "tools", None))


# -------------------------------------------------------------- a policy from the command line
def add_policy_args(p):
    """Flags of the scripts that play episodes with any policy (eval.py, an environment's CLI)."""
    p.add_argument("--model", default="out/sft", help="hub id or save_pretrained dir, an API model "
                   "with --api_base, a scripted player or module:function (conversation -> reply)")
    p.add_argument("--env", default="tictactoe", help="environment NAME: imports env_NAME.py")
    p.add_argument("--env_args", default="{}", help="JSON keyword arguments for load_environment()")
    p.add_argument("--temp", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--max_new_tokens", type=int, default=128, help="max generated tokens per turn")
    p.add_argument("--batch_size", type=int, default=256, help="max episodes per rollout batch (bounds KV memory)")
    p.add_argument("--engine", choices=["auto", "hf", "fast"], default="auto", help="HF rollout "
                   "engine: hf (generate(), reference), fast (engine.py); auto: fast where it fits")
    p.add_argument("--seed", type=int, default=0, help="seed for examples and sampling")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    return add_api_args(p)


def add_api_args(p, who="--model"):
    """The flags of an API model (eval.py's --model, sft.py's --teacher)."""
    p.add_argument("--api_base", default=None,
                   help=f"OpenAI-compatible base URL; {who} is then the served model name")
    p.add_argument("--api_key_env", default="OPENAI_API_KEY", help="env var holding the API key")
    p.add_argument("--concurrency", type=int, default=16, help="max concurrent API requests")
    p.add_argument("--no_api_seed", action="store_true", help="API models: send no per-request "
                   "seed (for a server that refuses one; its games are then not reproducible)")
    return p


POLICY_FLAG_RULES = {  # add_policy_args' flags: (test, what the value must be), for check_flags
    "temp": (non_negative, "a finite number >= 0 (0: greedy)"),
    "top_p": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "max_new_tokens": (at_least(1), ">= 1"),
    "batch_size": (at_least(1), ">= 1"),
    "concurrency": (at_least(1), ">= 1"),
    "device": TRAIN_FLAG_RULES["device"], "seed": TRAIN_FLAG_RULES["seed"],  # as the trainers'
}


def policy_from_args(args, env, temp=None):
    return make_policy(args.model, env, args.device, args.temp if temp is None else temp, args.top_p,
                       args.max_new_tokens, args.batch_size, args.api_base, args.api_key_env,
                       args.concurrency, args.seed, not args.no_api_seed, args.engine)
