"""Command line: ``opdistill train | demo | eval | compare | plot | score | export | serve-teacher`` (``--help`` on each)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings

from opdistill.errors import ConfigError, UserError

__all__ = ["main"]


def _quiet_transformers():
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def _cmd_train(args):
    from opdistill.train import load_config, run_training
    from opdistill.train.preflight import check_model_folders

    from opdistill.train.inputs import parse_accept_changed

    accept = parse_accept_changed(args.accept_changed)
    if accept and not args.resume:
        raise ConfigError("--accept-changed: only with --resume (a fresh run records what it reads; a resumed one "
                          "compares it)")
    cfg = load_config(args.config, args.overrides)
    check_model_folders(cfg)
    summary = run_training(cfg, resume=args.resume, overwrite=args.overwrite, accept_changed=accept)
    if _rank() == 0:  # under torchrun, rank 0 alone reports
        print(json.dumps({"steps": summary["steps"], "train_time_s": round(summary["train_time_s"], 2),
                      "final_eval": summary["final_eval"]}, indent=1))


def _cmd_demo(args):
    from opdistill.demo import run_demo

    seeds = args.seeds
    run_demo(args.out, budget_s=args.budget_s, seeds=seeds, eval_every=args.eval_every,
             eval_prompts=args.eval_prompts, threads=args.threads)


def _cmd_eval(args):
    from contextlib import ExitStack

    from opdistill.runs.outputs import check_output_path, output_lock, write_output

    outputs = [(flag, path) for flag, path in (("--out", args.out), ("--values", args.values)) if path]
    if args.out and args.values and os.path.abspath(args.out) == os.path.abspath(args.values):
        raise ConfigError(f"--values: {args.values} is also --out; give the report and the values two files")
    for flag, path in outputs:  # before any work: an output in a run's entries, or one another process writes
        check_output_path(path, flag)
    with ExitStack() as stack:
        for flag, path in outputs:
            stack.enter_context(output_lock(path, flag))
        _eval(args, write_output)


def _eval(args, write_output):
    from pathlib import Path

    import torch

    from opdistill.data import PromptSource
    from opdistill.models import resolve_model_path
    from opdistill.runs.values import nest_intervals
    from opdistill.teachers import TeacherContext, build_teacher
    from opdistill.train import load_config
    from opdistill.train.checkpoint import load_weights, resume_checkpoint
    from opdistill.train.loop import build_task, load_models, run_eval
    from opdistill.train.preflight import check_against_models, check_model_folders

    from opdistill.train.inputs import check_inputs, local_inputs, parse_accept_changed, remote_inputs

    config, overrides, ckpt = args.config, list(args.overrides), args.checkpoint
    accept, run_dir = parse_accept_changed(args.accept_changed), None
    if config is None:  # opdistill eval RUN_DIR [overrides]: the run's resolved config, its newest checkpoint
        if not overrides or "=" in overrides[0]:
            raise ConfigError("eval: expected a RUN_DIR (a folder holding config.yaml) or --config FILE")
        run_dir = Path(overrides.pop(0))
        config = run_dir / "config.yaml"
        if not config.is_file():
            raise ConfigError(f"{run_dir}: no config.yaml (expected a run directory, or pass --config FILE)")
        overrides.insert(0, f"run_dir={run_dir}")
        if ckpt is None and (run_dir / "checkpoints").is_dir():
            ckpt = "latest"
    if accept and run_dir is None:
        raise ConfigError("--accept-changed: only with a RUN_DIR (the run whose record of its inputs is compared)")
    cfg = load_config(config, overrides)
    check_model_folders(cfg)
    if run_dir is not None:  # the student, teacher and data files against the run's record (train/inputs.py)
        check_inputs(run_dir, local_inputs(cfg), accept, what="eval")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    tok, student, teacher = load_models(cfg)
    if ckpt == "latest":
        ckpt = resume_checkpoint(cfg.run_dir)
    if ckpt:
        load_weights(ckpt, student)  # the weights only (safetensors, verified): never the trainer state
    task = build_task(cfg)
    check_against_models(cfg, tok, student, teacher, task, training=False)  # K, lengths: before generating
    held_out = PromptSource(task, cfg.train.seed, cfg.data.eval_seed).held_out(cfg.eval.num_prompts)
    models = {} if teacher is None else {"model.teacher": teacher}
    teachers = build_teacher(cfg, TeacherContext(tokenizer=tok, student=student, models=models,
                                                 resolve=resolve_model_path), train=False)
    try:
        if run_dir is not None:  # a teacher server against the run's record
            check_inputs(run_dir, remote_inputs(cfg, teachers), accept, what="eval")
        metrics = run_eval(cfg, tok, student, teachers.eval, task, held_out,
                           values_path=Path(args.values) if args.values else None)
    finally:
        teachers.close()
    report = {"checkpoint": str(ckpt) if ckpt else None, "num_problems": len(held_out),
              "num_samples": cfg.eval.num_samples, "bootstrap_resamples": cfg.eval.bootstrap_resamples,
              "level": 0.95, "metrics": nest_intervals(metrics)}
    text = json.dumps(report, indent=1)
    if args.out:
        write_output(args.out, text + "\n")
    print(text)


def _cmd_compare(args):
    from opdistill.runs.compare import compare

    res = compare(args.run_dirs, out=args.out, metrics=args.metric or None, baseline=args.baseline)
    print(res["table"])
    print(f"\nfigure: {res['png']}")


def _cmd_plot(args):
    from opdistill.runs.plot import plot_run

    print(plot_run(args.run_dir, args.out))


def _cmd_score(args):
    from opdistill.runs.outputs import check_output_path, output_lock

    if os.path.isdir(args.out):
        raise ConfigError(f"--out: {args.out} is a folder; give the cache file's path (e.g. {args.out}/cache.safetensors)")
    check_output_path(args.out, "--out")
    with output_lock(args.out, "--out"):
        _score(args)


def _score(args):
    import torch

    from opdistill.data import PromptSource, render_prompt
    from opdistill.engines.rollout import generate_rollouts
    from opdistill.teachers import LocalTeacher, Rows, ScoreRequest, save_cache
    from opdistill.train import load_config
    from opdistill.train.loop import build_task, load_models
    from opdistill.train.preflight import check_against_models, check_model_folders

    cfg = load_config(args.config, args.overrides)
    check_model_folders(cfg)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    tok, student, teacher = load_models(cfg)
    if teacher is None:
        raise ConfigError("model.teacher: expected a model folder to score with, got None")
    task = build_task(cfg)
    check_against_models(cfg, tok, student, teacher, task, training=False)  # K, lengths: before generating
    problems = PromptSource(task, cfg.train.seed).batch(0, args.num_prompts)
    prompts = [render_prompt(tok, p.prompt, use_chat_template=cfg.data.use_chat_template) for p in problems]
    writer = teacher if args.writer == "teacher" else student
    torch.manual_seed(cfg.train.seed)
    ro = generate_rollouts(writer, tok, prompts, n=cfg.rollout.n, temperature=cfg.rollout.temperature,
                           top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                           min_new_tokens=cfg.rollout.min_new_tokens, batch_size=cfg.rollout.batch_size,
                           seed=cfg.train.seed, step=0)
    scores = LocalTeacher(teacher).score(Rows(ro.input_ids, ro.attention_mask, ro.response_mask),
                                         ScoreRequest(k=cfg.loss.topk, sampled=True, what="opdistill score"))
    path = save_cache(args.out, input_ids=ro.input_ids, attention_mask=ro.attention_mask,
                      response_mask=ro.response_mask, scores=scores, teacher=teacher, tokenizer=tok,
                      logprob_dtype=torch.float16 if args.fp16 else torch.float32)
    print(f"wrote {ro.num_rows} scored rows ({int(ro.response_mask.sum())} response tokens) to {path}")


def _cmd_export(args):
    from opdistill.train.export import export_run
    from opdistill.train.inputs import parse_accept_changed

    accept = parse_accept_changed(args.accept_changed)
    print(f"wrote {export_run(args.run_dir, args.out, checkpoint=args.checkpoint, accept_changed=accept)}")


def _cmd_serve_teacher(args):
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"serve-teacher needs the serve extra ({e.name} is missing): pip install 'opdistill[serve]'")
    from opdistill.serve import serve

    serve(args.model, engine=args.engine, host=args.host, port=args.port, token_file=args.token_file,
          max_batch_tokens=args.max_batch_tokens, max_request_tokens=args.max_request_tokens, max_k=args.max_k,
          dtype=args.dtype, trust_remote_code=args.trust_remote_code, threads=args.threads,
          max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
          header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s)


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number in [1, 65535], got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [1, 65535], got {value}")
    return value


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0 (e.g. 0,1), got {text!r}") from None
    if any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0 (e.g. 0,1), got {text!r}")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opdistill", description="Exact, memory-lean on-policy distillation.")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (default: one line)")
    sub = p.add_subparsers(dest="command", required=True)
    # accepted after the command too; SUPPRESS keeps the top-level value when it is not given there
    sub_add = sub.add_parser

    def add_parser(*a, **k):
        sp = sub_add(*a, **k)
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        return sp

    sub.add_parser = add_parser

    t = sub.add_parser("train", help="train a student (on-policy distillation, off-policy KD or RL)",
                       description="Train from a YAML config; dotted.key=value arguments override it "
                                   "(unknown keys are errors). Example: opdistill train --config "
                                   "configs/demo_carry_add.yaml train.steps=50 optim.lr=1e-3")
    t.add_argument("--config", required=True, help="YAML config file")
    t.add_argument("--resume", action="store_true", help="continue exactly from the run's newest intact checkpoint")
    t.add_argument("--overwrite", action="store_true", help="delete the run already in run_dir and start a new one")
    t.add_argument("--accept-changed", action="append", default=None, metavar="NAMES",
                   help="with --resume: input names (model.student, teacher, teachers.NAME, data.path, ...) whose "
                        "change since the run started is accepted and recorded (repeatable or comma-separated; "
                        "default: a change is refused with its diff)")
    t.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    t.set_defaults(fn=_cmd_train)

    d = sub.add_parser("demo", help="compare on-policy distillation, off-policy KD and RL on a toy task",
                       description="Runs on a laptop CPU in about 10 minutes, prints a table (saved to OUT) and draws "
                                   "OUT/demo.png.")
    d.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    d.add_argument("--budget-s", type=float, default=60.0, help="training seconds per method and seed (default 60)")
    d.add_argument("--seeds", type=_seeds, default=(0, 1), help="comma-separated seeds (default 0,1)")
    d.add_argument("--eval-every", type=_int_at_least(1), default=20, help="evaluate every N steps (default 20)")
    d.add_argument("--eval-prompts", type=_int_at_least(1), default=200, help="held-out problems (default 200)")
    d.add_argument("--threads", type=_int_at_least(1), default=None, help="torch threads (default 1: fastest for these tiny models)")
    d.set_defaults(fn=_cmd_demo)

    e = sub.add_parser("eval", help="evaluate a student (or a checkpoint) on held-out prompts",
                       description="Greedy and sampled verifier accuracy, teacher-KL, overlap and masses.")
    e.add_argument("--config", default=None, help="YAML config (default: RUN_DIR/config.yaml)")
    e.add_argument("--checkpoint", default=None,
                   help="checkpoint folder (its weights only), or 'latest' for the run's newest intact one "
                        "(default: 'latest' with RUN_DIR when it has checkpoints, else the configured student)")
    e.add_argument("--out", default=None, help="also write the JSON report to this file")
    e.add_argument("--values", default=None,
                   help="also write the per-problem values (JSON) to this file, for paired comparisons")
    e.add_argument("--accept-changed", action="append", default=None, metavar="NAMES",
                   help="with RUN_DIR: input names whose change since the run started is accepted (default: refused "
                        "with its diff)")
    e.add_argument("overrides", nargs="*", metavar="[RUN_DIR] overrides",
                   help="a run directory (without --config), then dotted.key=value overrides")
    e.set_defaults(fn=_cmd_eval)

    c = sub.add_parser("compare", help="compare runs: final metrics with intervals, evaluation curves in a PNG",
                       description="One markdown table (final held-out metrics with 95% intervals; runs whose "
                                   "configs differ only by seed are grouped, with a mean row) and one PNG of the "
                                   "evaluation curves vs step and vs training time with interval bands.")
    c.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    c.add_argument("--out", default=None, help="PNG path (default FIRST_RUN_DIR/compare.png)")
    c.add_argument("--baseline", default=None,
                   help="per-problem values (opdistill eval --values) of the start the runs share: the paired "
                        "change is measured from it (default: each run's first evaluation)")
    c.add_argument("--metric", action="append", default=None,
                   help="metric to show (repeatable; default the eval accuracy and teacher-KL metrics present)")
    c.set_defaults(fn=_cmd_compare)

    pl = sub.add_parser("plot", help="plot a run's metrics to a PNG",
                        description="Loss, teacher-KL, overlap ratio, masses and accuracy against step.")
    pl.add_argument("run_dir")
    pl.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    pl.set_defaults(fn=_cmd_plot)

    s = sub.add_parser("score", help="teacher-score generated responses into a safetensors cache",
                       description="Generate rollout.n responses for --num-prompts prompts (by the teacher or the "
                                   "student) and write teacher top-k and sampled-token log-probs to --out.")
    s.add_argument("--config", required=True)
    s.add_argument("--out", required=True, help="cache file (.safetensors)")
    s.add_argument("--num-prompts", type=_int_at_least(1), default=64)
    s.add_argument("--writer", choices=["teacher", "student"], default="teacher")
    s.add_argument("--fp16", action="store_true", help="store log-probs in float16 (default float32)")
    s.add_argument("overrides", nargs="*")
    s.set_defaults(fn=_cmd_score)

    x = sub.add_parser("export", help="write a run's student as a plain transformers folder (LoRA merged)",
                       description="safetensors weights (LoRA adapters merged), config, generation config and "
                                   "tokenizer: loadable by AutoModelForCausalLM.from_pretrained and vLLM.")
    x.add_argument("run_dir")
    x.add_argument("--checkpoint", default="latest",
                   help="'latest' (the newest intact checkpoint, default) or a checkpoint folder")
    x.add_argument("--out", required=True, help="output folder (new, or empty)")
    x.add_argument("--accept-changed", action="append", default=None, metavar="NAMES",
                   help="model.student: accept a student folder (a LoRA run's base) changed since the run started "
                        "(default: refused with its diff)")
    x.set_defaults(fn=_cmd_export)
    st = sub.add_parser("serve-teacher", help="serve a teacher's scores over HTTP (trainers use teacher.url)",
                        description="Score rows for remote trainers: GET /health, GET /info, POST /v1/score (JSON "
                                    "or the compact binary payload). Binds 127.0.0.1 unless told; any other address "
                                    "needs --token-file. See docs/teacher_service.md.")
    st.add_argument("--model", required=True, help="teacher model folder (or builtin:demo-teacher)")
    st.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                    help="scoring engine: hf (transformers, default) or vllm (vLLM in this process: temperature 1, "
                         "no requested ids; docs/teacher_service.md)")
    st.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    st.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    st.add_argument("--token-file", default=None, help="file holding the bearer token clients must send")
    st.add_argument("--max-batch-tokens", type=int, default=65536,
                    help="merge concurrent requests up to this many rows x positions (default 65536)")
    st.add_argument("--max-request-tokens", type=int, default=262144,
                    help="refuse (413) a request above this many rows x positions (default 262144)")
    st.add_argument("--max-k", type=int, default=64, help="largest top-K a client may ask (default 64)")
    st.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    st.add_argument("--threads", type=_int_at_least(1), default=None, help="torch threads (default: torch's)")
    st.add_argument("--trust-remote-code", action="store_true", help="allow the model folder's own code (off)")
    st.add_argument("--max-model-len", type=int, default=None,
                    help="vllm engine: the longest row it takes (default: the model's context length)")
    st.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="vllm engine on GPU: the share of GPU memory it takes (default 0.9)")
    st.add_argument("--header-timeout-s", type=float, default=10.0,
                    help="close a connection whose request head has not arrived in this many seconds (default 10)")
    st.add_argument("--body-timeout-s", type=float, default=60.0,
                    help="answer 408 to a request whose body has not arrived in this many seconds (default 60)")
    st.set_defaults(fn=_cmd_serve_teacher)
    return p


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def _rank_tag() -> str:
    """``[rank R] `` under torchrun with more than one process (warnings and errors name the rank), else ""."""
    import os

    return f"[rank {_rank()}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def _one_line_warning(message, category, filename, lineno, line=None):
    return f"opdistill: {_rank_tag()}warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    """Run a command. A user error (:class:`opdistill.errors.UserError`: a config key, a data file, a model folder)
    prints one line and returns 2; ``--debug`` adds its traceback. Any other exception is a bug and propagates."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse hands a positional list only the values before the first flag: 'train --config C --resume a=1' must
    # read a=1 as an override too, not as an unrecognized argument
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _quiet_transformers()
    # the format, not the printer, is swapped: a caller that records warnings (pytest.warns) still records them
    formatwarning = warnings.formatwarning
    if not args.debug:
        warnings.formatwarning = _one_line_warning
    try:
        args.fn(args)
    except UserError as e:
        if args.debug:
            traceback.print_exc()
        print(f"opdistill {args.command}: {_rank_tag()}{e.kind}: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = formatwarning
    return 0


if __name__ == "__main__":
    sys.exit(main())
