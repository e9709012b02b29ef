"""The reference an adapter is checked against: one episode run and scored by Verifiers' OWN code.

    from reference import reference_score_sync
    env = vf_game.load_environment(max_turns=3)
    replies = ["<guess>10</guess>", "<guess>5</guess>"]
    out = reference_score_sync(env, env.get_dataset()[0], replies)
    out["reward"], out["metrics"], out["completion"], out["stop_condition"]

The model is a scripted vf.Client that answers model turn k with replies[k]: a string
(assistant text) or a dict {"content": str, "tool_calls": [{"id", "name", "arguments"}]}
("arguments" a JSON string, as the OpenAI API sends it). Everything else is Verifiers':
the row becomes the RolloutInput as Environment.generate does (the dataset row dict,
whole), and Environment.run_rollout runs rollout (setup_state, stop conditions,
env_response, tool calls, final_env_response) and then rubric.score_rollout.
An empty reply (no text, no tool call) fails as with Verifiers' OpenAI client: an
EmptyModelResponseError, so the rollout stops with stop_condition "has_error".
"""
import asyncio
import json
from copy import deepcopy

import verifiers as vf
from verifiers.errors import EmptyModelResponseError
from verifiers.types import Response, ResponseMessage, ToolCall


class ScriptedClient(vf.Client):
    """A vf.Client whose "model" replays a list of replies, one per model turn.

    It goes through vf.Client.get_response like every real client (to_native_prompt ->
    get_native_response -> raise_from_native_response -> from_native_response), so what
    Verifiers does around a model call (wrapping errors as vf.ModelError, usage) still runs.
    It records each turn's prompt and tools, as the model would have seen them."""

    def __init__(self, replies: list):
        super().__init__(None)  # no native client and no ClientConfig: nothing to connect to
        self.replies = list(replies)
        self.used = 0
        self.exhausted = False
        self.turn_prompts: list[list[dict]] = []
        self.turn_tools: list[list[dict]] = []

    def setup_client(self, config):
        return None

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        if self.used >= len(self.replies):
            # raised inside a rollout this becomes state["error"]; reference_score re-raises
            self.exhausted = True
            raise RuntimeError(f"the environment asked for model turn {self.used + 1}, "
                               f"but only {len(self.replies)} replies were given")
        self.turn_prompts.append([plain_message(m) for m in prompt])
        self.turn_tools.append([t.model_dump(exclude_none=True) for t in tools or []])
        reply = self.replies[self.used]
        self.used += 1
        return reply

    async def raise_from_native_response(self, response) -> None:
        # as OpenAIChatCompletionsClient does: no text and no tool call is an invalid response
        text, tool_calls = split_reply(response)
        if not text and not tool_calls:
            raise EmptyModelResponseError("Model returned no content and did not call any tools")

    async def from_native_response(self, response) -> Response:
        text, tool_calls = split_reply(response)
        calls = [ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"])
                 for c in tool_calls]
        return Response(
            id=f"scripted-{self.used}",
            created=0,
            model="scripted",
            usage=None,  # no token counts: Verifiers then leaves token_usage out
            message=ResponseMessage(
                content=text,
                reasoning_content=None,
                tool_calls=calls or None,
                finish_reason="tool_calls" if calls else "stop",
                is_truncated=False,
                tokens=None,  # no token ids: the trajectory's tokens stay None
            ),
        )

    async def close(self) -> None:
        return None


def split_reply(reply) -> tuple[str | None, list[dict]]:
    """A reply as (text, tool calls); a string is text alone."""
    if isinstance(reply, str):
        return reply, []
    calls = reply.get("tool_calls") or []
    for c in calls:
        if not isinstance(c.get("arguments"), str):
            raise TypeError(f"tool call arguments must be a JSON string, got {c!r}")
    return reply.get("content"), calls


def plain_message(message) -> dict:
    """A Verifiers message (pydantic, or the dict that state_to_output makes of one with tool
    calls, whose calls are JSON strings) as a plain dict; tool calls as {"id", "name",
    "arguments"} dicts."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    message = dict(message)
    if message.get("tool_calls"):
        message["tool_calls"] = [json.loads(c) if isinstance(c, str) else dict(c)
                                 for c in message["tool_calls"]]
    return message


def rollout_input(env, row) -> dict:
    """The RolloutInput for a dataset row, as Environment.generate/evaluate make it: the row
    dict itself (example_id, prompt, answer, info and any other column; evaluate gets the
    rows by get_eval_dataset().to_list()). An int picks that row of env.get_dataset()."""
    if isinstance(row, int):
        row = env.get_dataset()[row]
    return deepcopy(dict(row))


async def reference_score(env, row, replies: list, model: str = "scripted",
                          sampling_args: dict | None = None) -> dict:
    """Run one episode of `env` on `row` with scripted `replies` through Verifiers' own
    Environment.run_rollout, and return what Verifiers made of it:

    reward, metrics ({function name: value}, reward functions and weight-0 metrics alike),
    completion (plain dicts), stop_condition (the name of the stop condition that ended the
    rollout), is_truncated, error (None, or Verifiers' error record), replies_used,
    turn_prompts (the messages the model saw at each turn) and turn_tools (the tools offered).

    Raises ValueError when the environment wanted more model turns than there are replies
    (leftover replies are fine: replies_used says how many were taken)."""
    client = ScriptedClient(replies)
    # generate() starts from the environment's own sampling args and updates them
    args = deepcopy(env.sampling_args)
    args.update(sampling_args or {})
    output = await env.run_rollout(rollout_input(env, row), client, model, args)
    if client.exhausted:
        raise ValueError(f"{len(replies)} replies were not enough for this episode")
    return {
        "reward": float(output["reward"]),
        "metrics": {k: float(v) for k, v in output["metrics"].items()},
        "completion": [plain_message(m) for m in output["completion"]],
        "stop_condition": output.get("stop_condition"),
        "is_truncated": bool(output.get("is_truncated")),
        "error": output.get("error"),
        "replies_used": client.used,
        "turn_prompts": client.turn_prompts,
        "turn_tools": client.turn_tools,
    }


def reference_score_sync(env, row, replies: list, **kwargs) -> dict:
    """reference_score outside an event loop (asyncio.run)."""
    return asyncio.run(reference_score(env, row, replies, **kwargs))
