"""Our sampler's decode step: the lean Qwen2/Llama step vs the model's own forward (docs/sampler.md, issue 10).

The work is the sampling phase of ``benchmarks/bench_trainer.py``: its random-init Qwen2 student (2 layers, hidden
64, character vocabulary of 128; assets built deterministically into ``--out/assets``), 16 prompts ``abc+def=``,
one sample each, exactly 32 tokens (``min_new_tokens = max_new_tokens = 32``), temperature 1, sampler log-probs on.
Each mode runs in a fresh process (``--child``), the modes interleaved (the order alternates every repeat); a child
warms up with 3 calls, then times ``--calls`` calls with fresh keys and reports the median wall and process CPU
time (user + system) per call. The table: medians [min-max] over the repeats, and each mode's ratio to
``model_forward`` (per repeat, then the median [min-max]).

    PYTHONPATH=. python benchmarks/bench_sampler.py                 # 5 repeats, 1 thread
    PYTHONPATH=. python benchmarks/bench_sampler.py --threads 0     # torch's default threads

On a machine shared with other jobs use the CPU-time column (less disturbed by time slicing) and say so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("model_forward", "lean")


def child(args) -> dict:
    import warnings

    import torch

    sys.path.insert(0, str(ROOT))
    warnings.filterwarnings("ignore")
    from opdistill.data import render_prompt
    from opdistill.engines.sampler import sample
    from opdistill.models import load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    assets = Path(args.assets)
    tok, model = load_tokenizer(assets / "student"), load_model(assets / "student")
    lines = (assets / "prompts.jsonl").read_text().splitlines()[: args.prompts]
    prompts = [render_prompt(tok, json.loads(x)["prompt"], use_chat_template=False) for x in lines]
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, n=1, temperature=1.0, max_new_tokens=args.tokens,
              min_new_tokens=args.tokens, want_logprobs=True, lean_decode=args.child == "lean")
    for s in range(3):
        sample(model, prompts, seed=0, step=s, **kw)
    wall, cpu = [], []
    for s in range(args.calls):
        w0, c0 = time.perf_counter(), time.process_time()
        sample(model, prompts, seed=0, step=100 + s, **kw)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {"wall_ms": 1e3 * statistics.median(wall), "cpu_ms": 1e3 * statistics.median(cpu)}


def _fmt(xs, digits=1) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/opdistill-bench-sampler"), help="assets")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10, help="timed sample() calls per child")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every child (0: torch's default)")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--assets", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_trainer import build_assets

    build_assets(args.out / "assets")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--assets", str(args.out / "assets"),
                   "--calls", str(args.calls), "--prompts", str(args.prompts), "--tokens", str(args.tokens),
                   "--threads", str(args.threads)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(f"[{rep}] {mode}: {runs[mode][-1]}", flush=True)
    base = runs["model_forward"]
    print("\n| mode | wall ms/call | CPU ms/call | CPU x model_forward |\n|---|---|---|---|")
    for mode in MODES:
        r = runs[mode]
        ratio = [a["cpu_ms"] / b["cpu_ms"] for a, b in zip(r, base)]
        print(f"| {mode} | {_fmt([x['wall_ms'] for x in r])} | {_fmt([x['cpu_ms'] for x in r])} | {_fmt(ratio, 2)} |")
    print(f"\n(load average at the end: {os.getloadavg()[0]:.1f}; {args.repeats} repeats x {args.calls} calls, "
          f"{args.prompts} prompts x {args.tokens} tokens, threads {args.threads or 'default'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
