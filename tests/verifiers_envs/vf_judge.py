"""A classic Verifiers environment scored by a judge (test data for env_verifiers.py), as Hub
environments are written: a `JudgeRubric` made with no client of its own (Verifiers builds an
OpenAI one), whose reward asks the judge (greedy) and reads its verdict. The test serves a model
whose greedy answer is always `<move>5</move>`, so a verdict counts as "yes" where it names 5."""
import verifiers as vf
from datasets import Dataset


def load_environment():
    rubric = vf.JudgeRubric(judge_prompt="Question: {question}\nAnswer: {answer}\n"
                                         "Response: {response}\nIs the response right?",
                            judge_sampling_args={"temperature": 0.0, "max_tokens": 16})

    async def judged(judge, prompt, completion, answer, state, **kwargs) -> float:
        verdict = await judge(prompt, completion, answer, state)
        return float("5" in verdict)

    rubric.add_reward_func(judged)
    rows = [{"question": f"What is {a} + 3?", "answer": str(a + 3)} for a in range(4)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), system_prompt="Answer.",
                            rubric=rubric)
