"""Issue 33's learning experiments on real models, reasoning-gym tasks and their own verifiers.

    python scripts/self_distillation.py --task calendar --out runs/self_distill_calendar   # (a), ~2 h on 2 cores
    python scripts/self_distillation.py --task addition --out runs/self_distill_addition
    python scripts/self_distillation.py --task calendar --out runs/self_distill_calendar --report
    python scripts/self_distillation.py --task calendar --out runs/self_distill_calendar --diagnose
    python scripts/self_distillation.py --setup b --task calendar --out runs/gemma_teaches_smollm2   # (b)
    python scripts/self_distillation.py --setup c --task calendar --out runs/smollm2_teaches_gemma   # (c)

(b) and (c) run on-policy distillation only (two seeds, 16 steps) across tokenizers (byte-prefix marginalisation,
the teacher's top-64): Gemma-3-270M (the base model) under the same five worked examples teaching SmolLM2, and
SmolLM2 under them teaching Gemma (fused lm_head); each against its own untrained student and its teacher's own
accuracy under the context. The rest of these notes are (a)'s.

From configs/smollm2_self_distill.yaml (the student: SmolLM2-135M-Instruct, full fine-tuning; the context-teacher:
its own frozen starting weights with five worked examples of the task before the question), for each seed:

- ``opd``: on-policy self-distillation: the student samples, the context-teacher scores its tokens (top-32, tail
  forward KL);
- ``offpolicy``: the same loss on the context-teacher's own samples (it writes under its context; the student is
  trained to write them after the plain question): SFT on the teacher's samples with its distribution as soft
  labels;
- ``grpo``: RL from the task's 0/1 verifier (GRPO, 4 samples per prompt, no teacher);

and, evaluated once: the untrained student (``base``) and the untrained student decoding under the context
(``teacher``, ``eval.prompts: teacher``: the context-teacher's own accuracy). Every run evaluates the same held-out
problems (greedy and one sample each) at steps 8, 16 and 24 (addition: 16 steps, evaluated at 8 and 16); every change is paired over problems with its 95%
bootstrap interval (``opdistill compare --baseline``), and the share of the teacher's lead the student closes
carries its paired interval (``opdistill.runs.stats.paired_lift_ratio``). The runs go in two lanes (one torch thread
each): the comparison at equal steps does not depend on it; each method's CPU seconds per step are measured apart
(``--step-times``: one lane, each method's 3-step run three times, interleaved) for the equal-time reading.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CONFIG = "configs/smollm2_self_distill.yaml"
TASKS = {
    "calendar": "{name: calendar_arithmetic, size: 1000, seed: 0, eval_size: 400}",
    "addition": "{name: basic_arithmetic, size: 2000, seed: 0, eval_size: 400, min_terms: 2, max_terms: 2, "
                "min_digits: 1, max_digits: 2, operators: ['+'], allow_parentheses: false, allow_negation: false}",
    "spell": "{name: spell_backward, size: 2000, seed: 0, eval_size: 400}",
}
PROBLEMS = 150
EVERY = {"calendar": 8, "addition": 8, "spell": 8}  # steps between evaluations (each ~3-5 CPU minutes at one thread)
STEPS = {"calendar": 24, "addition": 16, "spell": 16}  # setup a's steps per task (b and c: 16)
METHODS = {
    "opd": [],
    "offpolicy": ["train.method=off_policy"],
    "grpo": ["train.method=rl", "model.teacher=null", "teacher.context=null", "rollout.n=4",
             "data.prompts_per_step=4"],
}
SEEDS = (0, 1)
XTOK = ["xtok.mode=bpm", "xtok.teacher_topk=64"]
# a: SmolLM2 from itself under five worked examples, against its baselines; b: Gemma-3-270M (the base model) under
# the same five worked examples teaching SmolLM2 across tokenizers; c: the reverse, SmolLM2 teaching Gemma
SETUPS = {
    "a": {"steps": None, "methods": ("opd", "offpolicy", "grpo"), "args": [],
          "teacher_eval": []},
    "b": {"steps": 16, "methods": ("opd",), "args": ["model.teacher=builtin:gemma3-270m", *XTOK],
          "teacher_eval": ["model.student=builtin:gemma3-270m"]},
    "c": {"steps": 16, "methods": ("opd",), "args": ["model.student=builtin:gemma3-270m", "model.teacher=builtin:smollm2",
                                                     *XTOK, "train.fused_lm_head=true"],
          "teacher_eval": ["model.student=builtin:smollm2", "model.teacher=self", "xtok.mode=off"]},
}


def _steps(setup: str, task: str) -> int:
    return STEPS[task] if setup == "a" else SETUPS[setup]["steps"]


def _common(setup: str, task: str) -> list[str]:
    return [f"train.steps={_steps(setup, task)}", f"eval.every={EVERY[task]}", f"eval.num_prompts={PROBLEMS}",
            "eval.at_start=false", "log.progress=false", "checkpoint.save_final=true", "checkpoint.keep_last=1",
            "train.threads=1", *SETUPS[setup]["args"]]


def _run(cmd: list[str], log: Path) -> None:
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    print(f"  {log.stem}: {'done' if rc == 0 else f'FAILED (exit {rc}, see {log})'} in {time.time() - t0:.0f} s",
          flush=True)
    if rc:
        raise SystemExit(rc)


def _task(task: str) -> list[str]:
    return [f"data.task_args={TASKS[task]}"]


def run_all(setup: str, task: str, out: Path, lanes: int, only: list[str] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    opd = [sys.executable, "-m", "opdistill"]
    su = SETUPS[setup]
    evals = [opd + ["eval", "--config", CONFIG, *_task(task), f"eval.num_prompts={PROBLEMS}", "train.threads=1",
                    *extra, "--values", str(out / f"{name}.values.json")]
             for name, extra in (("base", su["args"]), ("teacher", [*su["teacher_eval"], "eval.prompts=teacher"]))]
    jobs = [(f"{m}-seed{s}", opd + ["train", "--config", CONFIG, *_task(task), *_common(setup, task),
                                    f"run_dir={out / f'{m}-seed{s}'}", f"train.seed={s}", *METHODS[m]])
            for s in SEEDS for m in su["methods"]]
    jobs = [(n, cmd) for n, cmd in zip(("base", "teacher"), evals)] + jobs
    if only:
        unknown = sorted(set(only) - {n for n, _ in jobs})
        if unknown:
            raise SystemExit(f"--only: no job named {', '.join(unknown)} (jobs: {', '.join(n for n, _ in jobs)})")
        jobs = [(n, cmd) for n, cmd in jobs if n in only]
    print(f"{setup} {task}: {', '.join(n for n, _ in jobs)} ({_steps(setup, task)} steps) in {lanes} lanes -> {out}",
          flush=True)
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        list(pool.map(lambda job: _run(job[1], out / f"{job[0]}.log"), jobs))


def step_times(setup: str, task: str, out: Path, repeats: int = 3) -> dict:
    """Each method's seconds per training step: 3-step runs, one at a time (one process, train.threads 1), the
    methods interleaved, ``repeats`` times; the median of each method's per-step times (steps 2-3: step 1 warms)."""
    opd = [sys.executable, "-m", "opdistill"]
    methods = SETUPS[setup]["methods"]
    times: dict = {m: [] for m in methods}
    (out / "step_times").mkdir(parents=True, exist_ok=True)
    for r in range(repeats):
        for m in methods:
            run = out / "step_times" / f"{m}-{r}"
            _run(opd + ["train", "--config", CONFIG, *_task(task), *SETUPS[setup]["args"], "train.steps=3",
                        "eval.num_prompts=0", "log.progress=false", "checkpoint.save_final=false", "train.threads=1",
                        f"run_dir={run}", "--overwrite", *METHODS[m]], out / "step_times" / f"{m}-{r}.log")
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            times[m] += [row["time/step_s"] for row in rows if "time/step_s" in row][1:]
    result = {m: statistics.median(v) for m, v in times.items()}
    (out / "step_times.json").write_text(json.dumps({"median_s": result, "all_s": times}, indent=1) + "\n")
    return result


