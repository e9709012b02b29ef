"""Classic Verifiers environments on the API before 0.1.8 (test data for env_verifiers.py), as
environments written for verifiers 0.1.0-0.1.7 still circulate: `is_completed(messages, state)`
overridden (`variant="is_completed"`), or an `env_response` returning (messages, state)
(`variant="tuple"`). Neither runs on the versions the adapter supports: the load says so in one
line. `variant="ported"` is the same environment ported to the current API, which runs.
"""
import verifiers as vf
from datasets import Dataset


class OldIsCompleted(vf.MultiTurnEnv):
    def is_completed(self, messages, state, **kwargs) -> bool:
        return len([m for m in messages if m["role"] == "assistant"]) >= 2

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Once more."}]


class OldTuple(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Once more."}], state


class Ported(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Once more."}]


def load_environment(variant="is_completed"):
    dataset = Dataset.from_list([{"question": "Say hi.", "answer": "hi"}] * 4)
    rubric = vf.Rubric(funcs=[lambda completion, answer, **kw: float(answer in str(completion))])
    cls = {"is_completed": OldIsCompleted, "tuple": OldTuple, "ported": Ported}[variant]
    return cls(dataset=dataset, rubric=rubric, max_turns=2)
