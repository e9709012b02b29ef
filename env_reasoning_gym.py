"""
Reasoning Gym tasks (single turn): any of reasoning-gym's procedural datasets, or a weighted mix.

    pip install reasoning-gym==0.1.25      # an optional extra: not in requirements.txt
    python eval.py --env reasoning_gym --env_args '{"task": "leg_counting"}' --model oracle -n 20
    python eval.py --env reasoning_gym --model blank -n 20 \\
        --env_args '{"tasks": {"leg_counting": 1, "basic_arithmetic": 2}}'
    python rl.py --env reasoning_gym --batch 64 --group 8 \\
        --env_args '{"task": "basic_arithmetic", "config": {"max_terms": 3}}'

env_args: `task` (one dataset name) or `tasks` ({name: weight}, a weighted mix); `config`: the
dataset's own configuration, passed through to reasoning_gym.create_dataset (for a mix,
{name: config} per task; its "seed" moves the data, its "size" makes a fixed pool of that many
entries); `allow_broken_scorer`, `allow_unsafe_scorer`, `allow_unreproducible`: use a task that is
refused by default (below, and docs/REASONING_GYM.md).

The question is the library's; the answer is read, as the library does, from the reply's last
<answer>...</answer> (stripped); the system prompt adds our optional <think>...</think> before it.

Rewards: `score` (weight 0.9): the library's own score_answer of the answer, clamped to [0, 1]: 0
with no answer or an empty one, with an answer over max(4096, 4 x the reference's length)
characters, and where the scorer raises (some do on junk text) or returns NaN. `format` (weight
0.1): 1 for a well-formed reply (whitespace, an optional <think>...</think>, then one non-empty
<answer>...</answer> and nothing after it). The total is in [0, 1]: 1 exactly for a well-formed
full-score answer, 0 for a blank one. Metrics: `solved` (1 only for a full score: the default
scorer gives partial credit to an answer merely containing the reference), `format`, `score`.

Rows are JSON-clean: {"seed", "task", "dataset_seed", "index", "config"}, all that regenerates the
entry (reset regenerates it; the library's metadata keeps tuples and other non-JSON values). Entry
i of a reasoning-gym dataset is built from Random(dataset_seed + i), so consecutive ranges of
indices would repeat most of their entries from one step to the next: here a row's index is a hash
of (our seed, row number) into [0, 2**31) over one fixed dataset seed (the config's "seed",
default 0), so a run's examples do not repeat (two rows share an index with probability 2**-31).
The tasks whose entries are precomputed or bounded by the dataset's size (BOUNDED) instead draw,
per call, a dataset seed hashed from our seed and distinct indices in range(size).

Refused unless allowed:
  - a broken scorer: BROKEN_SCORERS (game_of_life_halting: any non-empty answer gets full marks;
    coin_flip: "0"), and any task a probe at load finds giving a junk answer ("x", "0",
    "no answer") that is not the reference full marks on 2 or more of 6 entries (for every task
    and config: a config can break a scorer);
  - UNSAFE_SCORERS: scorers that run the answer through sympy's parse_expr, which evaluates
    Python: an answer can run code or hang the process (countdown and puzzle24 use it too, but
    first require a plain arithmetic answer: digits, + - * /, parentheses, spaces; no **, no names);
  - UNREPRODUCIBLE: entries that differ between two processes with different PYTHONHASHSEED, or
    between two generations in one process (a one-off scan, docs/REASONING_GYM.md).
Four scorers eval() the answer for partial credit (a list written as Python, EVAL_SCORERS): in
those modules eval is replaced by ast.literal_eval where the environment is built. The library
prints in some tasks: stdout is silenced while it creates, generates and scores.

Scripted players: `oracle` (the reference answer, well-formed) and `blank` (an empty answer).
The library runs behind guard.py, in a worker process: a reply whose scoring hangs or crashes
(sympy on a tower of powers) scores 0 with metric `timeout` or `error`, and the run goes on.
"""
import ast
import contextlib
import hashlib
import importlib
import json
import math
import random
import re
from collections import OrderedDict

