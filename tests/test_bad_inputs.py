"""Bad command lines, as a hostile user would type them, against the three scripts: each must
stop with a clean message that names what to change (no traceback, no silent acceptance), before
any work and without touching the output directory of an earlier run.

The numeric flags are read from the scripts' own parsers, so a flag added later is checked without
an edit here: each gets -1, NaN, inf and 0, and must refuse each of them unless ACCEPTED says why
it takes that value. Then broken environments, bad --env_args for both environments, bad devices,
unwritable outputs, bad models and the cross-flag rules. A full disk in the middle of a run is
simulated by a write that fails with ENOSPC.
"""
import argparse
import errno
import importlib
import os
import shutil
import sys

import pytest

import common

SCRIPTS = ["rl", "sft", "eval"]


class _Parser(Exception):
    """Raised in place of parse_args(): hands back the parser a script built, nothing checked."""


def script_parser(script):
    """SCRIPT's argparse parser, caught as its parse_args() (eval: its main()) reaches the command
    line. The flags come from the script itself: one added later is checked too."""
    module = importlib.import_module(script)

    def caught(parser, *a, **kw):
        raise _Parser(parser)
    real, argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_args, caught
    try:
        (module.parse_args if hasattr(module, "parse_args") else module.main)()
    except _Parser as e:
        return e.args[0]
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError(f"{script}.py built no argparse parser: its flags cannot be read")


def numeric_flags(script):
    """{flag: int or float} of SCRIPT's numeric options, each by its longest name (-r/--rollouts:
    --rollouts, the name check_flags' message gives)."""
    return {max(a.option_strings, key=len): a.type for a in script_parser(script)._actions
            if a.type in (int, float)}


NUMERIC = {script: numeric_flags(script) for script in SCRIPTS}
# what a hostile or careless user types: negative, not a number, infinite, 0
BAD_VALUES = ["-1", "nan", "inf", "0"]
# the values of BAD_VALUES a flag takes on purpose, and why; it must refuse the others
SEED = {"0": "the default seed"}
RUN = {"--warmup": {"0": "no warm-up"}, "--eval_every": {"0": "evaluate only at the end"},
       "--save_every": {"0": "checkpoint only at the end"}, "--seed": SEED}
ACCEPTED = {
    "rl": {**RUN, "--steps": {"0": "no step: the loaded model is evaluated and saved"},
           "--eps_low": {"0": "a lower clip at ratio 1"},
           "--eps_high": {"0": "an upper clip at ratio 1"},
           "--beta": {"0": "no KL penalty (no reference model loaded)"},
           "--minibatch": {"0": "the whole batch in one optimizer step"},
           "--exploit": {"0": "off"}, "--dynamic_sampling": {"0": "off"},
           "--tis_cap": {"0": "off"}},
    "sft": {**RUN, "--teacher_temp": {"0": "a greedy teacher"},
            "--max_steps": {"0": "the steps come from --epochs"},
            "--context_loss": {"0": "the loss on assistant tokens only, the usual SFT"}},
    "eval": {"--seed": SEED, "--temp": {"0": "greedy"}, "--show": {"0": "print no transcript"}},
}
NUMERIC_CASES = [(script, flag, value) for script, flags in NUMERIC.items() for flag in flags
                 for value in BAD_VALUES if value not in ACCEPTED[script].get(flag, {})]
ACCEPTED_CASES = [(script, flag, value) for script, flags in ACCEPTED.items()
                  for flag, values in flags.items() for value in values]