def _values(path: Path) -> tuple:
    v = json.loads(path.read_text())
    return v["greedy_correct"], v["problems"], v.get("sampled_correct"), v.get("samples")


def report(setup: str, task: str, out: Path) -> None:
    from opdistill.runs.stats import paired_difference, paired_lift_ratio

    base, teacher = _values(out / "base.values.json"), _values(out / "teacher.values.json")

    def acc(v, sampled=False):
        num, den = (v[2], v[3]) if sampled else (v[0], v[1])
        return sum(num) / sum(den)

    times = json.loads((out / "step_times.json").read_text())["median_s"] if (out / "step_times.json").exists() \
        else {}
    print(f"### {task}: held-out greedy accuracy ({len(base[0])} problems; sampled in parentheses)\n")
    def exact(v):  # the share of problems the verifier scores 1 (calendar_arithmetic gives partial credit)
        return sum(x >= 1 for x in v[0]) / len(v[0])

    print(f"untrained student {acc(base):.3f} ({acc(base, True):.3f}), exact {exact(base):.3f}; the teacher under "
          f"the context {acc(teacher):.3f} ({acc(teacher, True):.3f}), exact {exact(teacher):.3f}\n")
    print("| method | step | seed 0 | seed 1 | mean | change from the untrained student [95%] | share of the "
          "teacher's lead closed [95%] | exact (mean) | CPU s / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in SETUPS[setup]["methods"]:
        for step in range(EVERY[task], _steps(setup, task) + 1, EVERY[task]):
            # a seed that was not run (or not this far) is a dash, and the intervals pair the seeds that were
            files = [out / f"{m}-seed{s}" / "eval" / f"step_{step:06d}.json" for s in SEEDS]
            runs = [_values(f) for f in files if f.exists()]
            if not runs:
                continue
            accs = [acc(v) for v in runs]
            cells = " | ".join(f"{acc(_values(f)):.3f}" if f.exists() else "—" for f in files)
            diff = paired_difference([r[:2] for r in runs], [base[:2]])
            share = paired_lift_ratio(base[:2], [r[:2] for r in runs], [teacher[:2]])
            t = f"{times[m]:.1f}" if m in times else ""
            print(f"| {m} | {step} | {cells} | {sum(accs) / len(accs):.3f} | "
                  f"{diff.value:+.3f} [{diff.lo:+.3f}, {diff.hi:+.3f}] | {share.value:.2f} [{share.lo:.2f}, "
                  f"{share.hi:.2f}] | {sum(map(exact, runs)) / len(runs):.3f} | {t} |")


def constant_baseline(task: str, out: Path) -> None:
    """The held-out score of the best constant answer (one answer, the same for every problem, in the verifier's
    format: the answer among the problems' own answers that scores most) and, paired over problems, how far each
    evaluation in ``out`` is above it. A task where it comes close to the teacher is one the teacher does not know
    better than a guess in the right format."""
    import numpy as np

    from opdistill.data import PromptSource
    from opdistill.runs.stats import paired_difference
    from opdistill.train import load_config
    from opdistill.train.assemble import build_task

    cfg = load_config(CONFIG, _task(task))
    task_ = build_task(cfg)
    held = PromptSource(task_, cfg.train.seed, cfg.data.eval_seed).held_out(PROBLEMS)

    def scores(answer):
        return np.array([task_.score(p, f"<answer>{answer}</answer>") for p in held], dtype=float)

    best = max(sorted({p.answer for p in held}), key=lambda a: scores(a).sum())
    const, ones = scores(best), np.ones(len(held))
    print(f"\nthe best constant answer, {best!r} for every problem: {const.mean():.3f} (exact {np.mean(const >= 1):.3f}); "
          f"each greedy evaluation minus it, paired over problems [95%]:\n")
    files = [out / "base.values.json", out / "teacher.values.json", *sorted(out.glob("*-seed*/eval/step_*.json"))]
    for f in files:
        if f.exists():
            g = np.array(json.loads(f.read_text())["greedy_correct"])
            iv = paired_difference([(g, ones)], [(const, ones)])
            print(f"- {f.relative_to(out)}: {g.mean():.3f}, {iv.value:+.3f} [{iv.lo:+.3f}, {iv.hi:+.3f}]")


def diagnose(setup: str, task: str, out: Path) -> dict:
    """What the students learned, read off their greedy answers to the held-out problems: the share that gives an
    answer in the verifier's format (``<answer>...</answer>``), the accuracy among those, and the most common
    answers against the best constant answer's accuracy (a student that learned one answer would match it). For the
    untrained student, the context-teacher (the untrained student under the context) and each run's final weights."""
    from collections import Counter

    import torch
    from reasoning_gym.utils import extract_answer

    from opdistill.data import PromptSource, render_prompt
    from opdistill.engines.rollout import generate_rollouts
    from opdistill.train import load_config
    from opdistill.train.assemble import build_context, build_task
    from opdistill.train.disk.checkpoint import load_weights, resume_checkpoint
    from opdistill.train.loop import load_models

    torch.set_num_threads(1)  # one lane: the runs may be using the other core
    su = SETUPS[setup]
    cfg = load_config(CONFIG, _task(task) + [f"eval.num_prompts={PROBLEMS}", *su["args"]])
    tok, student, _ = load_models(cfg.model_copy(update={"model": cfg.model.model_copy(update={"teacher": None})}))
    task_ = build_task(cfg)
    held = PromptSource(task_, cfg.train.seed, cfg.data.eval_seed).held_out(PROBLEMS)
    context = build_context(cfg, task_, tok)
    best = Counter(p.answer for p in held).most_common(1)[0]
    initial = {k: v.clone() for k, v in student.state_dict().items()}
    # the teacher's own accuracy under the context is the student's model's only where the teacher is the student
    targets = [("base", None, False)] + ([("teacher", None, True)] if setup == "a" else []) + [
        (f"{m}-seed{s}", out / f"{m}-seed{s}", False) for m in su["methods"] for s in SEEDS]
    result = {"constant": {"answer": best[0], "acc": best[1] / len(held)}}
    for name, run, under_context in targets:
        student.load_state_dict(initial)
        if run is not None:
            if not (run / "checkpoints").is_dir():
                continue
            load_weights(resume_checkpoint(run), student)
        prompts = [render_prompt(tok, context(p) if under_context else p.prompt) for p in held]
        g = generate_rollouts(student, tok, prompts, greedy=True, max_new_tokens=cfg.rollout.max_new_tokens,
                              batch_size=50, want_logprobs=False)
        answers = [extract_answer(t) for t in g.texts]
        scores = [task_.score(p, t) for p, t in zip(held, g.texts)]
        formatted = [s for a, s in zip(answers, scores) if a is not None]
        result[name] = {"acc": sum(scores) / len(held), "format": len(formatted) / len(held),
                        "acc_formatted": sum(formatted) / max(1, len(formatted)),
                        "top_answers": Counter(a for a in answers if a is not None).most_common(3),
                        "mean_tokens": float(g.response_mask.sum(-1).float().mean())}
        print(name, result[name], flush=True)
    (out / "diagnose.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), required=True)
    ap.add_argument("--setup", choices=sorted(SETUPS), default="a", help="a: SmolLM2 from itself, against its "
                    "baselines; b: Gemma-3-270M teaching SmolLM2 across tokenizers; c: SmolLM2 teaching Gemma")
    ap.add_argument("--out", required=True)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--only", nargs="+", metavar="JOB", help="run only these jobs (base, teacher, opd-seed0, ...)")
    ap.add_argument("--report", action="store_true", help="only print the table from existing runs")
    ap.add_argument("--step-times", action="store_true", help="only measure each method's seconds per step")
    ap.add_argument("--diagnose", action="store_true", help="only read what the students learned off their answers")
    args = ap.parse_args()
    out = Path(args.out)
    if args.diagnose:
        diagnose(args.setup, args.task, out)
        return
    if args.step_times:
        print(step_times(args.setup, args.task, out))
        return
    if not args.report:
        run_all(args.setup, args.task, out, args.lanes, args.only)
    report(args.setup, args.task, out)
    constant_baseline(args.task, out)


if __name__ == "__main__":
    main()