import reasoning_gym  # noqa: F401  (a missing package: common.load_env says which)
from reasoning_gym.factory import DATASETS, create_dataset

from guard import Guarded

SYSTEM_PROMPT = (  # our optional think, then the answer where the library reads it
    "Answer the question. You may think first inside <think>...</think>, then give only the final "
    "answer\ninside <answer>...</answer> and nothing after it, for example:\n"
    "<think>3 dogs have 12 legs and 2 birds have 4: 16 in all.</think>\n"
    "<answer>16</answer>\n"
    "Do not explain your reasoning inside the answer tags. Where the question shows the answer's "
    "format, follow it exactly.")

# the entries are precomputed in the constructor, or the index is checked against the dataset's
# size: an index beyond `size` raises (found by asking every task of 0.1.25 for entry 10**12 + 7)
BOUNDED = {"acre", "gsm_symbolic", "list_functions", "word_ladder"}
# scorers passing the answer to sympy's parse_expr (an eval: code execution, a hang on 9**9**9**9)
UNSAFE_SCORERS = {"intermediate_integration", "polynomial_multiplication", "simple_integration"}
# scorers also using parse_expr, on answers that must be plain ARITHMETIC: checked here first
ARITHMETIC_ANSWERS = {"countdown", "puzzle24"}
ARITHMETIC = re.compile(r"[0-9+\-*/() ]+")
# modules whose scorer calls eval(answer) for partial credit: eval is ast.literal_eval there
EVAL_SCORERS = {"binary_matrix": "reasoning_gym.algorithmic.binary_matrix",
                "n_queens": "reasoning_gym.games.n_queens",
                "spiral_matrix": "reasoning_gym.algorithmic.spiral_matrix",
                "string_insertion": "reasoning_gym.algorithmic.string_insertion"}
# entries that change with PYTHONHASHSEED (set iteration), or even between two generations in one
# process (a one-off scan of 0.1.25 on 2026-11-27, docs/REASONING_GYM.md)
UNREPRODUCIBLE = {"codeio", "isomorphic_strings", "knight_swap", "list_functions",
                  "polynomial_multiplication", "ransom_note"}
# scorers that give junk full marks, whatever the config (a one-off scan of 0.1.25, 2026-11-27)
BROKEN_SCORERS = {
    "coin_flip": "the answer '0' gets full marks for any probability below 1 (a prefix match)",
    "game_of_life_halting": "any non-empty answer gets full marks "
                            "(bool(answer) == bool(reference))"}
# the probe at load (for every task and config): a junk answer that is not the reference gets
# full marks on at least PROBE_FULL of PROBE_ENTRIES entries ("" never reaches a scorer: scores 0)
JUNK = ("x", "0", "no answer")
PROBE_ENTRIES, PROBE_FULL = 6, 2
MAX_ANSWER = 4096  # answers longer than max(MAX_ANSWER, 4 * len(reference)) score 0 unread
CACHE = 32  # datasets kept beyond one per task (the BOUNDED tasks' recent dataset seeds)


def _literal_eval(source, *scopes):
    """eval() for the EVAL_SCORERS modules: Python literals only, never code."""
    if scopes or not isinstance(source, str):
        raise ValueError("only a literal is evaluated here")
    return ast.literal_eval(source)


def _literal_scorers():
    """eval is ast.literal_eval in the EVAL_SCORERS modules: done where the environment is built (in
    the guard's worker), so importing this file changes nothing for other users of the library."""
    for module in EVAL_SCORERS.values():
        importlib.import_module(module).eval = _literal_eval


class _Null:
    def write(self, text):
        return len(text)

    def flush(self):
        pass


def quiet():
    """Silence the library's prints (some tasks print while they generate or score)."""
    return contextlib.redirect_stdout(_Null())


def hash_int(*parts):
    """A 63-bit integer from the parts, the same in every process (unlike hash())."""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "big") >> 1


def parse_answer(reply):
    """The stripped content of the last <answer>...</answer>, or None (rfind: linear, no regex)."""
    end = reply.rfind("</answer>")
    start = reply.rfind("<answer>", 0, end) if end >= 0 else -1
    return reply[start + len("<answer>"):end].strip() if start >= 0 else None


