"""The cost of a cross-tokenizer teacher (SPEC 6.6): one training step's teacher request on the demo's rows (32
prompts x 4 samples, the character-level demo student's own samples), scored by

- ``same``: the character-level demo teacher in process (LocalTeacher: its top-8 and the sampled token);
- ``bpm``: the byte-level BPE demo teacher through CrossTokenizerTeacher (``xtok.mode bpm``, its whole 320-id
  vocabulary): the rows re-tokenized (each response and each of its prefixes, for the context back-off), the
  teacher's forward, the byte-prefix mapping onto the student's characters;
- ``sampled``: the same teacher in the fallback mode (its log-prob of the student's token at exact positions);

each part timed on its own (re-tokenizing, the forward, the mapping), the configurations interleaved, medians of
``--repeats`` rounds after one warm-up, one process, ``--threads`` torch threads.

    PYTHONPATH=. python benchmarks/bench_xtok.py [--repeats 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from opdistill.data import CarryAdditionTask, render_prompt
from opdistill.engines.rollout import generate_rollouts
from opdistill.models import load_model, load_tokenizer, resolve_model_path
from opdistill.teachers import LocalTeacher, Rows, ScoreRequest
from opdistill.teachers.xtok import CrossTokenizerTeacher
from opdistill.xtok import map_rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s_tok = load_tokenizer(resolve_model_path("builtin:demo-student"))
    student = load_model(resolve_model_path("builtin:demo-student"))
    same = LocalTeacher(load_model(resolve_model_path("builtin:demo-teacher")))
    bpe_path = resolve_model_path("builtin:demo-teacher-bpe")
    inner = LocalTeacher(load_model(bpe_path))
    t_tok = load_tokenizer(bpe_path)
    bpm = CrossTokenizerTeacher(inner, s_tok, t_tok, teacher_topk=len(t_tok), teacher_width=len(t_tok))
    fallback = bpm.with_mode("sampled")
    rng = random.Random(0)
    problems = [CarryAdditionTask().sample(rng) for _ in range(32)]
    ro = generate_rollouts(student, s_tok, [render_prompt(s_tok, p.prompt) for p in problems], n=4,
                           temperature=1.0, max_new_tokens=64, seed=0, step=1)
    rows = Rows(ro.input_ids, ro.attention_mask, ro.response_mask,
                prompts=tuple(problems[i].prompt for i in ro.prompt_index))
    positions = int(rows.scored().sum())

    def parts(teacher, request):
        t0 = time.perf_counter()
        t_rows, texts, spans = teacher.teacher_rows(rows)
        t1 = time.perf_counter()
        got = teacher.inner.score(t_rows, ScoreRequest(k=teacher.teacher_topk, sampled=True))
        t2 = time.perf_counter()
        map_rows(teacher.vmap, texts, *teacher.candidates(got, texts, spans), k=request.k, mode=teacher.mode)
        t3 = time.perf_counter()
        return {"re-tokenize": t1 - t0, "teacher forward": t2 - t1, "mapping": t3 - t2, "total": t3 - t0}

    def plain(teacher, request):
        t0 = time.perf_counter()
        teacher.score(rows, request)
        t = time.perf_counter() - t0
        return {"re-tokenize": 0.0, "teacher forward": t, "mapping": 0.0, "total": t}

    configs = {"same (char teacher, top-8)": lambda: plain(same, ScoreRequest(k=8, sampled=True)),
               "bpm (BPE teacher, top-8)": lambda: parts(bpm, ScoreRequest(k=8, sampled=True)),
               "sampled fallback (BPE teacher)": lambda: parts(fallback, ScoreRequest(sampled=True))}
    times = {name: [] for name in configs}
    for r in range(args.repeats + 1):
        for name, fn in configs.items():
            got = fn()
            if r:
                times[name].append(got)
    print(f"{rows.num_rows} rows, {positions} scored positions, torch threads {args.threads}, median of "
          f"{args.repeats}")
    print("| teacher request | re-tokenize (ms) | teacher forward (ms) | mapping (ms) | total (ms) | vs same |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(t["total"] for t in times["same (char teacher, top-8)"])
    for name, ts in times.items():
        med = {k: statistics.median(t[k] for t in ts) * 1e3 for k in ts[0]}
        print(f"| {name} | {med['re-tokenize']:.0f} | {med['teacher forward']:.0f} | {med['mapping']:.0f} | "
              f"{med['total']:.0f} | {med['total'] / (base * 1e3):.2f}x |")


if __name__ == "__main__":
    main()
