"""Preemption: SIGTERM (a cluster taking the job back) or Ctrl-C mid-run. rl.py and sft.py finish
the step in flight, save it and exit 143 with the --resume command; resumed, the run goes on
exactly as if never stopped. A second signal stops at once with the last complete checkpoint
intact. eval.py keeps its finished rows and says so."""
import json
import os
import signal

import pytest
import torch

from conftest import run_main
from test_rl import DIGITS_ENV, run_rl, train_lines
from test_sft import SMALL


def signal_at(monkeypatch, module, name, calls, times=1):
    """Send this process SIGTERM `times` times inside the calls-th call of module.name."""
    real, count = getattr(module, name), [0]

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] == calls:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapped)


@pytest.fixture(scope="module")
def rl_reference(tiny_model_dir, tmp_path_factory):
    """The 4-step run never stopped, and the directory of its environment file."""
    env_dir = tmp_path_factory.mktemp("digits")
    (env_dir / "env_digits.py").write_text(DIGITS_ENV)
    run_rl(tiny_model_dir, str(env_dir / "a"), 4, env_dir=str(env_dir))
    return train_lines(str(env_dir / "a")), str(env_dir)


def test_rl_sigterm_saves_the_step_in_flight_and_resumes_exactly(tiny_model_dir, rl_reference,
                                                                 tmp_path, monkeypatch, capsys):
    import rl
    rows, env_dir = rl_reference
    b = str(tmp_path / "b")
    with monkeypatch.context() as m:
        signal_at(m, rl, "update", 3)  # during step 3, which --save_every 2 would not save
        with pytest.raises(SystemExit) as stopped:
            run_rl(tiny_model_dir, b, 4, env_dir=env_dir)
    assert stopped.value.code == 128 + signal.SIGTERM
    said = capsys.readouterr().out
    assert f"stopped by SIGTERM: the checkpoint of step 3 is in {b}; go on with: python rl.py" in said
    assert torch.load(os.path.join(b, "trainer_state.pt"), weights_only=False)["step"] == 3
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers are put back
    run_rl(tiny_model_dir, b, 4, ["--resume"], env_dir=env_dir)
    assert train_lines(b) == rows


def test_rl_second_sigterm_stops_at_once_and_keeps_the_last_checkpoint(tiny_model_dir, rl_reference,
                                                                       tmp_path, monkeypatch):
    import rl
    rows, env_dir = rl_reference
    b = str(tmp_path / "b")
    with monkeypatch.context() as m:
        signal_at(m, rl, "update", 3, times=2)
        with pytest.raises(KeyboardInterrupt):
            run_rl(tiny_model_dir, b, 4, env_dir=env_dir)
    assert torch.load(os.path.join(b, "trainer_state.pt"), weights_only=False)["step"] == 2
    run_rl(tiny_model_dir, b, 4, ["--resume"], env_dir=env_dir)
    assert train_lines(b) == rows


def test_sft_sigterm_saves_the_step_in_flight_and_resumes_exactly(tmp_path, monkeypatch):
    import sft
    from safetensors.torch import load_file
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    flags = [*SMALL, "--max_steps", "4", "--eval_every", "0", "--save_every", "0",
             "--schedule", "constant"]
    run_main("sft", [*flags, "--out", a])
    with monkeypatch.context() as m:
        signal_at(m, sft, "sft_loss", 2)  # the second step's loss (one micro-batch a step)
        with pytest.raises(SystemExit) as stopped:
            run_main("sft", [*flags, "--out", b])
    assert stopped.value.code == 128 + signal.SIGTERM
    assert torch.load(os.path.join(b, "trainer_state.pt"), weights_only=False)["step"] == 2
    run_main("sft", [*flags, "--out", b, "--resume"])
    wa, wb = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # the same schedule: exact


def test_eval_sigterm_keeps_the_finished_rows(tmp_path, monkeypatch, capsys):
    import eval as eval_mod
    import sample
    out = str(tmp_path / "e")
    argv = ["--model", "minimax", "--setting", "optimal", "-n", "40", "--out", out]
    with monkeypatch.context() as m:
        signal_at(m, sample, "finish", 25)
        m.setattr(eval_mod, "rollout", sample.rollout)
        with pytest.raises(SystemExit) as stopped:
            run_main("eval", argv)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert f"the finished episodes are in {out}/rollouts.jsonl" in capsys.readouterr().out
    kept = open(os.path.join(out, "rollouts.jsonl")).read().splitlines()
    assert 0 < len(kept) < 40 and all(json.loads(line)["messages"] for line in kept)
    run_main("eval", [*argv, "--resume"])
    assert json.load(open(os.path.join(out, "summary.json")))["n"] == 40