def well_formed(reply):
    """Whitespace, an optional think, then one non-empty <answer>...</answer>, nothing after it."""
    text = reply.strip()
    if text.startswith("<think>"):
        end = text.find("</think>")
        if end < 0 or any(tag in text[7:end] for tag in ("<think>", "<answer>", "</answer>")):
            return False
        text = text[end + len("</think>"):].lstrip()
    if not (text.startswith("<answer>") and text.endswith("</answer>")):
        return False
    inner = text[len("<answer>"):-len("</answer>")]
    return bool(inner.strip()) and not any(
        tag in inner for tag in ("<answer>", "</answer>", "<think>", "</think>"))


def _is_count(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _same_answer(junk, reference):
    """The junk is the reference (as text or number): its full marks are earned, not broken."""
    if junk == str(reference).strip():
        return True
    try:
        return float(junk) == float(str(reference))
    except (TypeError, ValueError, OverflowError):
        return False


class ReasoningGym:
    system_prompt = SYSTEM_PROMPT
    reward_weights = {"score": 0.9, "format": 0.1}
    max_turns = 1

    def __init__(self, task=None, tasks=None, config=None, allow_broken_scorer=False,
                 allow_unsafe_scorer=False, allow_unreproducible=False):
        _literal_scorers()
        for name, flag in (("allow_broken_scorer", allow_broken_scorer),
                           ("allow_unsafe_scorer", allow_unsafe_scorer),
                           ("allow_unreproducible", allow_unreproducible)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r}: must be true or false")
        if (task is None) == (tasks is None):
            raise ValueError('give one of task (a name) or tasks ({name: weight}), '
                             'e.g. {"task": "leg_counting"}')
        if task is not None:
            if not isinstance(task, str):
                raise ValueError(f"task={task!r}: must be a task name, e.g. \"leg_counting\"")
            weights = {task: 1.0}
            if config is not None and not isinstance(config, dict):
                raise ValueError(f"config={config!r}: must be a JSON object of {task}'s settings")
            configs = {task: dict(config or {})}
        else:
            if not isinstance(tasks, dict) or not tasks:
                raise ValueError(f"tasks={tasks!r}: must be a non-empty JSON object "
                                 "{name: weight}")
            for name, w in tasks.items():
                if (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
                        or w <= 0):
                    raise ValueError(f"tasks[{name!r}]={w!r}: a weight must be a positive number")
            weights = {name: float(w) for name, w in tasks.items()}
            if config is not None and not isinstance(config, dict):
                raise ValueError(f"config={config!r}: for a mix, a JSON object {{name: settings}}")
            extra = sorted(set(config or {}) - set(weights))
            if extra:
                raise ValueError(f"config names {extra}, not in tasks {sorted(weights)}")
            configs = {name: (config or {}).get(name) or {} for name in weights}
        for name in weights:
            self._check_name(name)
            if not isinstance(configs[name], dict):
                raise ValueError(f"config for {name}: {configs[name]!r} must be a JSON object")
            seed = configs[name].get("seed", 0)
            if not _is_count(seed) or not 0 <= seed < 2**31:
                raise ValueError(f"config for {name}: seed={seed!r} "
                                 "must be an integer in [0, 2**31)")
            if name in UNSAFE_SCORERS and not allow_unsafe_scorer:
                raise ValueError(f"task {name!r}: its scorer runs the answer through sympy's "
                                 "parse_expr, which evaluates Python (an answer can run code or "
                                 "hang the scorer); "
                                 "pass \"allow_unsafe_scorer\": true to use it anyway")
            if name in UNREPRODUCIBLE and not allow_unreproducible:
                raise ValueError(f"task {name!r}: its entries change with PYTHONHASHSEED (not the "
                                 "same in two processes: docs/REASONING_GYM.md); "
                                 "pass \"allow_unreproducible\": true to use it anyway")
        self.names, self.weights, self.configs = (
            list(weights), [weights[n] for n in weights], configs)
        self._datasets, self._cache_size = OrderedDict(), CACHE + len(self.names)
        self.sizes = {}
        for name in self.names:  # create each dataset now: a bad config fails at load, not mid-run
            self.sizes[name] = self._dataset(name, configs[name].get("seed", 0), configs[name]).size
            if not _is_count(self.sizes[name]) or self.sizes[name] < 1:
                raise ValueError(f"config for {name}: size={self.sizes[name]!r} "
                                 "must be a positive integer")
        self.broken = {name: why for name in self.names
                       if (why := BROKEN_SCORERS.get(name) or self._probe(name))}
        if self.broken and not allow_broken_scorer:
            name, why = next(iter(self.broken.items()))
            raise ValueError(f"task {name!r} has a broken scorer: {why}; "
                             "pass \"allow_broken_scorer\": true to use it anyway")

    @staticmethod
    def _check_name(name):
        if not isinstance(name, str) or name not in DATASETS or name == "composite":
            near = [n for n in sorted(DATASETS) if n != "composite" and isinstance(name, str) and
                    (name.lower() in n or n in name.lower())][:8]
            raise ValueError(f"no reasoning-gym task {name!r}"
                             + (f" (did you mean {', '.join(near)}?)" if near else "")
                             + f"; there are {len(DATASETS) - 1}: reasoning_gym.factory.DATASETS"
                             + ("; for a mix use tasks" if name == "composite" else ""))

    def _dataset(self, task, dataset_seed, config):
        key = (task, dataset_seed, json.dumps(config, sort_keys=True))
        if key in self._datasets:
            self._datasets.move_to_end(key)
            return self._datasets[key]
        try:
            with quiet():
                dataset = create_dataset(task, **{**config, "seed": dataset_seed})
        except (TypeError, ValueError, AssertionError, KeyError) as e:
            raise ValueError(f"config for {task}: {type(e).__name__}: {e}") from None
        self._datasets[key] = dataset
        if len(self._datasets) > self._cache_size:
            self._datasets.popitem(last=False)
        return dataset

    # ------------------------------------------------------------------------- rows and entries

    def examples(self, n, seed=0):
        """n rows, deterministic given seed: a task by weight, then an index hashed from
        (seed, row), into range(size) where the config gives a size (BOUNDED tasks: a dataset seed
        hashed from (seed, task, chunk) and distinct indices in range(size))."""
        rng = random.Random(hash_int("tasks", seed))
        names = (rng.choices(self.names, weights=self.weights, k=n) if len(self.names) > 1
                 else self.names * n)
        counts, draws, rows = {}, {}, []
        for i, task in enumerate(names):
            config = self.configs[task]
            base = config.get("seed", 0)
            if task in BOUNDED:
                k = counts[task] = counts.get(task, -1) + 1
                size, chunk = self.sizes[task], k // self.sizes[task]
                if (task, chunk) not in draws:
                    need = min(size, names.count(task) - chunk * size)
                    draws[task, chunk] = random.Random(
                        hash_int("indices", base, seed, task, chunk)).sample(range(size), need)
                dataset_seed, index = (hash_int("bounded", base, seed, task, chunk) % 2**31,
                                       draws[task, chunk][k % size])
            elif "size" in config:  # the user's fixed pool: entries 0..size-1 of the config's seed
                dataset_seed, index = base, hash_int("index", seed, i) % self.sizes[task]
            else:
                dataset_seed, index = base, hash_int("index", seed, i) % 2**31
            rows.append({"seed": hash_int("seed", seed, i) % 2**31, "task": task,
                         "dataset_seed": dataset_seed, "index": index,
                         "config": json.loads(json.dumps(config))})  # each row its own copy
        return rows

    def entry(self, row):
        """The library's entry of a row (question, answer, metadata), regenerated."""
        dataset = self._dataset(row["task"], row["dataset_seed"], row["config"])
        with quiet():
            return dataset[row["index"]]

    def _probe(self, task):
        """Why the task's scorer is broken (junk gets full marks on most probe entries), or None."""
        rows = self.examples_of(task, PROBE_ENTRIES, seed="probe")
        entries = [self.entry(row) for row in rows]
        for junk in JUNK:
            fair = [(row, e) for row, e in zip(rows, entries)
                    if not _same_answer(junk, e["answer"])]
            full = sum(self.score(row, e, junk) >= 1.0 for row, e in fair)
            if full >= PROBE_FULL:
                return f"the junk answer {junk!r} gets full marks on {full} of {len(fair)} entries"
        return None

    def examples_of(self, task, n, seed):
        """Rows of one task of the mix (the probe's)."""
        saved = self.names, self.weights
        self.names, self.weights = [task], [1.0]
        try:
            return self.examples(n, seed)
        finally:
            self.names, self.weights = saved

    def score(self, row, entry, answer):
        """The library's score of `answer`, clamped to [0, 1]; 0 if none, overlong or raising."""
        if not answer or len(answer) > max(MAX_ANSWER, 4 * len(str(entry.get("answer")))):
            return 0.0
        if row["task"] in ARITHMETIC_ANSWERS and (not ARITHMETIC.fullmatch(answer)
                                                  or "**" in answer.replace(" ", "")):
            return 0.0
        dataset = self._dataset(row["task"], row["dataset_seed"], row["config"])
        try:
            with quiet():
                value = float(dataset.score_answer(answer, entry))
        except Exception:
            return 0.0
        return min(max(value, 0.0), 1.0) if math.isfinite(value) else 0.0

    # ------------------------------------------------------------------------- the episode

    def reset(self, example):
        row = {k: example[k] for k in ("seed", "task", "dataset_seed", "index", "config")}
        entry = self.entry(row)
        state = {"row": row, "task": row["task"], "entry": entry, "reference": entry.get("answer"),
                 "answer": None, "score": 0.0, "format": 0.0, "done": False}
        return state, entry["question"]

    def step(self, state, reply):
        reply = reply if isinstance(reply, str) else ""  # untrusted: a non-string is no answer
        state["answer"], state["format"], state["done"] = (
            parse_answer(reply), float(well_formed(reply)), True)
        state["score"] = self.score(state["row"], state["entry"], state["answer"])
        return None

    def rewards(self, state):
        return {"score": state["score"], "format": state["format"]}

    def metrics(self, state):
        return {"solved": float(state["score"] >= 1.0), "format": state["format"],
                "score": state["score"]}

    scripted_players = ("oracle", "blank")

    def scripted_player(self, name):
        """oracle: the reference answer, well-formed (an SFT teacher where the reference scores 1);
        blank: an empty answer (the floor)."""
        if name == "oracle":
            return lambda state: (
                f"<answer>{'' if state['reference'] is None else state['reference']}</answer>")
        if name == "blank":
            return lambda state: "<answer></answer>"
        raise ValueError(f"unknown scripted player {name!r} for reasoning_gym: "
                         "use 'oracle' or 'blank'")

    def describe(self, state):
        return (f"task: {state['task']} (index {state['row']['index']})\n"
                f"reference: {state['reference']}\nanswer: {state['answer']}\n"
                f"score: {state['score']:g}")


def load_environment(task=None, tasks=None, config=None, allow_broken_scorer=False,
                     allow_unsafe_scorer=False, allow_unreproducible=False, timeout=30.0):
    """task: one reasoning-gym dataset name, or tasks: {name: weight}; config: its settings (a mix:
    {name: settings}); allow_*: use a task refused by default (a broken scorer, an unsafe one,
    entries that change with PYTHONHASHSEED); timeout: seconds a call (a reply's scoring) may take
    before its episode scores 0 with metric `timeout` (guard.py: the library runs in a worker)."""
    kwargs = {"task": task, "tasks": tasks, "config": config,
              "allow_broken_scorer": allow_broken_scorer,
              "allow_unsafe_scorer": allow_unsafe_scorer,
              "allow_unreproducible": allow_unreproducible}
    return Guarded("env_reasoning_gym:ReasoningGym", kwargs, timeout=timeout)
