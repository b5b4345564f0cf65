"""Measure how far a `serve-teacher --engine vllm` server's log-probs are from an `--engine hf` server's.

    OMP_NUM_THREADS=2 .venv-vllm/bin/python scripts/compare_teacher_engines.py

Starts both servers (builtin:demo-teacher, ``--threads 1``) on free 127.0.0.1 ports and scores the same
right-padded rows through both (`teacher.url`'s client, fp32 payload, K = 8): a demo training step's rows (32
carry-add prompts x 4 samples of the demo student, 64 new tokens), 32 x 2 samples of the teacher itself, and 16
random rows of 64 tokens; prints the max and mean absolute difference of the top-K and next-token log-probs and the
share of equal top-K ids. The numbers in docs/teacher_service.md ("Engines") come from this script. Needs vllm
(docs/engines.md) and the serve extra.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=8)
    args = p.parse_args()

    from opdistill.data import CarryAdditionTask, render_prompt
    from opdistill.teachers import RemoteTeacher, Rows, ScoreRequest
    from opdistill.models import load_model, load_tokenizer
    from opdistill.engines.rollout import generate_rollouts
    from tests.test_teacher_service_vllm import DEMO, _keep, _rows, _start, _stop

    tmp = Path(tempfile.mkdtemp(prefix="compare_engines_"))
    procs = []
    try:
        procs.append(_start("vllm", tmp / "vllm.log"))
        procs.append(_start("hf", tmp / "hf.log"))
        (_, url_vllm), (_, url_hf) = procs
        tok = load_tokenizer(DEMO / "student")
        rng = random.Random(1)
        task = CarryAdditionTask(1, 3)
        prompts = [render_prompt(tok, task.sample(rng).prompt) for _ in range(32)]
        sets = {}
        ro = generate_rollouts(load_model(DEMO / "student"), tok, prompts, n=4, max_new_tokens=64, seed=0)
        sets["a demo step: 32 prompts x 4 student samples, 64 new tokens"] = (ro.input_ids, ro.attention_mask,
                                                                               ro.response_mask)
        ro = generate_rollouts(load_model(DEMO / "teacher"), tok, prompts, n=2, max_new_tokens=64, seed=1)
        sets["32 prompts x 2 teacher samples"] = (ro.input_ids, ro.attention_mask, ro.response_mask)
        sets["random rows, 16 x 64"] = _rows(B=16, S=64, seed=5)
        for name, (ids, am, rm) in sets.items():
            keep = _keep(rm)
            with RemoteTeacher(url_vllm) as v, RemoteTeacher(url_hf) as h:
                v.fetch_info()
                got = v.score(Rows(ids, am, rm), ScoreRequest(k=args.k, sampled=True))
                ref = h.score(Rows(ids, am, rm), ScoreRequest(k=args.k, sampled=True))
            dt = (got.topk.logprobs[keep] - ref.topk.logprobs[keep]).abs()
            ds = (got.sampled_logprobs[keep] - ref.sampled_logprobs[keep]).abs()
            same = (got.topk.ids[keep] == ref.topk.ids[keep]).float().mean().item()
            print(f"{name}: {int(keep.sum())} scored positions; top-{args.k} max {dt.max():.2g} "
                  f"(mean {dt.mean():.2g}); next-token max {ds.max():.2g} (mean {ds.mean():.2g}); "
                  f"top-{args.k} ids equal {100 * same:.2f}%")
    finally:
        for proc, _ in procs:
            _stop(proc)


if __name__ == "__main__":
    main()