ENV_FILES = {  # env_NAME.py: its source, and the message
    "syntax": ("def load_environment(:\n", "env_syntax.py failed to import: SyntaxError"),
    "raises": ("raise RuntimeError('boom')\n", "env_raises.py failed to import: RuntimeError: boom"),
    "imports": ("import not_a_package_here\n", "imports 'not_a_package_here', which is not installed"),
    "nofn": ("X = 1\n", "env_nofn.py has no load_environment() function"),
    "initfails": ("def load_environment(**kw):\n    raise ValueError('bad option')\n", "bad --env_args for initfails: bad option"),
}
ENV_ARGS = [  # (--env, --env_args, message)
    ("tictactoe", "{bad json", "--env_args is not valid JSON"),
    ("tictactoe", "[1, 2]", "--env_args must be a JSON object"),
    ("tictactoe", '{"nope": 1}', "unexpected keyword argument 'nope'"),
    ("tictactoe", '{"max_turns": true}', "max_turns=True: must be a positive integer"),
    ("tictactoe", '{"max_turns": 0}', "max_turns=0: must be a positive integer"),
    ("tictactoe", '{"min_random_move_prob": 2}', "min_random_move_prob=2: must be a probability in [0, 1]"),
    ("tictactoe", '{"max_random_move_prob": NaN}', "max_random_move_prob=nan: must be a probability in [0, 1]"),
    ("tictactoe", '{"show_cells": 1}', "show_cells=1: must be true or false"),
    ("tictactoe", '{"invalid_penalty": -1}', "invalid_penalty=-1: must be a number >= 0"),
    ("tictactoe", '{"puzzles": 0.5}', "puzzles is an option of tictactoe_lab (env_tictactoe_lab.py): --env tictactoe_lab"),
    ("tictactoe_lab", '{"loss_penalty": -1}', "loss_penalty=-1: must be a number >= 0"),
    ("tictactoe_lab", '{"optimal_reward": "high"}', "optimal_reward='high': must be a number >= 0"),
    ("reverse", '{"min_words": true}', "min_words=True, max_words=12: need integers"),
    ("reverse", '{"min_words": 0}', "min_words=0, max_words=12: need integers with 1 <= min_words"),
    ("reverse", '{"max_words": "x"}', "max_words='x': need integers"),
    ("reverse", '{"min_words": 5, "max_words": 2}', "min_words=5, max_words=2"),
    ("reverse", '{"data_path": "/no/such/file.txt"}', "data_path='/no/such/file.txt' does not exist"),
    ("reverse", '{"data_path": 5}', "data_path=5: must be the path of a .txt or .jsonl file"),
]


def cases():
    """(script, argv, what its message must say: a string, or a tuple of strings)"""
    for script in SCRIPTS:  # the numeric flags: test_numeric_flag_refuses_a_bad_value
        yield script, ["--env", "nope"], "no environment 'nope': write env_nope.py"
        for name, (_, message) in ENV_FILES.items():
            yield script, ["--env", name], message
        for env, env_args, message in ENV_ARGS:
            yield script, ["--env", env, "--env_args", env_args], message
        yield script, ["--device", "nonsense"], "--device nonsense: must be auto, cpu, cuda or cuda:N"
        for out in ["{file}/sub", "/proc/no_such_dir/sub"]:
            yield script, ["--out", out], "must be a directory you can write"
    for script in ["rl", "sft", "eval"]:
        yield script, ["--model", "{tmp}/no_such_model"], "could not load model"
        yield script, ["--model", "{corrupt}"], "could not load model"
        yield script, ["--model", "{file}"], "could not load model"
    yield "eval", ["--model", "random", "--env", "reverse"], "this environment's scripted players: oracle"
    yield "sft", ["--teacher", "minimax", "--env", "reverse"], "this environment's scripted players: oracle"
    yield "sft", ["--keep", "reward>=abc"], "--keep reward>=abc: must be all, reward>=X or METRIC=VALUE,..."
    yield "sft", ["--keep", "best"], "--keep best: must be"
    yield "sft", ["--keep", "reward>=nan"], "--keep reward>=nan: must be"
    yield "sft", ["--keep", "=1"], "--keep =1: must be"
    yield "sft", ["--d_model", "30", "--n_heads", "4"], "--d_model 30: must be a positive multiple of --n_heads 4"
    yield "sft", ["--data", "{tmp}/no_such.jsonl"], "does not exist"
    yield "sft", ["--data", "{binary}"], "{binary}' is not UTF-8 text (byte 128)"
    for script in ["rl", "sft", "eval"]:  # a run directory that is not there yet: no hub lookup at all
        yield script, ["--model", "out/no_such_run"], "could not load model 'out/no_such_run': there is no such directory"
    yield "rl", ["--batch", "6", "--group", "4"], "--batch 6: must be a positive multiple of --group 4"
    yield "rl", ["--group", "1"], "--group 1: must be >= 2"
    yield "rl", ["--env", "reverse", "--exploit", "2"], "--exploit needs an environment with an exploit(policy) hook"
    yield "eval", ["--exploit", "--temp", "1"], "--exploit judges the greedy policy: use --temp 0"
    yield "eval", ["--exploit", "--env", "reverse", "--model", "oracle"], "--exploit needs an environment with an exploit(policy, out) hook"
    yield "eval", ["--setting", "optimal", "--env", "reverse", "--model", "oracle"], "--setting optimal: reverse names the settings default"


