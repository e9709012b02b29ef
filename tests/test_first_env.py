"""The README's "Your first environment": the file in docs/FIRST_ENV.md, written out under a new
name with no core file changed, runs eval.py with its scripted player, gets a tiny model from
sft.py --model scratch, and trains with rl.py with a gradient. The doc's file is env_add.py."""
import json
import os
import re

from conftest import ROOT, run_main


def doc_code():
    text = (ROOT / "docs" / "FIRST_ENV.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_walk_through_file_is_env_add():
    assert doc_code() == (ROOT / "env_add.py").read_text()


def test_an_environment_written_from_the_docs_runs_every_script(tmp_path):
    (tmp_path / "env_mine.py").write_text(doc_code())
    env_dir, out = str(tmp_path), str(tmp_path / "runs")
    printed = run_main("eval", ["--env", "mine", "--model", "oracle", "-n", "20"], env_dir)
    assert re.search(r"reward_correct\s+1\b", printed)
    run_main("sft", ["--model", "scratch", "--env", "mine", "--n_games", "200", "--vocab_size", "300",
                     "--d_model", "32", "--n_layers", "2", "--n_heads", "2", "--max_steps", "200",
                     "--lr", "5e-3", "--eval_every", "0", "--eval_n", "4", "--device", "cpu",
                     "--out", out + "/sft"], env_dir)
    run_main("rl", ["--model", out + "/sft", "--env", "mine", "--batch", "16", "--group", "8",
                    "--steps", "2", "--max_new_tokens", "12", "--eval_every", "0", "--eval_n", "4",
                    "--device", "cpu", "--out", out + "/rl"], env_dir)
    rows = [json.loads(line) for line in open(os.path.join(out, "rl", "metrics.jsonl"))]
    assert any(r.get("grad_norm", 0) > 0 for r in rows)


def test_every_environment_keeps_the_contracts_types():
    """The members the scripts read have the README's types: `tools` is None or a list of function
    schemas (the chat template iterates it), scripted players are named, max_turns is a count."""
    import common
    for name in ("add", "calc", "doublecheck", "reverse", "tictactoe", "tictactoe_lab"):
        env = common.load_env(name)
        tools = getattr(env, "tools", None)
        assert tools is None or all(isinstance(t, dict) for t in tools), name
        assert isinstance(env.max_turns, int) and env.max_turns >= 1, name
        assert isinstance(env.system_prompt, str) and env.system_prompt, name
        players = getattr(env, "scripted_players", ())
        assert all(isinstance(p, str) for p in players), name
        for p in players:
            assert callable(env.scripted_player(p)), (name, p)
