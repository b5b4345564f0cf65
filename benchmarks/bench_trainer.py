"""opdistill's trainer against TRL's DistillationTrainer on identical work (issue 10 item 1; docs/performance.md).

The work: a tiny random-init Qwen2 teacher (4 layers, hidden 128) and student (2 layers, hidden 64) over a
character-level vocabulary of 128 tokens, 512 prompts ``abc+def=`` (3-digit additions, 8 tokens each), 16 prompts
per step, one sample each, exactly 32 completion tokens per sample (EOS masked before 32, stop at 32), lr 1e-6,
reverse KL (TRL's default ``beta=1.0``), 2 warm-up steps then ``--steps`` timed steps, no evaluation, no checkpoint,
no TensorBoard, no progress bar. opdistill runs at K = 128 (the full vocabulary) and K = 8 (top-k with the tail);
TRL 1.16's DistillationTrainer has no top-k: it always matches the full vocabulary (its chunked generalized JSD),
so it runs once per repeat and both opdistill rows compare against it.

Every configuration runs in a fresh process (``--child``), the configurations interleaved (the order rotates each
repeat), and the driver waits for a quiet machine before each run (CPU busy fraction from /proc/stat under
``--quiet-busy`` for 3 s in a row, or ``--quiet-timeout`` seconds, after which the run is marked noisy). Reported:
medians [min-max] over the repeats of steps/s and completion tokens/s (timed window: end of the last warm-up step to
end of the last step), peak RSS of the child (``os.wait4``'s rusage), and a per-phase breakdown in ms/step:
sampling, teacher, student forward, loss, backward, optimizer, and the rest of the loop (the step time minus those).

The assets (tokenizer, models, prompts) are built deterministically into ``--out/assets`` by the driver (with this
interpreter); TRL's side runs in ``--trl-python`` (a separate venv: ``python3 -m venv /work/venv-trl &&
/work/venv-trl/bin/pip install torch==2.13.0 trl==1.16.0``); without it (or when that interpreter cannot import
trl) only opdistill runs.

    PYTHONPATH=. python benchmarks/bench_trainer.py --trl-python /work/venv-trl/bin/python --repeats 3
    PYTHONPATH=. python benchmarks/bench_trainer.py --repeats 1 --steps 3 --quiet-timeout 5   # smoke test

The child code for TRL imports only torch / transformers / datasets / trl (never opdistill).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = 512
PER_STEP = 16
COMPLETION = 32
LR = 1e-6
SEED = 0
TEACHER = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, seed=11)
STUDENT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, seed=12)
PHASES = ("sampling", "teacher", "student_fwd", "loss", "backward", "optimizer", "loop_rest")


# ---------------------------------------------------------------------------------------------------------------------
# Assets (driver side, deterministic)

def _char_vocab() -> dict:
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)]  # printable ASCII: 95
    extra = [f"<extra_{i}>" for i in range(128 - len(specials) - len(chars))]  # up to 128 ids, never in text
    return {t: i for i, t in enumerate(specials + chars + extra)}


def build_assets(folder: Path) -> dict:
    """Tokenizer + teacher + student (each model folder holds the tokenizer too) and prompts.jsonl, idempotent."""
    import random

    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    folder.mkdir(parents=True, exist_ok=True)
    vocab = _char_vocab()
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", padding_side="left")
    assert len(tok) == 128, len(tok)
    for name, spec in (("teacher", TEACHER), ("student", STUDENT)):
        spec = dict(spec)
        seed = spec.pop("seed")
        cfg = Qwen2Config(vocab_size=128, max_position_embeddings=128, num_key_value_heads=spec["num_attention_heads"],
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          tie_word_embeddings=False, **spec)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(cfg)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(folder / name, safe_serialization=True)
        tok.save_pretrained(folder / name)
    rng = random.Random(SEED)
    rows = []
    for _ in range(PROMPTS):
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != "config.json" and "tokenizer" not in p.name:  # version-stamped files
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + p.read_bytes())
    return {"assets_sha256": h.hexdigest()}


# ---------------------------------------------------------------------------------------------------------------------
# Timing helpers shared by both children (stdlib + torch only)

class PhaseClock:
    """Seconds per phase per step: ``with clock("loss"): ...`` adds to the current step's phase."""

    def __init__(self):
        self.steps: list[dict] = []
        self.current: dict = {}
        self.active = False  # inside the update (student forward / backward hooks count only there)

    def add(self, phase: str, seconds: float) -> None:
        self.current[phase] = self.current.get(phase, 0.0) + seconds

    def wrap(self, phase: str, fn, when=None):
        def timed(*a, **k):
            if when is not None and not when(*a, **k):
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(phase, time.perf_counter() - t0)
        return timed

    def end_step(self, t_end: float, tokens: float) -> None:
        self.current["t_end"], self.current["tokens"] = t_end, tokens
        self.steps.append(self.current)
        self.current = {}