CASES = list(cases())
# the rest of a command line: small settings, so a bad value that slipped through would show up as a finished run
BASE = {"rl": ["--model", "{model}", "--batch", "4", "--group", "2", "--steps", "1", "--eval_n", "1",
               "--max_new_tokens", "8", "--device", "cpu", "--out", "{out}"],
        "sft": ["--vocab_size", "300", "--d_model", "16", "--n_layers", "1", "--n_heads", "1", "--n_games", "8",
                "--max_steps", "1", "--eval_n", "1", "--device", "cpu", "--out", "{out}"],
        "eval": ["--model", "random", "-n", "2", "--out", "{out}"]}


@pytest.fixture(scope="module")
def places(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_inputs")
    (tmp / "a_file").write_text("x")
    (tmp / "binary.jsonl").write_bytes(bytes(range(256)))
    shutil.copytree(tiny_model_dir, tmp / "corrupt")
    (tmp / "corrupt" / "model.safetensors").write_bytes(b"not a safetensors file")
    envs = tmp / "envs"
    envs.mkdir()
    for name, (source, _) in ENV_FILES.items():
        (envs / f"env_{name}.py").write_text(source)
    return {"tmp": str(tmp), "file": str(tmp / "a_file"), "binary": str(tmp / "binary.jsonl"), "corrupt": str(tmp / "corrupt"), "model": tiny_model_dir,
            "envs": str(envs)}


def filled(text, places):
    """TEXT with each {name} of places replaced by its path (str.format would choke on the JSON in --env_args)."""
    for name, path in places.items():
        text = text.replace("{" + name + "}", path)
    return text


def run_script(script, argv, monkeypatch):
    """Run SCRIPT's main() with argv as its command line, in this process."""
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    importlib.import_module(script).main()


@pytest.mark.parametrize("script, argv, message", CASES, ids=[f"{s} {' '.join(a)}" for s, a, _ in CASES])
def test_bad_command_line_stops_cleanly_before_touching_out(script, argv, message, places, tmp_path, monkeypatch, capsys):
    out = tmp_path / "earlier_run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    fill = {**places, "out": str(out)}
    monkeypatch.syspath_prepend(places["envs"])
    for name in ENV_FILES:
        sys.modules.pop(f"env_{name}", None)
    with pytest.raises(SystemExit) as e:
        run_script(script, [filled(a, fill) for a in BASE[script] + argv], monkeypatch)
    said = str(e.value.code) if e.value.code != 2 else capsys.readouterr().err  # 2: argparse's own refusal
    assert e.value.code not in (0, None), said
    for part in (message,) if isinstance(message, str) else message:
        assert filled(part, fill) in said, said
    assert sorted(os.listdir(out)) == ["metrics.jsonl"] and (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


class Accepted(Exception):
    """The command line got past the script's flag checks."""


def stop_after_flag_checks(script, monkeypatch):
    """Have SCRIPT's main() raise Accepted once its flags are checked (rl, sft: parse_args() has
    returned; eval: its check_flags() call has), so that a value that slips through ends the test
    there instead of running the script: no model is loaded, nothing is written."""
    module = importlib.import_module(script)
    name = "parse_args" if hasattr(module, "parse_args") else "check_flags"
    checks = getattr(module, name)

    def then_stop(*a, **kw):
        checks(*a, **kw)
        raise Accepted
    monkeypatch.setattr(module, name, then_stop)


def refusal(script, argv, monkeypatch, capsys):
    """What SCRIPT's main() says as it refuses ARGV (argparse's own refusal: its stderr, from
    "usage:" on), or None where it accepts it."""
    stop_after_flag_checks(script, monkeypatch)
    try:
        run_script(script, argv, monkeypatch)
    except Accepted:
        return None
    except SystemExit as e:
        assert e.code not in (0, None), f"{script}.py {' '.join(argv)}: exit status {e.code}"
        return str(e.code) if e.code != 2 else capsys.readouterr().err  # 2: argparse's refusal
    raise AssertionError(f"{script}.py {' '.join(argv)}: main() returned before its flag checks")


def earlier_run(tmp_path):
    out = tmp_path / "earlier_run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    return out


@pytest.mark.parametrize("script, flag, value", NUMERIC_CASES,
                         ids=[" ".join(case) for case in NUMERIC_CASES])
def test_numeric_flag_refuses_a_bad_value(script, flag, value, tmp_path, monkeypatch, capsys):
    out = earlier_run(tmp_path)
    said = refusal(script, ["--out", str(out), f"{flag}={value}"], monkeypatch, capsys)
    assert said is not None, (f"{script}.py {flag} {value} passed its flag checks: validate "
                              f"{flag} in {script}.py, or add the value to ACCEPTED[{script!r}] "
                              "with the reason it is valid")
    if said.startswith("usage:"):  # argparse: "argument -r/--rollouts: invalid int value: 'nan'"
        kind = NUMERIC[script][flag].__name__
        assert "argument " in said and flag in said, said
        assert f"invalid {kind} value: '{value}'" in said, said
    else:  # check_flags: "--lr nan: must be a finite number > 0" (a float prints as -1.0, 0.0)
        assert f"{flag} {value}" in said and ": must be " in said, said
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("script, flag, value", ACCEPTED_CASES,
                         ids=[" ".join(case) for case in ACCEPTED_CASES])
def test_accepted_bad_values_are_accepted(script, flag, value, tmp_path, monkeypatch, capsys):
    """Each entry of ACCEPTED names a numeric flag of its script and a value the flag takes: an
    entry whose flag is gone, or whose value is now refused (validated since), must leave the
    table, where it would only hide a check."""
    assert flag in NUMERIC[script], f"ACCEPTED[{script!r}]: {flag} is no numeric flag of {script}"
    assert value in BAD_VALUES, f"ACCEPTED[{script!r}][{flag!r}]: {value} is never tried"
    said = refusal(script, ["--out", str(earlier_run(tmp_path)), f"{flag}={value}"], monkeypatch,
                   capsys)
    assert said is None, f"{script}.py refuses {flag} {value} ({said}): drop it from ACCEPTED"


def test_the_numeric_flags_are_found():
    """The parsers are read at all: flags each script has always had, each with its type."""
    rl_flags = {"--batch": int, "--lr": float, "--eps_high": float, "--seed": int}
    assert rl_flags.items() <= NUMERIC["rl"].items()
    assert {"--n_games": int, "--epochs": float}.items() <= NUMERIC["sft"].items()
    assert {"-n": int, "--rollouts": int, "--top_p": float}.items() <= NUMERIC["eval"].items()


def test_the_default_model_missing_fails_at_once_naming_the_command(monkeypatch, tmp_path):
    """A fresh clone has no out/sft, rl.py's default --model: one line that says which command makes it, without
    asking the hub first (which retried for about 40 s)."""
    import transformers

    def no_hub(*a, **kw):
        raise AssertionError("the hub was asked for a local directory")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        run_script("rl", ["--device", "cpu", "--out", str(tmp_path / "rl")], monkeypatch)
    assert "could not load model 'out/sft': there is no such directory. Make it with `python sft.py`" in str(e.value.code)


def test_good_values_pass(monkeypatch):
    import rl
    rl.parse_args(["--device", "cuda:1", "--eps_high", "0.28", "--temp", "1.1", "--steps", "0"])


def test_full_disk_in_eval_keeps_finished_rows_and_says_what_to_do(monkeypatch, tmp_path):
    """The disk fills up after 3 rows: eval.py stops with one line, the finished rows stay, --resume finishes."""
    import eval as eval_mod
    real_open, written = open, []

    class FillingFile:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            if len(written) == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            written.append(text)
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def filling_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return FillingFile(f) if str(path).endswith("rollouts.jsonl") and mode in ("w", "a") else f
    monkeypatch.setattr(eval_mod, "open", filling_open, raising=False)
    argv = ["--model", "random", "-n", "8", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit, match=r"No space left on device\. The finished rows in --out's rollouts.jsonl are kept"):
        with common.disk_full_says_what_is_kept("The finished rows in --out's rollouts.jsonl are kept: free space, then "
                                                "rerun with --resume."):
            run_script("eval", argv, monkeypatch)
    assert len((tmp_path / "o" / "rollouts.jsonl").read_text().splitlines()) == 3
    monkeypatch.setattr(eval_mod, "open", real_open, raising=False)
    run_script("eval", argv + ["--resume"], monkeypatch)
    rows = (tmp_path / "o" / "rollouts.jsonl").read_text().splitlines()
    assert len(rows) == 8 and rows[:3] == [w.rstrip("\n") for w in written]


def test_other_os_errors_are_not_disguised_as_a_full_disk():
    with pytest.raises(PermissionError):
        with common.disk_full_says_what_is_kept("kept"):
            raise PermissionError(errno.EACCES, "Permission denied")
