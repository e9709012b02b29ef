"""A shortened speedrun (QUICK=1): the whole pipeline scratch -> SFT -> RL -> eval + certificate -> report."""
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_speedrun(tmp_path):
    out = str(tmp_path / "run")
    env = {**os.environ, "QUICK": "1", "OUT": out, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["bash", "speedrun.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.load(open(os.path.join(out, "results.json")))
    for who in ("teacher", "sft", "rl"):
        for opp in ("optimal", "random"):
            s = results[who][opp]
            assert s["n"] == 8 and abs(s["win_rate"] + s["draw_rate"] + s["loss_rate"] - 1) < 1e-9
        cert = results[who]["certificate"]
        assert cert["lines"] == cert["lines_won"] + cert["lines_drawn"] + cert["lines_lost"] > 0
    assert results["teacher"]["certificate"]["lines_lost"] > 0  # the imperfect teacher loses some line
    report = open(os.path.join(out, "report.md")).read()
    assert "| RL model (step " in report and "Certificate" in report and "| mistaken decisions |" in report
    assert os.path.exists(os.path.join(out, "rl", "model.safetensors"))
    # the RL model evaluated is the exploiter's best certificate (2 RL steps, --exploit 5: certificates at steps 0 and 2)
    best = json.load(open(os.path.join(out, "rl_best", "certificate.json")))
    assert results["rl_step"] == best["step"] in (0, 2)
    assert results["rl"]["certificate"]["lines_lost"] == best["lines_lost"]