def _install_common_hooks(clock: PhaseClock, torch) -> None:
    """Optimizer step (global hooks: every optimizer) and backward (inside the update only)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    starts = {}
    register_optimizer_step_pre_hook(lambda opt, a, k: starts.__setitem__(id(opt), time.perf_counter()))
    register_optimizer_step_post_hook(lambda opt, a, k: clock.add("optimizer", time.perf_counter() - starts[id(opt)]))
    torch.Tensor.backward = clock.wrap("backward", torch.Tensor.backward)


def _time_module_forward(clock: PhaseClock, module, phase: str):
    """Forward hooks on ``module`` that add its forward time to ``phase``; returns a function removing them. opdistill's
    child installs them for the update only: a hooked model samples through its own forward (its lean decode step
    runs only on hook-free models, engines/sampler.py), so hooks left on during sampling would time another sampler
    than the trainer runs."""
    starts = []

    def pre(mod, args):
        starts.append(time.perf_counter())

    def post(mod, args, out):
        if starts:
            clock.add(phase, time.perf_counter() - starts.pop())

    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return lambda: [h.remove() for h in handles]


def _summarize(clock: PhaseClock, warmup: int, t_warm_end: float) -> dict:
    timed = clock.steps[warmup:]
    wall = timed[-1]["t_end"] - t_warm_end
    n = len(timed)
    out = {"steps": n, "wall_s": wall, "steps_per_s": n / wall,
           "tokens_per_s": sum(s["tokens"] for s in timed) / wall,
           "tokens_per_step": sum(s["tokens"] for s in timed) / n}
    prev = t_warm_end
    rest = []
    for s in timed:
        step_s = s["t_end"] - prev
        prev = s["t_end"]
        rest.append(step_s - sum(s.get(p, 0.0) for p in PHASES[:-1]))
    for p in PHASES[:-1]:
        out[f"ms/{p}"] = 1e3 * sum(s.get(p, 0.0) for s in timed) / n
    out["ms/loop_rest"] = 1e3 * sum(rest) / n
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Children

def child_opdistill(args) -> dict:
    import warnings

    import torch

    sys.path.insert(0, str(ROOT))
    warnings.filterwarnings("ignore")
    import opdistill.train.loop as loop
    from opdistill import DistillationLoss
    from opdistill.train.run.config import load_config

    assets = Path(args.assets)
    run_dir = Path(args.run_dir)
    overrides = [
        f"run_dir={run_dir}", f"model.student={assets / 'student'}", f"model.teacher={assets / 'teacher'}",
        "data.task=dataset", f"data.path={assets / 'prompts.jsonl'}", "data.use_chat_template=false",
        f"data.prompts_per_step={PER_STEP}", "rollout.n=1", "rollout.temperature=1.0",
        f"rollout.min_new_tokens={COMPLETION}", f"rollout.max_new_tokens={COMPLETION}",
        "loss.loss_mode=topk", f"loss.topk={args.k}", "loss.support=tail", "loss.divergence=reverse",
        f"optim.lr={LR}", "optim.schedule=constant", "optim.warmup_steps=0",
        f"train.steps={args.warmup + args.steps}", f"train.seed={SEED}",
        "eval.num_prompts=0", "eval.every=0", "checkpoint.every=0", "checkpoint.save_final=false",
        "log.tensorboard=false", "log.progress=false",
    ]
    if args.threads:
        overrides.append(f"train.threads={args.threads}")
    cfg = load_config(None, overrides=overrides + list(args.set or []))
    clock = PhaseClock()
    _install_common_hooks(clock, torch)
    tok, student, teacher = loop.load_models(cfg)

    from opdistill.train.steps.collect import Collector

    real_collect, real_step = Collector.__call__, loop.train_step

    def collect(*a, **k):
        data, metrics = real_collect(*a, **k)
        clock.add("sampling", metrics["time/rollout_s"])
        clock.add("teacher", metrics["time/teacher_s"])
        clock.current["_tokens"] = metrics["train/generated_tokens"]
        return data, metrics

    def train_step(*a, **k):
        clock.active = True
        remove = _time_module_forward(clock, student, "student_fwd")  # the update only, never during sampling
        try:
            return real_step(*a, **k)
        finally:
            remove()
            clock.active = False

    Collector.__call__, loop.train_step = collect, train_step
    DistillationLoss.__call__ = clock.wrap("loss", DistillationLoss.__call__)
    from opdistill.train.disk.logger import RunLogger

    real_advance = RunLogger.advance

    def advance(self, *args):
        real_advance(self, *args)
        clock.end_step(time.perf_counter(), clock.current.pop("_tokens", 0.0))

    RunLogger.advance = advance
    import opdistill.engines.sampler as sampler_mod  # record whether every rollout took the lean decode step

    real_lean, lean_used = sampler_mod._lean_decoder, []

    def lean_decoder(model):  # keeps a bool, not the decoder (it holds the KV cache)
        decoder = real_lean(model)
        lean_used.append(decoder is not None)
        return decoder

    sampler_mod._lean_decoder = lean_decoder
    loop.run_training(cfg, overwrite=True, models=(tok, student, teacher), quiet=True)
    return {**_summarize(clock, args.warmup, clock.steps[args.warmup - 1]["t_end"]),
            "sampler_lean_decode": bool(lean_used) and all(lean_used)}


def child_trl(args) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, logging as hf_logging

    import trl
    import trl.trainer.distillation_trainer as dt
    from trl import DistillationConfig, DistillationTrainer

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    assets = Path(args.assets)
    tok = AutoTokenizer.from_pretrained(assets / "student")
    tok.padding_side = "left"
    student = AutoModelForCausalLM.from_pretrained(assets / "student", dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(assets / "teacher", dtype=torch.float32)
    prompts = [json.loads(line)["prompt"] for line in (assets / "prompts.jsonl").read_text().splitlines()]
    total = args.warmup + args.steps
    config = DistillationConfig(
        output_dir=str(Path(args.run_dir)), use_cpu=True, seed=SEED, bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=PER_STEP, gradient_accumulation_steps=1,
        max_steps=total, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_completion_length=COMPLETION, generation_kwargs={"min_new_tokens": COMPLETION},
        temperature=1.0, top_p=1.0, top_k=0, beta=1.0,  # beta=1: reverse KL, as opdistill's divergence=reverse
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
    )
    clock = PhaseClock()
    _install_common_hooks(clock, torch)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    real_gen = trainer._generate_and_score_completions

    def gen(inputs):
        t0 = time.perf_counter()
        out = real_gen(inputs)
        clock.add("sampling", time.perf_counter() - t0)
        clock.current["_tokens"] = float(out["completion_mask"].sum())
        return out

    trainer._generate_and_score_completions = gen
    real_hidden = trainer._get_last_hidden_state

    def hidden(model, *a, **k):
        t0 = time.perf_counter()
        try:
            return real_hidden(model, *a, **k)
        finally:
            clock.add("teacher" if model is teacher else "student_fwd", time.perf_counter() - t0)

    trainer._get_last_hidden_state = hidden
    dt._chunked_divergence_loss = clock.wrap("loss", dt._chunked_divergence_loss)

    class Steps(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            clock.end_step(time.perf_counter(), clock.current.pop("_tokens", 0.0))

    trainer.add_callback(Steps())
    trainer.train()
    out = _summarize(clock, args.warmup, clock.steps[args.warmup - 1]["t_end"])
    out["trl_version"] = trl.__version__
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Driver

def _cpu_busy(interval: float = 1.0) -> float:
    def read():
        vals = [int(v) for v in open("/proc/stat").readline().split()[1:]]
        return sum(vals), vals[3] + (vals[4] if len(vals) > 4 else 0)  # total, idle + iowait

    t0, i0 = read()
    time.sleep(interval)
    t1, i1 = read()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(threshold: float, timeout: float) -> dict:
    """Block until the machine's CPU busy fraction stays under ``threshold`` for 3 s in a row (or ``timeout``)."""
    start, calm = time.time(), 0
    busy = 1.0
    while time.time() - start < timeout:
        busy = _cpu_busy()
        calm = calm + 1 if busy < threshold else 0
        if calm >= 3:
            return {"quiet": True, "waited_s": round(time.time() - start, 1), "busy": round(busy, 3),
                    "loadavg": open("/proc/loadavg").read().split()[0]}
    return {"quiet": False, "waited_s": round(time.time() - start, 1), "busy": round(busy, 3),
            "loadavg": open("/proc/loadavg").read().split()[0]}


