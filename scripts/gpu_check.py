#!/usr/bin/env python
"""The GPU check of the trainer (issue 11, item 9): run it once on a machine with CUDA; nothing depends on it.

    python scripts/gpu_check.py                 # on a GPU machine: the nccl path, a bf16 step time, vLLM if importable
    python scripts/gpu_check.py --device cpu    # the same code path on CPU (gloo): a dry run of this script's logic

What it runs (docs/distributed.md, "Tested on CPU, and what is not"):

1. ``torchrun --standalone --nproc-per-node 1 -m opdistill train --config configs/demo_carry_add.yaml`` with
   ``train.device=cuda`` (``distributed.backend`` left at ``auto``, so nccl), ``train.bf16=true`` (bf16 autocast,
   fp32 master weights) and a few steps. Checked: exit 0, the process group's backend is nccl and the student sits on
   ``cuda:0`` (recorded inside the run by a thin wrapper around the loop), one metrics line per step with a finite,
   positive gradient norm. Reported: the median ``time/step_s`` of the steps after the first (the bf16 step time).
2. The same run with ``model.teacher_sharded=true`` (the teacher FSDP2-sharded over the one-rank CUDA mesh): the
   teacher is a ``ShardedTeacher`` and the per-step losses equal run 1's (to ``--rel`` relative).
3. The same run with ``distributed.decode=sharded`` (issue 24: no plain replica of the student; rollouts decode
   with the FSDP2 student on CUDA): the per-step losses equal run 1's (to ``--rel``); its step time is reported.
4. Only when ``import vllm`` works: ``pytest -m vllm tests/test_vllm_engines.py`` (the vLLM engines against the HF
   paths). Otherwise reported as skipped.

One summary line per check, then ``gpu_check: PASS`` or ``gpu_check: FAIL``; the exit status is 0 (pass),
1 (a check failed) or 2 (refused: no CUDA device for ``--device cuda``, bad arguments). Everything lands in ``--out``
(``summary.json``, each run's folder and log). Sized for a few minutes on one H200 (not measured yet: no GPU when it
was written); ``--budget-s`` (default 480) bounds the whole script.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/demo_carry_add.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): the nccl check, refused without a GPU; cpu: the same code path on gloo")
    p.add_argument("--steps", type=int, default=5, help="training steps per run, >= 2 (the first is not timed)")
    p.add_argument("--prompts", type=int, default=32, help="data.prompts_per_step (the demo config's 32)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="rollout.max_new_tokens (the demo config's 64)")
    p.add_argument("--rel", type=float, default=1e-3,
                   help="relative tolerance of the sharded-teacher run's losses against the replicated run's")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole script, seconds")
    p.add_argument("--skip-vllm", action="store_true", help="do not run the vLLM checks even if vllm imports")
    p.add_argument("--out", default=None, help="folder for the runs, logs and summary.json (default: a temp folder)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: the torchrun entry (see _worker)
    args, rest = p.parse_known_args(argv)
    if args.worker is None:
        if rest:
            p.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.steps < 2:
            p.error(f"--steps: expected an int >= 2 (the first step is not timed), got {args.steps}")
        if args.prompts < 1 or args.max_new_tokens < 1:
            p.error("--prompts and --max-new-tokens: expected ints >= 1")
        if not args.rel > 0 or not args.budget_s > 0:
            p.error("--rel and --budget-s: expected numbers > 0")
    args.train_args = rest
    return args


def cuda_refusal(device: str) -> str | None:
    """Why ``--device cuda`` cannot run here (one line), or None."""
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return (f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, built with CUDA "
                f"{torch.version.cuda}); run this on a machine with a GPU, or use --device cpu for the gloo dry run")
    return None


# -- the torchrun entry: the trainer's own CLI, with what the check verifies recorded from inside the run ---------
def _worker(record_path: str, train_args: list[str]) -> int:
    import torch.distributed as dist

    from opdistill.cli import main
    from opdistill.train import assemble, loop

    seen: dict = {}
    real_init, real_wrap, real_build = loop.init_distributed, assemble.wrap_student, assemble.build_teacher

    def init(cfg):
        ctx = real_init(cfg)
        seen.update(world=ctx.world, enabled=ctx.enabled,
                    backend=str(dist.get_backend(ctx.group)) if ctx.enabled else None)
        return ctx

    wrapped: list = []

    def wrap(ctx, student):
        wrapped.append(real_wrap(ctx, student))
        return wrapped[-1]

    def build(cfg, context, **kw):  # after the student's weights are in (decode sharded reads them after wrapping)
        p = next(wrapped[-1].parameters())
        seen.update(student_device=str(p.device), student_dtype=str(p.dtype).removeprefix("torch."))
        out = real_build(cfg, context, **kw)
        seen.update(teacher=type(out.train).__name__)
        return out

    loop.init_distributed, assemble.wrap_student, assemble.build_teacher = init, wrap, build
    try:
        return main(["train", *train_args])
    finally:
        Path(record_path).write_text(json.dumps(seen))


# -- the checks ------------------------------------------------------------------------------------------------------
class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def train_run(name: str, args, out: Path, budget: Budget, extra: list[str]) -> dict:
    """One torchrun launch of the trainer (1 process); returns what was recorded and measured, ``error`` on failure."""
    run_dir, record, log = out / name, out / f"{name}_record.json", out / f"{name}.log"
    overrides = [f"run_dir={run_dir}", f"train.device={args.device}", "train.bf16=true", f"train.steps={args.steps}",
                 f"data.prompts_per_step={args.prompts}", f"rollout.max_new_tokens={args.max_new_tokens}",
                 "eval.num_prompts=0", "checkpoint.every=0", "log.tensorboard=false", "log.progress=false", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(Path(__file__).resolve()), "--worker", str(record), "--config", CONFIG, *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    timeout = budget.left()
    if timeout < 10:
        return {"error": "no time left in --budget-s"}
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s (--budget-s)"}
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    res: dict = {"wall_s": time.monotonic() - t0, "log": str(log)}
    if r.returncode != 0:
        tail = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no stderr)"]
        return {**res, "error": f"exit {r.returncode}: {tail[0][:300]} (full log: {log})"}
    res.update(json.loads(record.read_text()) if record.exists() else {})
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    rows = [x for x in rows if "train/grad_norm" in x]
    res["steps"] = [x["step"] for x in rows]
    res["loss"] = [x.get("distillation/loss") for x in rows]
    res["grad_norm"] = [x["train/grad_norm"] for x in rows]
    res["step_s"] = [x["time/step_s"] for x in rows]
    return res


def check_run(res: dict, args, *, backend: str, device: str, sharded: bool) -> str | None:
    """What is wrong with a finished run (one line), or None."""
    if "error" in res:
        return res["error"]
    if not res.get("enabled") or res.get("world") != 1:
        return f"expected a torchrun process group of 1 rank, got world={res.get('world')} enabled={res.get('enabled')}"
    if backend not in (res.get("backend") or ""):
        return f"expected the {backend} backend, got {res.get('backend')!r}"
    if not (res.get("student_device") or "").startswith(device):
        return f"expected the student on {device}, got {res.get('student_device')!r}"
    if (res.get("teacher") == "ShardedTeacher") != sharded:
        return f"expected {'a' if sharded else 'no'} ShardedTeacher, got a {res.get('teacher')}"
    if res["steps"] != list(range(1, args.steps + 1)):
        return f"expected one metrics line per step 1..{args.steps}, got steps {res['steps']}"
    bad = [g for g in res["grad_norm"] if not (math.isfinite(g) and g > 0)]
    if bad or not all(x is not None and math.isfinite(x) for x in res["loss"]):
        return f"non-finite or zero loss / gradient norm: loss {res['loss']}, grad_norm {res['grad_norm']}"
    return None


def vllm_check(args, out: Path, budget: Budget) -> tuple[str, str]:
    """("PASS"/"FAIL"/"SKIP", detail)."""
    if args.skip_vllm:
        return "SKIP", "--skip-vllm"
    if importlib.util.find_spec("vllm") is None:
        return "SKIP", "vllm is not importable here"
    timeout = budget.left()
    if timeout < 30:
        return "FAIL", "no time left in --budget-s for the vLLM tests"
    log = out / "vllm.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "vllm", "tests/test_vllm_engines.py"]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "FAIL", f"pytest -m vllm timed out after {timeout:.0f} s"
    log.write_text(r.stdout + r.stderr)
    last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    return ("PASS" if r.returncode == 0 else "FAIL"), f"pytest -m vllm tests/test_vllm_engines.py: {last} (log: {log})"


def run_checks(args) -> int:
    import torch

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    backend = "nccl" if args.device == "cuda" else "gloo"
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"gpu_check: device {args.device} ({name}), torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"out {out}", flush=True)
    results, lines = {}, []

    rep = train_run("replicated", args, out, budget, [])
    results["replicated"] = rep
    why = check_run(rep, args, backend=backend, device=args.device, sharded=False)
    step_time = None
    if why is None:
        step_time = statistics.median(rep["step_s"][1:])
        lines.append(("PASS", f"{backend} world 1, bf16 autocast, {args.steps} steps: student on "
                              f"{rep['student_device']} ({rep['student_dtype']}), backend {rep['backend']}, step time "
                              f"median {step_time:.3f} s over steps 2-{args.steps} ({args.prompts} prompts x 4 samples, "
                              f"up to {args.max_new_tokens} new tokens)"))
    else:
        lines.append(("FAIL", f"{backend} world 1, replicated teacher: {why}"))

    sh = train_run("sharded", args, out, budget, ["model.teacher_sharded=true"])
    results["sharded"] = sh
    why = check_run(sh, args, backend=backend, device=args.device, sharded=True)
    worst = None
    if why is None and "error" in rep:
        why = "the replicated run failed, so there are no losses to compare with"
    if why is None:
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(sh["loss"], rep["loss"]))
        sh["max_rel_loss_diff"] = worst
        if worst > args.rel:
            why = f"per-step losses differ from the replicated run's by {worst:.3g} relative (> --rel {args.rel})"
    if why is None:
        lines.append(("PASS", f"{backend} world 1, model.teacher_sharded: the teacher FSDP2-sharded, per-step losses "
                              f"equal the replicated run's (max relative difference {worst:.2g})"))
    else:
        lines.append(("FAIL", f"{backend} world 1, model.teacher_sharded: {why}"))

    dec = train_run("decode_sharded", args, out, budget, ["distributed.decode=sharded"])
    results["decode_sharded"] = dec
    why = check_run(dec, args, backend=backend, device=args.device, sharded=False)
    if why is None and "error" in rep:
        why = "the replicated run failed, so there are no losses to compare with"
    if why is None:
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(dec["loss"], rep["loss"]))
        dec["max_rel_loss_diff"] = worst
        dec_time = statistics.median(dec["step_s"][1:])
        if worst > args.rel:
            why = f"per-step losses differ from the replicated run's by {worst:.3g} relative (> --rel {args.rel})"
    if why is None:
        lines.append(("PASS", f"{backend} world 1, distributed.decode sharded: rollouts decoded by the FSDP2 student "
                              f"itself (no replica), per-step losses equal the replicated run's (max relative "
                              f"difference {worst:.2g}); step time median {dec_time:.3f} s"))
    else:
        lines.append(("FAIL", f"{backend} world 1, distributed.decode sharded: {why}"))

    status, detail = vllm_check(args, out, budget)
    lines.append((status, f"vllm: {detail}"))

    ok = all(s != "FAIL" for s, _ in lines)
    summary = {"device": args.device, "device_name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
               "ok": ok, "bf16_step_time_s": step_time, "checks": [{"status": s, "detail": d} for s, d in lines],
               "runs": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for s, d in lines:
        print(f"  [{s}] {d}", flush=True)
    tail = f"bf16 step time {step_time:.3f} s/step" if step_time is not None else "no step time"
    print(f"gpu_check: {'PASS' if ok else 'FAIL'} ({args.device}: {tail}; summary {out / 'summary.json'})",
          flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return _worker(args.worker, args.train_args)
    why = cuda_refusal(args.device)
    if why is not None:
        print(f"gpu_check: FAIL: {why}", file=sys.stderr, flush=True)
        return 2
    return run_checks(args)


if __name__ == "__main__":
    sys.exit(main())
