"""
Reverse-text environment (single turn): answer a paragraph's character-by-character reversal.

    python eval.py --model out/sft --env reverse -n 5 -r 3
    python rl.py --env reverse --batch 64 --group 8 --max_new_tokens 32

Reward: difflib.SequenceMatcher(None, answer, target).ratio() where the answer is the content of
the LAST <reversed_text>...</reversed_text> pair (0.0 with no such pair). An answer longer than
twice the target is matched on its first 2*len(target) characters only, while its full length
still counts in the ratio's denominator (2*matches / (len(answer) + len(target))): scoring a
multi-MB reply stays cheap, and an answer over twice the target's length scores at most 2/3.
Texts come from `data_path` (a .txt file with one paragraph per non-empty line, or a .jsonl file
with a "text" field) or, by default, are generated offline from a built-in vocabulary. Pure
Python: no torch here.
"""
import difflib
import json
import os
import random

# the vocabulary of the generated texts (no data_path): common words, offline
WORDS = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye job
word business issue side kind head house service friend father power hour game line end member law
car city community name president team minute idea kid body information back parent face others
level office door health person art war history party result change morning reason research girl
guy moment air teacher force education river garden window quiet green small bright old new long
short early late happy careful slow quick warm cold simple strong gentle open clear dark light red
blue yellow walks runs reads writes sings builds finds keeps holds brings turns learns grows opens
waits listens and the a of to in on with under over near after before because while""".split()

SYSTEM_PROMPT = (  # the task and its answer tag, with a worked example
    "Reverse the text character by character: the last character first, the first character last.\n"
    "Put your answer inside <reversed_text>...</reversed_text>, for example:\n"
    "input: abc de\n"
    "<reversed_text>ed cba</reversed_text>")


def parse_answer(reply):
    """Content of the last <reversed_text> pair, or None."""
    end = reply.rfind("</reversed_text>")  # rfind, not a regex: linear time on any reply
    start = reply.rfind("<reversed_text>", 0, end) if end >= 0 else -1
    return reply[start + len("<reversed_text>"):end].strip() if start >= 0 else None


def similarity(answer, target):
    """SequenceMatcher ratio, the answer matched on at most 2*len(target) characters (see above)."""
    if answer is None:
        return 0.0
    if not answer and not target:
        return 1.0
    head = answer[:2 * len(target)]
    matches = sum(b.size for b in difflib.SequenceMatcher(None, head, target).get_matching_blocks())
    return 2.0 * matches / (len(answer) + len(target))


def read_texts(path):
    if not os.path.exists(path):
        raise FileNotFoundError(f"data_path={path!r} does not exist: "
                                "give a .txt (one paragraph per line) or .jsonl file")
    with open(path, encoding="utf-8") as f:
        if path.lower().endswith(".jsonl"):
            texts = []
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        text = json.loads(line)["text"]
                        assert isinstance(text, str)
                        texts.append(text.strip())
                    except (ValueError, KeyError, TypeError, AssertionError) as e:
                        raise ValueError(f"{path}:{i}: expected a JSON object with a 'text' field "
                                         f"({e})") from None
        else:
            texts = [line.strip() for line in f if line.strip()]
    if not texts:
        raise ValueError(f"data_path={path!r} holds no text")
    return texts


class Reverse:
    system_prompt = SYSTEM_PROMPT
    reward_weights = {"similarity": 1.0}
    max_turns = 1

    def __init__(self, data_path=None, min_words=3, max_words=12):
        integer = lambda x: isinstance(x, int) and not isinstance(x, bool)  # JSON true is no count
        if not (integer(min_words) and integer(max_words) and 1 <= min_words <= max_words):
            raise ValueError(f"min_words={min_words!r}, max_words={max_words!r}: "
                             "need integers with 1 <= min_words <= max_words")
        if data_path is not None and not isinstance(data_path, str):
            raise ValueError(f"data_path={data_path!r}: must be the path of a .txt or .jsonl file")
        self.texts = read_texts(data_path) if data_path else None
        self.min_words, self.max_words = min_words, max_words

    def examples(self, n, seed=0):
        rng = random.Random(seed)
        rows = []
        for _ in range(n):
            if self.texts:
                text = rng.choice(self.texts)
            else:
                words = [rng.choice(WORDS)
                         for _ in range(rng.randint(self.min_words, self.max_words))]
                text = " ".join(words).capitalize() + rng.choice(".!?")
            rows.append({"seed": rng.randrange(2**31), "text": text})
        return rows

    def reset(self, example):
        state = {"text": example["text"], "seed": example["seed"], "answer": None, "done": False}
        return state, f"input: {example['text']}"

    def step(self, state, reply):
        state["answer"], state["done"] = (
            parse_answer(reply if isinstance(reply, str) else str(reply)), True)
        return None

    def rewards(self, state):
        return {"similarity": similarity(state["answer"], state["text"][::-1])}

    def metrics(self, state):
        return {"tagged": float(state["answer"] is not None),
                "exact": float(state["answer"] == state["text"][::-1])}

    scripted_players = ("oracle",)

    def scripted_player(self, name):
        if name != "oracle":
            raise ValueError(f"unknown scripted player {name!r} for reverse: use 'oracle'")
        return lambda state: f"<reversed_text>{state['text'][::-1]}</reversed_text>"

    def describe(self, state):
        return f"target: {state['text'][::-1]}\nanswer: {state['answer']}"


def load_environment(data_path=None, min_words=3, max_words=12):
    """data_path: .txt or .jsonl texts (default: generated offline); min/max_words: the length of
    generated texts."""
    return Reverse(data_path, min_words, max_words)
