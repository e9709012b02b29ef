"""
The step time of rl.py next to TRL's GRPOTrainer on the same model, prompts and lengths (CPU or GPU).

    pip install trl                       # only for this comparison; the project never imports it
    python bench_trl.py                   # reverse-text, --batch 64 --group 8 --max_new_tokens 32, 8 steps each

Both sides: the same save_pretrained model (by default the 1.1M-parameter scratch Llama of `sft.py --model scratch`
after --sft_steps steps on the oracle, so that its rewards vary and every step has advantages to train on), the
reverse environment's prompts (system + user message, the
chat template), 8 prompts x 8 completions per step, up to 32 new tokens at temperature 1, one optimizer step per
batch, no KL term, no evaluation or checkpoint inside the timed steps. TRL samples with transformers' generate(),
rl.py with its own engine (sample.py). Reported: the median step time of each after its first step.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def build_model(out, sft_steps):
    """The scratch model after a short SFT on the reverse oracle (sft.py, offline)."""
    subprocess.run([sys.executable, os.path.join(HERE, "sft.py"), "--model", "scratch", "--env", "reverse", "--teacher", "oracle",
                    "--n_games", "2000", "--max_steps", str(sft_steps), "--eval_every", "0", "--eval_n", "1", "--out", out],
                   check=True, stdout=subprocess.DEVNULL)


def time_rl(model, args, out):
    """Median step_time of rl.py's own log (metrics.jsonl), steps 2 on."""
    cmd = [sys.executable, os.path.join(HERE, "rl.py"), "--env", "reverse", "--model", model, "--batch", str(args.batch),
           "--group", str(args.group), "--max_new_tokens", str(args.max_new_tokens), "--steps", str(args.steps),
           "--temp", "1.0", "--lr", "1e-6", "--eval_every", "0", "--eval_n", "1", "--save_every", "0", "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r["step_time"] for r in rows if "step_time" in r][1:]


def time_trl(model, args, out):
    """Median time of GRPOTrainer's training steps (a callback's clock), steps 2 on."""
    try:
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        raise SystemExit("this comparison needs TRL: pip install trl")
    sys.path.insert(0, HERE)
    from common import load_env
    from env_reverse import parse_answer, similarity
    env = load_env("reverse")
    examples = env.examples(args.batch // args.group * args.steps, seed=0)
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": env.system_prompt},
                                          {"role": "user", "content": env.reset(ex)[1]}], "text": ex["text"]}
                              for ex in examples])

    def reward(completions, text, **kwargs):
        return [similarity(parse_answer(c[0]["content"]), t[::-1]) for c, t in zip(completions, text)]

    class Clock(TrainerCallback):
        times = []

        def on_step_begin(self, *a, **kw):
            self.t0 = time.time()

        def on_step_end(self, *a, **kw):
            self.times.append(time.time() - self.t0)

    config = GRPOConfig(output_dir=out, per_device_train_batch_size=args.batch, num_generations=args.group,
                        max_completion_length=args.max_new_tokens, temperature=1.0, learning_rate=1e-6, beta=0.0,
                        num_iterations=1, max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none",
                        use_cpu=args.device == "cpu", bf16=args.device != "cpu", shuffle_dataset=False, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Clock()])
    trainer.train()
    return Clock.times[1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="save_pretrained directory (default: a scratch model built offline)")
    p.add_argument("--batch", type=int, default=64, help="completions per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--max_new_tokens", type=int, default=32, help="max new tokens per completion")
    p.add_argument("--steps", type=int, default=8, help="steps per trainer (the first is not counted)")
    p.add_argument("--sft_steps", type=int, default=200, help="SFT steps of the default model on the oracle")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both trainers)")
    p.add_argument("--side", choices=["both", "rl", "trl"], default="both", help="which trainer(s) to time")
    args = p.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or os.path.join(tmp, "model")
        if not args.model:
            build_model(model, args.sft_steps)
        times = {}
        if args.side in ("both", "rl"):
            times["rl.py"] = time_rl(model, args, os.path.join(tmp, "rl"))
        if args.side in ("both", "trl"):
            times["TRL GRPOTrainer"] = time_trl(model, args, os.path.join(tmp, "trl"))
    for name, t in times.items():
        print(f"{name}: median step {statistics.median(t):.2f}s over {len(t)} steps ({', '.join(f'{x:.2f}' for x in t)})")
    if len(times) == 2:
        a, b = (statistics.median(t) for t in times.values())
        print(f"rl.py / TRL step time: {a / b:.2f}x")
    print(json.dumps({"args": vars(args), "step_times": times}))


if __name__ == "__main__":
    main()