def _spawn_and_measure(cmd, env):
    """Run ``cmd``; return (returncode, stdout, stderr, peak RSS MiB of that child alone, via os.wait4)."""
    import tempfile

    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        proc = subprocess.Popen(cmd, env=env, stdout=fo, stderr=fe)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        fo.seek(0)
        fe.seek(0)
        return proc.returncode, fo.read().decode(), fe.read().decode(), usage.ru_maxrss / 1024


def _fmt(values, digits=2) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def print_table(results: list[dict]) -> str:
    labels = []
    for r in results:
        if r["label"] not in labels:
            labels.append(r["label"])
    trl_tps = [r["tokens_per_s"] for r in results if r["kind"] == "trl"]
    lines = ["| configuration | steps/s | completion tokens/s | vs TRL (tokens/s, medians) | peak RSS MiB | "
             + " | ".join(f"{p} ms" for p in PHASES) + " |",
             "|---|---|---|---|---|" + "---|" * len(PHASES)]
    for label in labels:
        rs = [r for r in results if r["label"] == label]
        tps = [r["tokens_per_s"] for r in rs]
        ratio = f"{statistics.median(tps) / statistics.median(trl_tps):.2f}x" if trl_tps else "-"
        phases = " | ".join(_fmt([r[f"ms/{p}"] for r in rs], 1) for p in PHASES)
        lines.append(f"| {label} (n={len(rs)}) | {_fmt([r['steps_per_s'] for r in rs])} | {_fmt(tps, 0)} | {ratio} | "
                     f"{_fmt([r['peak_rss_mib'] for r in rs], 0)} | {phases} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/opdistill-bench-trainer"), help="assets, runs, results")
    ap.add_argument("--trl-python", default=None, help="an interpreter that can import trl (its own venv)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ks", default="128,8", help="opdistill's top-k values (128 = the full vocabulary)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in every child (default: torch's)")
    ap.add_argument("--set", action="append", help="extra opdistill config override (dotted key=value)")
    ap.add_argument("--quiet-busy", type=float, default=0.15, help="CPU busy fraction that counts as quiet")
    ap.add_argument("--quiet-timeout", type=float, default=600.0, help="seconds to wait for quiet before a run")
    ap.add_argument("--child", choices=["opdistill", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--assets", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=128, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")

    if args.child:
        result = child_opdistill(args) if args.child == "opdistill" else child_trl(args)
        print(json.dumps(result))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    meta = build_assets(args.out / "assets")
    configs = [("opdistill", k, f"opdistill K={k}") for k in (int(x) for x in args.ks.split(","))]
    if args.trl_python:
        check = subprocess.run([args.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True)
        if check.returncode == 0:
            configs.insert(1, ("trl", None, f"TRL {check.stdout.decode().strip()} (full vocabulary)"))
        else:
            print(f"--trl-python {args.trl_python}: cannot import trl; running opdistill only", file=sys.stderr)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    results = []
    for rep in range(args.repeats):
        order = configs[rep % len(configs):] + configs[: rep % len(configs)]  # rotate: no fixed position
        for kind, k, label in order:
            quiet = wait_quiet(args.quiet_busy, args.quiet_timeout)
            python = sys.executable if kind == "opdistill" else args.trl_python
            cmd = [python, str(Path(__file__).resolve()), "--child", kind, "--assets", str(args.out / "assets"),
                   "--run-dir", str(args.out / "runs" / (f"{kind}-k{k}-{rep}" if k else f"{kind}-{rep}")), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--k", str(k or 0)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            for s in args.set or []:
                cmd += ["--set", s]
            rc, out, err, rss = _spawn_and_measure(cmd, env)
            if rc != 0:
                print(f"{label} (repeat {rep}) failed with exit {rc}:\n{err[-4000:]}", file=sys.stderr)
                return 1
            r = {**json.loads(out.strip().splitlines()[-1]), "peak_rss_mib": rss, "kind": kind, "k": k,
                 "label": label, "repeat": rep, **quiet}
            results.append(r)
            print(f"[{rep}] {label}: {r['steps_per_s']:.2f} steps/s, {r['tokens_per_s']:.0f} tokens/s, "
                  f"{rss:.0f} MiB{'' if quiet['quiet'] else ' (machine not quiet: busy ' + str(quiet['busy']) + ')'}",
                  flush=True)
    table = print_table(results)
    print()
    print(table)
    import platform

    import torch

    summary = {"meta": {**meta, "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
                        "threads": args.threads or f"torch default ({torch.get_num_threads()} here)",
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count(),
                        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                        "prompts_per_step": PER_STEP, "completion_tokens": COMPLETION, "lr": LR},
               "results": results, "table": table}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"\nraw results: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
