"""The Python API end to end: your model objects, your dataset, your reward function, a callback (~15 s on 2 CPUs).

    python examples/python_api.py [--out runs/python_api] [--steps 30] [--target 0.45]

What it does, top to bottom:
1. builds the config in code (``load_config(base=...)``: the same checks as a YAML file, one-line errors);
2. loads the student and the teacher as transformers objects you would load yourself (here the packaged demo pair,
   so nothing is downloaded; any ``AutoModelForCausalLM`` pair sharing a tokenizer works the same way);
3. makes a dataset from Python rows (``DatasetTask.from_rows``: a list of dicts or a ``datasets.Dataset``);
4. adds a reward function of its own (TRL's ``reward_funcs`` signature) beside the task's verifier;
5. trains on-policy with a callback that prints each step and stops the run once the student is good enough;
6. reads the metrics back: the returned summary, and the run folder's metrics.jsonl.

docs/python_api.md explains each piece; tests/test_python_api.py runs this script in CI.
"""
import argparse
import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opdistill.data import DatasetTask
from opdistill.models import resolve_model_path
from opdistill.train import load_config, run_training


def make_rows(n: int, seed: int, *, held_out: bool) -> list[dict]:
    """Your dataset: four-digit additions as the demo models read them ("1234+3456=" -> "4690"); the held-out rows
    are the pairs whose first number is a multiple of 5, the training rows the others (no prompt in both)."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        if (a % 5 == 0) == held_out:
            rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def brevity(completions, **kwargs) -> list[float]:
    """Your reward: 1 for a response of at most 40 characters, falling linearly to 0 at 64 (called once per step
    with the step's rows; any of prompts, completions, answer, step may be named, or taken as **kwargs)."""
    return [max(0.0, min(1.0, (64 - len(c)) / 24)) for c in completions]


class StopWhenGood:
    """A callback: called after every logged step with its metrics; returning True stops the run after that step
    (its checkpoint written, as a first Ctrl-C does)."""

    def __init__(self, target: float):
        self.target, self.seen = target, []

    def __call__(self, step: int, metrics: dict) -> bool:
        self.seen.append(step)
        line = f"step {step:3d}  loss {metrics.get('distillation/loss', float('nan')):.4f}  " \
               f"reward {metrics['train/reward']:.3f}  task {metrics['reward/task']:.3f}  " \
               f"brevity {metrics['reward/brevity']:.3f}"
        if "eval/greedy_acc" in metrics:
            line += f"  held-out greedy acc {metrics['eval/greedy_acc']:.3f}"
        print(line, flush=True)
        return "eval/greedy_acc" in metrics and metrics["eval/greedy_acc"] >= self.target  # evaluation steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/python_api", help="the run folder (replaced if it exists)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--target", type=float, default=0.45, help="the callback stops the run once the held-out greedy "
                    "accuracy reaches this (the start is about 0.27)")
    args = ap.parse_args()

    # 1. the config in code: only what differs from the defaults (docs/trainer.md lists every key)
    cfg = load_config(base={
        "run_dir": args.out,
        "model": {"student": "builtin:demo-student", "teacher": "builtin:demo-teacher"},  # recorded; objects below
        "data": {"prompts_per_step": 8, "answer_match": "math"},
        "rollout": {"n": 4, "max_new_tokens": 64},
        "loss": {"loss_mode": "topk", "topk": 8, "support": "tail", "divergence": "forward"},
        "optim": {"lr": 3e-4, "schedule": "constant"},
        "train": {"steps": args.steps, "threads": 1},
        "eval": {"every": 4, "num_prompts": 64, "bootstrap_resamples": 200},
        "log": {"tensorboard": False, "progress": False},
    })

    # 2. your model objects (a tokenizer, a student to train, a frozen teacher)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:demo-student"))
    # float32 (the packaged weights are stored in float16, which training refuses: no loss scaling)
    student = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:demo-student"), dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:demo-teacher"), dtype=torch.float32)
    teacher.requires_grad_(False)

    # 3. your dataset: training rows and held-out rows, checked as a file's rows are
    task = DatasetTask.from_rows(make_rows(2000, seed=0, held_out=False), answer_field="answer",
                                 eval_rows=make_rows(200, seed=1, held_out=True))

    # 4 + 5. train: the task's verifier and your reward (both logged as reward/<name>), the callback each step
    stop = StopWhenGood(args.target)
    summary = run_training(cfg, models=(tok, student, teacher), task=task, rewards=["task", brevity],
                           callbacks=[stop], overwrite=True)

    # 6. the metrics back
    first, last = summary["eval_history"][0], summary["final_eval"]
    print(f"\nheld-out greedy accuracy: {first['eval/greedy_acc']:.3f} at step {first['step']} -> "
          f"{last['eval/greedy_acc']:.3f} at step {last['step']} "
          f"(95% interval {last['eval/greedy_acc_lo']:.3f}-{last['eval/greedy_acc_hi']:.3f})")
    print(f"stopped by: {summary['stopped'] or 'the step budget'}; checkpoint: {summary['checkpoint']}")
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    print(f"metrics.jsonl: {len(lines)} lines; the callback saw steps {stop.seen}")


if __name__ == "__main__":
    main()
