"""An OpenEnv MCP environment: look a key's value up with one tool, submit it with another (the
submit ends the episode: reward 1 for the right value, else 0). Its first observation is a plain
Observation whose task is in its metadata, as MCP environments often write it."""
import random
from typing import Optional

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Observation, State

WORDS = ["apple", "brick", "cloud", "dune", "ember", "frost", "grove", "haze"]


class LookupEnvironment(MCPEnvironment):
    def __init__(self):
        mcp = FastMCP("lookup")
        self.table, self.key, self._state = {}, None, State()

        @mcp.tool
        def lookup(key: str) -> str:
            """The value of a key."""
            if key not in self.table:
                raise ValueError(f"no key {key!r}")
            return self.table[key]

        @mcp.tool
        def submit(value: str) -> str:
            """Submit the value: ends the episode."""
            return "submitted"
        super().__init__(mcp)

    def reset(self, seed: Optional[int] = None, episode_id=None, **kwargs) -> Observation:
        rng = random.Random(seed)
        self.table = {f"k{i}": rng.choice(WORDS) for i in range(4)}
        self.key, self._state = rng.choice(sorted(self.table)), State()
        return Observation(metadata={"task": f"Find the value of {self.key} and submit it."})

    def step(self, action, timeout_s=None, **kwargs) -> Observation:
        self._state.step_count += 1
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            right = action.arguments.get("value") == self.table[self.key]
            observation.done, observation.reward = True, 1.0 if right else 0.0
        return observation

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return Observation(metadata={"error": "call a tool"})

    @property
    def state(self) -> State:
        return self._state
