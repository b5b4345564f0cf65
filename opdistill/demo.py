"""``opdistill demo``: on-policy distillation vs off-policy KD vs RL from a 0/1 reward, same student start.

The packaged teacher (4 layers, hidden 128) solves ``carry_add`` (worked column-by-column addition, ~30-45 tokens of
answer); the packaged student start (2 layers, hidden 128) was trained just far enough to know the answer format. From
that same start, for each seed, three methods train for the same wall-clock budget (rollout + teacher + update time;
evaluation excluded):

  (a) on_policy   the student samples, the teacher scores every token (top-k 8, tail-aware forward KL per token);
  (b) off_policy  the teacher samples, the student is trained with the same per-token loss on the teacher's text
                  (classic KD on teacher-written samples);
  (c) rl          the student samples, the verifier's 0/1 reward, GRPO group-normalized advantages, PPO-clip loss.

(a) and (b) use the identical loss; only who writes the samples differs. Every method sees the same prompts step by
step and is evaluated on the same held-out problems: greedy and sampled accuracy, and teacher-KL (the student's
per-token reverse KL to the teacher on its own samples). The table reports each method at the end of the budget
(equal wall time, with the 95% interval of each run's final value: a bootstrap over the held-out problems) and at
the same step count (the fewest steps any method reached, rounded down to the eval grid), and each method's
difference from on-policy distillation paired over the held-out problems (mean over seeds, with its 95% interval: the
problems' difficulty, common to every run, cancels). ``demo.png`` next to the
table draws held-out greedy accuracy and teacher-KL vs training time and vs step: each seed thin with its interval
band, the mean over seeds bold (``opdistill compare``'s plotting).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from opdistill.data import PromptSource
from opdistill.env.demo import ENV_CONFIG
from opdistill.runs.compare import Group, load_runs, metric_sums, plot_groups, read_values
from opdistill.runs.outputs import check_output_path
from opdistill.runs.stats import paired_difference
from opdistill.teachers import TeacherContext, build_teacher
from opdistill.train.run.config import load_config
from opdistill.train.assemble import build_env
from opdistill.train.loop import build_task, load_models, run_eval, run_training

__all__ = ["demo_config", "run_demo", "format_table", "demo_figure", "method_differences"]

METHODS = ("on_policy", "off_policy", "rl")
# Learning rates per method, from a one-seed 40 s sweep on this task (docs/demo.md): the distillation losses did best
# at 3e-4 (1e-3 was worse); RL collapsed at 1e-3 (Adam turns the sparse, noisy reward gradient into full-size steps)
# and did best at 1e-4 (3e-5 was slower).
LR = {"on_policy": 3e-4, "off_policy": 3e-4, "rl": 1e-4}


def demo_config(out_dir: Path, method: str, seed: int, budget_s: float, eval_every: int, eval_prompts: int,
                threads: int, tools: bool = False) -> dict:
    """One run of the demo; ``tools``: the demo environment's (lookup_add, whose answer needs a tool call:
    opdistill/env/demo.py, docs/episodes.md), with the tool-using pair and episodes in place of single responses."""
    pair = "demo-tool-" if tools else "demo-"
    return {
        "run_dir": str(out_dir / f"{method}-seed{seed}"),
        "model": {"student": f"builtin:{pair}student", "teacher": f"builtin:{pair}teacher"},
        "data": {"task": "lookup_add" if tools else "carry_add", "prompts_per_step": 32},
        **({"env": ENV_CONFIG} if tools else {}),
        "rollout": {"n": 4, "temperature": 1.0, "max_new_tokens": 64},
        # tools: reverse KL; the forward top-k tail KL drove the tool student's bad calls from 0.09 to 0.40 in 16
        # steps (docs/episodes.md "The demo environment")
        "loss": {"loss_mode": "topk", "support": "tail", "divergence": "reverse" if tools else "forward", "topk": 8},
        "optim": {"lr": LR[method], "schedule": "constant", "warmup_steps": 10, "grad_clip": 1.0},
        "train": {"method": method, "steps": 100000, "max_time_s": budget_s, "seed": seed, "threads": threads,
                  "micro_batch_tokens": 8192},
        "eval": {"every": eval_every, "num_prompts": eval_prompts, "topk": 8},
        "checkpoint": {"every": 0, "save_final": True, "keep_last": 1},
        "log": {"tensorboard": True, "progress": True},  # a bar over the run's training seconds
    }


def _at(history: list[dict], step: int) -> dict:
    for h in history:
        if h["step"] == step:
            return h
    raise KeyError(step)


DIFFERENCE_METRICS = {"acc": "eval/greedy_acc", "kl": "eval/teacher_kl"}


def method_differences(out_dir: Path, runs: dict[str, list[dict]], s_eq: int) -> dict:
    """Each later method minus the first, on the same held-out problems, paired over problems, mean over seeds:
    ``{method: {"acc": [value, lo, hi], "acc_eq": ..., "kl": ..., "kl_eq": ...}}`` at equal time (each run's last
    evaluation) and at step ``s_eq``, from the per-problem values every run kept (RUN_DIR/eval)."""
    def values(method: str, at_eq: bool) -> list:  # one evaluation per seed, each file read once
        return [read_values(out_dir / f"{method}-seed{r['seed']}" / "eval" /
                            f"step_{s_eq if at_eq else r['history'][-1]['step']:06d}.json") for r in runs[method]]

    kept = {(m, at_eq): values(m, at_eq) for m in runs for at_eq in (False, True)}

    ref, *others = list(runs)
    diffs = {}
    for method in others:
        diffs[method] = {}
        for key in DIFFERENCE_METRICS:
            for at_eq in (False, True):
                iv = paired_difference(metric_sums(kept[method, at_eq], DIFFERENCE_METRICS[key]),
                                       metric_sums(kept[ref, at_eq], DIFFERENCE_METRICS[key]))
                diffs[method][key + ("_eq" if at_eq else "")] = [iv.value, iv.lo, iv.hi]
    return diffs


def format_table(results: dict) -> str:
    """Markdown table of the demo results (see run_demo for the layout of ``results``)."""
    s_eq = results["equal_steps"]
    lines = [
        f"teacher: greedy acc {results['teacher']['eval/greedy_acc']:.3f}{_ci(_teacher_ci(results), 'acc')}, "
        f"sampled acc {results['teacher']['eval/sampled_acc']:.3f} (held-out, {results['eval_prompts']} problems; "
        f"[95% interval], bootstrap over problems)",
        f"budget: {results['budget_s']:.0f} s of training per run (eval excluded), seeds {results['seeds']}, "
        f"equal-steps column at step {s_eq}" + _load_note(results)
        + (" (the start: a run made fewer steps than the evaluation interval in its budget, so no later step was "
           "evaluated by every run; a quieter machine, a larger --budget-s or a smaller --eval-every gives one)"
           if s_eq == 0 else ""),
        "",
        "| method | seed | steps | greedy acc: start -> equal time | sampled acc | teacher-KL: start -> equal time "
        f"| greedy acc @ step {s_eq} | teacher-KL @ step {s_eq} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    tools = any("tool" in r for rs in results["runs"].values() for r in rs)
    if tools:  # the tools demo: the training episodes' tool use, first step -> last
        lines[-2] += " episodes using the tool | bad calls |"
        lines[-1] += "---|---|"
    for method in results["methods"]:
        rows = results["runs"][method]
        for r in rows + [_mean_row(rows)]:
            lines.append(
                f"| {method} | {r['seed']} | {r['steps']:.0f} | {r['acc0']:.3f} -> {r['acc']:.3f}{_ci(r, 'acc')} | "
                f"{r['sacc0']:.3f} -> {r['sacc']:.3f} | {r['kl0']:.3f} -> {r['kl']:.3f}{_ci(r, 'kl')} | "
                f"{r['acc_eq']:.3f} | {r['kl_eq']:.3f} |"
                + (f" {r['tool0']:.3f} -> {r['tool']:.3f} | {r['bad0']:.3f} -> {r['bad']:.3f} |" if tools else "")
            )
    if results.get("differences"):
        ref = results["methods"][0]
        lines += ["", f"Each method minus {ref} on the same {results['eval_prompts']} problems (paired over problems, "
                      "mean over seeds, [95% interval]):", "",
                  f"| difference | greedy acc, equal time | greedy acc @ step {s_eq} | teacher-KL, equal time "
                  f"| teacher-KL @ step {s_eq} |", "|---|---|---|---|---|"]
        for method, d in results["differences"].items():
            cells = [f"{d[k][0]:+.3f} [{d[k][1]:+.3f}, {d[k][2]:+.3f}]" for k in ("acc", "acc_eq", "kl", "kl_eq")]
            lines.append(f"| {method} - {ref} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


FIGURE_METRICS = ("eval/greedy_acc", "eval/teacher_kl")
TOOL_METRICS = ("env/used_tool", "env/bad_calls")  # the tools demo's training episodes, step by step


def demo_figure(out_dir: str | Path, methods=METHODS, seeds=(0, 1), *, title: str | None = None,
                metrics=FIGURE_METRICS) -> Path:
    """OUT/demo.png: held-out greedy accuracy and teacher-KL (and, for the tools demo, the share of episodes that
    used the tool and of calls that were bad) vs step and vs training time, one colour per method, each seed thin
    (with its 95% interval band) and the mean over seeds bold (``opdistill compare``'s plotting)."""
    out_dir = Path(out_dir)
    groups = [Group(m, load_runs([out_dir / f"{m}-seed{s}" for s in seeds])) for m in methods]
    return plot_groups(groups, list(metrics), out_dir / "demo.png", title=title)


def _tool_use(run_dir: Path) -> dict:
    """The share of training episodes that used the tool, and of calls that were bad, at a run's first and last step
    (its metrics.jsonl)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "env/used_tool" in r]
    return {"tool0": rows[0]["env/used_tool"], "tool": rows[-1]["env/used_tool"],
            "bad0": rows[0]["env/bad_calls"], "bad": rows[-1]["env/bad_calls"]}


def _load_note(results: dict) -> str:
    """'; load average A -> B on N CPUs': how busy the machine was (the equal-time step counts depend on it)."""
    m = results.get("machine")
    if not m or m["start"]["load_1min"] is None:
        return ""
    return (f"; machine load {m['start']['load_1min']:.1f} -> {m['end']['load_1min']:.1f} on {m['start']['cpus']} "
            f"CPUs (steps at equal time depend on it)")


def _teacher_ci(results: dict) -> dict:
    t = results["teacher"]
    return {"acc_ci": (t.get("eval/greedy_acc_lo"), t.get("eval/greedy_acc_hi"))}


def _ci(row: dict, key: str) -> str:
    """' [lo, hi]': the 95% interval of a run's final value (a mean row over seeds has none)."""
    ci = row.get(f"{key}_ci")
    return f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and None not in ci else ""


def _mean_row(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if k != "seed" and not k.endswith("_ci")]
    return {"seed": "mean", **{k: sum(r[k] for r in rows) / len(rows) for k in keys}}


def machine_load() -> dict:
    """The 1-minute load average and the CPU count (the equal-time columns depend on them)."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # not on every platform
        load = None
    return {"load_1min": load, "cpus": os.cpu_count()}


def expectations(budget_s: float, seeds, methods, eval_every: int, eval_prompts: int) -> list[str]:
    """What a user should expect before the first minute of silence: the duration, the progress shown, and why the
    equal-time numbers depend on the machine."""
    runs = len(seeds) * len(methods)
    load = machine_load()
    busy = "" if load["load_1min"] is None else (
        f"; load now {load['load_1min']:.1f} on {load['cpus']} CPUs"
        + (" (busy: expect fewer steps per run)" if load["load_1min"] > 0.5 * (load["cpus"] or 1) else ""))
    return [
        f"opdistill demo: {len(methods)} methods x {len(seeds)} seed(s), {budget_s:g} s of training each "
        f"({runs * budget_s / 60:.1f} min of training), plus an evaluation on {eval_prompts} held-out problems every "
        f"{eval_every} steps (the README's run with the defaults: 405 s in all on 2 CPU cores). A bar shows each "
        f"run's training seconds.",
        f"Equal time means each method trains {budget_s:g} s: how many steps fit depends on this machine's speed "
        f"and load (the README's run: 80 on-policy steps; a loaded machine fitted 65), so the equal-time columns "
        f"move with them; the equal-steps columns do not{busy}.",
    ]


def run_demo(out_dir: str | Path = "runs/demo", *, budget_s: float = 60.0, seeds=(0, 1), methods=METHODS,
             eval_every: int = 20, eval_prompts: int = 200, threads: int | None = None, log=print,
             tools: bool = False) -> dict:
    threads = threads or 1  # tiny models: one thread is fastest, and 2 threads collapse under any other load
    out_dir = Path(out_dir)
    check_output_path(out_dir, "--out")  # not inside a run's entries (its rotation would delete the demo's runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    for line in expectations(budget_s, seeds, methods, eval_every, eval_prompts):
        log(line)
    load_start = machine_load()
    base = load_config(base=demo_config(out_dir, "on_policy", seeds[0], budget_s, eval_every, eval_prompts, threads,
                                        tools))
    torch.set_num_threads(threads)
    tok, student0, teacher = load_models(base)
    task = build_task(base)
    held_out = PromptSource(task, seeds[0], base.data.eval_seed).held_out(eval_prompts)  # the same for every run
    log(f"evaluating the teacher on {len(held_out)} held-out problems ...")
    own = build_teacher(base, TeacherContext(tokenizer=tok, models={"model.teacher": teacher}), train=False).eval
    env = build_env(base, tok)  # tools: the teacher's own episodes
    teacher_eval = run_eval(base, tok, teacher, own, task, held_out, env=env)  # the teacher itself, scored by itself
    log(f"teacher held-out: greedy acc {teacher_eval['eval/greedy_acc']:.3f}, "
        f"sampled acc {teacher_eval['eval/sampled_acc']:.3f}")
    start_state = {k: v.clone() for k, v in student0.state_dict().items()}
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    histories: dict[str, dict[int, list]] = {m: {} for m in methods}
    for seed in seeds:
        for method in methods:
            cfg = load_config(base=demo_config(out_dir, method, seed, budget_s, eval_every, eval_prompts, threads,
                                               tools))
            student0.load_state_dict(start_state)
            t0 = time.time()
            log(f"[{method} seed {seed}] training for {budget_s:g} s ...")
            summary = run_training(cfg, overwrite=True, models=(tok, student0, teacher))
            if summary["stopped"]:  # SIGINT/SIGTERM: the demo stops with the run (its checkpoint is kept)
                raise KeyboardInterrupt(f"stopped by {summary['stopped']} during {method} seed {seed}; the runs so "
                                        f"far are in {out_dir}")
            h = summary["eval_history"]
            histories[method][seed] = h
            log(f"[{method} seed {seed}] {summary['steps']} steps in {summary['train_time_s']:.1f} s train "
                f"({time.time() - t0:.0f} s with eval): greedy acc {h[0]['eval/greedy_acc']:.3f} -> "
                f"{h[-1]['eval/greedy_acc']:.3f}, teacher-KL {h[0]['eval/teacher_kl']:.3f} -> "
                f"{h[-1]['eval/teacher_kl']:.3f}")
            runs[method].append({"seed": seed, "steps": summary["steps"], "history": h})
    # Equal steps: the largest eval-grid step every run reached.
    min_steps = min(r["steps"] for rs in runs.values() for r in rs)
    s_eq = (min_steps // eval_every) * eval_every
    table_runs = {}
    for method, rs in runs.items():
        table_runs[method] = []
        for r in rs:
            h = r["history"]
            first, last, eq = h[0], h[-1], _at(h, s_eq)
            table_runs[method].append({
                "seed": r["seed"], "steps": r["steps"],
                "acc0": first["eval/greedy_acc"], "acc": last["eval/greedy_acc"],
                "sacc0": first["eval/sampled_acc"], "sacc": last["eval/sampled_acc"],
                "kl0": first["eval/teacher_kl"], "kl": last["eval/teacher_kl"],
                "acc_eq": eq["eval/greedy_acc"], "kl_eq": eq["eval/teacher_kl"],
                "acc_ci": (last.get("eval/greedy_acc_lo"), last.get("eval/greedy_acc_hi")),
                "kl_ci": (last.get("eval/teacher_kl_lo"), last.get("eval/teacher_kl_hi")),
                **(_tool_use(out_dir / f"{method}-seed{r['seed']}") if tools else {}),
            })
    results = {"teacher": teacher_eval, "budget_s": budget_s, "seeds": list(seeds), "methods": list(methods),
               "eval_prompts": eval_prompts, "equal_steps": s_eq, "runs": table_runs,
               "differences": method_differences(out_dir, runs, s_eq),
               "histories": {m: {str(s): h for s, h in hs.items()} for m, hs in histories.items()},
               "total_wall_s": time.time() - t_start, "threads": threads,
               "machine": {"start": load_start, "end": machine_load()}}
    table = format_table(results)
    (out_dir / "demo_table.md").write_text(table + "\n")
    (out_dir / "demo_results.json").write_text(json.dumps(results, indent=1))
    png = demo_figure(out_dir, methods, seeds, title=f"opdistill demo{' (tools)' * tools}: {budget_s:.0f} s of "
                                                      f"training per run, seeds {list(seeds)}, {eval_prompts} "
                                                      f"held-out problems",
                      metrics=FIGURE_METRICS + (TOOL_METRICS if tools else ()))
    log("\n" + table)
    log(f"\ntotal wall time {results['total_wall_s']:.0f} s; table saved to {out_dir / 'demo_table.md'}, figure to {png}")
    return results
