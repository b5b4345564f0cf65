"""Command line: ``opdistill train | demo | eval | compare | plot | score | export | serve-teacher`` (``--help`` on each)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings

from opdistill.console import metrics_table, one_line_warning as _one_line_warning, quiet_transformers, rank as _rank
from opdistill.console import console_logging, rank_tag as _rank_tag, resume_advice as _resume_advice, train_report
from opdistill.errors import ConfigError, UserError, disk_error

__all__ = ["main"]


def _cmd_train(args):
    from opdistill.train import load_config, run_training
    from opdistill.train.disk.inputs import parse_accept_changed
    from opdistill.train.disk.preflight import check_model_folders

    accept = parse_accept_changed(args.accept_changed)
    if accept and not args.resume:
        raise ConfigError("--accept-changed: only with --resume (a fresh run records what it reads; a resumed one "
                          "compares it)")
    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        return _check(args, cfg)
    check_model_folders(cfg)
    try:
        summary = run_training(cfg, resume=args.resume, overwrite=args.overwrite,
                               accept_changed=accept)
    except BaseException as e:  # a failure in the loop or an abort: what was kept, the one command that continues
        if _rank() == 0 and (hasattr(e, "checkpoint") or isinstance(e, KeyboardInterrupt)):
            e.advice = _resume_advice(args, cfg.run_dir, getattr(e, "checkpoint", None))
        raise
    if _rank() != 0:  # under torchrun, rank 0 alone reports
        return 0
    if summary["stopped"]:
        print(f"opdistill train: stopped by {summary['stopped']} after step {summary['steps']} of "
              f"{cfg.train.steps}; {_resume_advice(args, cfg.run_dir, summary['checkpoint'])}", file=sys.stderr)
        return summary["exit_code"]
    print(train_report(summary, tensorboard=cfg.log.tensorboard, as_json=args.json))
    return 0


def _check(args, cfg) -> int:
    """``opdistill check`` / ``train --dry-run``: the resolved config (YAML), then every refusal that needs no
    weights (opdistill.train.assemble.check_run), and the run folder's state; nothing is written or loaded."""
    from pathlib import Path

    from opdistill.train.assemble import check_run
    from opdistill.train.disk.inputs import parse_accept_changed
    from opdistill.train.run.config import config_to_dict
    from opdistill.train.disk.preflight import check_model_folders
    from opdistill.yaml12 import dump_yaml

    print(dump_yaml(config_to_dict(cfg)).rstrip())  # reads back the same under YAML 1.1 and 1.2
    check_model_folders(cfg)
    nproc = getattr(args, "nproc", None)
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc: expected a number of processes >= 1, got {nproc}")
    resume = getattr(args, "resume", False)  # train --dry-run --resume: what the resume itself would refuse too
    found = check_run(cfg, nproc=nproc, resume_accept=parse_accept_changed(args.accept_changed) if resume else None)
    run_dir = Path(cfg.run_dir)
    if resume:
        said = "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in found["resume_changes"].items())
        where = f"--resume would continue run_dir {run_dir} from step {found['resume_step']}" + \
            (f", changing {said}" if said else "")
    elif (run_dir / "config.yaml").exists():
        where = f"run_dir {run_dir} holds a run: continue it with --resume, or replace it with --overwrite"
    else:
        where = f"run_dir {run_dir} is free"
    for key, t in [("teacher", cfg.teacher)] + [(f"teachers: {t.name}", t) for t in cfg.teachers or []]:
        if t.url is not None:  # how long a request may wait on a server that does not answer before it gives up
            from opdistill.teachers.http import MAX_BACKOFF_S, worst_case_s

            print(f"# {key}: a request gives up after at most {worst_case_s(t.timeout_s, t.retries, t.backoff_s):,.0f}"
                  f" s ({t.retries + 1} tries of up to {t.timeout_s:g} s, the waits between them doubling from "
                  f"{t.backoff_s:g} s to at most {MAX_BACKOFF_S:g} s)", file=sys.stderr)
    layout = f" as {nproc} processes (torchrun --nproc-per-node {nproc})" if nproc and nproc > 1 else ""
    print(f"# ok: the config, the model folders' metadata, the data ({found['held_out']} held-out problems) and "
          f"the teacher settings pass every check made before loading{layout}; {where}", file=sys.stderr)
    return 0


def _cmd_check(args):
    from opdistill.train import load_config

    return _check(args, load_config(args.config, args.overrides))


def _cmd_demo(args):
    from opdistill.demo import run_demo

    seeds = args.seeds
    run_demo(args.out or ("runs/demo_tools" if args.tools else "runs/demo"), budget_s=args.budget_s, seeds=seeds,
             eval_every=args.eval_every, eval_prompts=args.eval_prompts, threads=args.threads, tools=args.tools)


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
        return _eval(args, write_output)


def _eval(args, write_output):
    from pathlib import Path

    from opdistill.train import load_config
    from opdistill.train.commands import evaluate_run
    from opdistill.errors import RunError
    from opdistill.train.disk.checkpoint import list_checkpoints
    from opdistill.train.disk.inputs import parse_accept_changed

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
        if ckpt is None and not list_checkpoints(run_dir):  # never the untrained student in the run's name
            raise RunError(f"eval: {run_dir} holds no checkpoint (checkpoints/ is missing or empty), so there is no "
                           f"trained student to evaluate; evaluate the configured student, untrained, with "
                           f"--checkpoint student")
        ckpt = "latest" if ckpt is None else ckpt
    ckpt = None if ckpt == "student" else ckpt
    if accept and run_dir is None:
        raise ConfigError("--accept-changed: only with a RUN_DIR (the run whose record of its inputs is compared)")
    report = evaluate_run(load_config(config, overrides), checkpoint=ckpt, run_dir=run_dir, accept=accept,
                          values_path=Path(args.values) if args.values else None)
    return _print_eval(args, report, write_output)


def _print_eval(args, report, write_output) -> int:
    text = report.as_json()
    if args.out:
        write_output(args.out, text + "\n")  # locked, whole (opdistill.runs.outputs)
    if args.json:
        print(text)
        return 0
    print(f"checkpoint: {report.checkpoint or 'none (the configured student)'}; {report.num_problems} held-out "
          f"problems, {report.num_samples} sample(s) each; intervals: bootstrap over problems "
          f"({report.bootstrap_resamples} resamples)\n")
    print(metrics_table(report.metrics))
    if args.out:
        print(f"\nJSON report: {args.out}")
    return 0


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
    from opdistill.train import load_config
    from opdistill.train.commands import score_cache

    path, rows, tokens = score_cache(load_config(args.config, args.overrides), args.out, num_prompts=args.num_prompts,
                                     writer=args.writer, fp16=args.fp16)
    print(f"wrote {rows} scored rows ({tokens} response tokens) to {path}")


def _cmd_export(args):
    from opdistill.train.commands import EXPORT_RECORD, export_run
    from opdistill.train.disk.inputs import parse_accept_changed

    accept = parse_accept_changed(args.accept_changed)
    out = export_run(args.run_dir, args.out, checkpoint=args.checkpoint, accept_changed=accept)
    record = json.loads((out / EXPORT_RECORD).read_text())
    print(f"wrote {out}: the student of {args.run_dir} at step {record['step']} (checkpoints/{record['checkpoint']})")


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


def _int_at_least(lo: int, hi: int | None = None, what: str | None = None):
    """An argparse type: an integer in [lo, hi] (``what``: how the message names it)."""
    what = what or f"an integer >= {lo}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_port = _int_at_least(1, 65535, "a port number in [1, 65535]")


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0 (e.g. 0,1), got {text!r}") from None
    if any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0 (e.g. 0,1), got {text!r}")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    from opdistill import __version__

    p = argparse.ArgumentParser(prog="opdistill", description="Exact, memory-lean on-policy distillation: the "
                                "student samples, the teacher scores each token, the student learns. "
                                "'opdistill COMMAND --help' describes each command.")
    p.add_argument("--version", action="version", version=f"opdistill {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (default: one line)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
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
    t.add_argument("--config", required=True, help="YAML config file (docs/trainer.md lists every key)")
    t.add_argument("--resume", action="store_true",
                   help="continue exactly from the run's newest intact checkpoint (default: a new run)")
    t.add_argument("--overwrite", action="store_true",
                   help="delete the run already in run_dir and start a new one (default: refuse a used run_dir)")
    t.add_argument("--dry-run", action="store_true",
                   help="print the resolved config and run every check that needs no weights, then stop "
                        "(as 'opdistill check'; default: train)")
    t.add_argument("--json", action="store_true",
                   help="print the summary as JSON for machines (default: the run's files and a table)")
    t.add_argument("--accept-changed", action="append", default=None, metavar="NAMES",
                   help="with --resume: input names (model.student, teacher, teachers.NAME, data.path, ...) whose "
                        "change since the run started is accepted and recorded (repeatable or comma-separated; "
                        "default: a change is refused with its diff)")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted.key=value overrides (default: none)")
    t.set_defaults(fn=_cmd_train)

    d = sub.add_parser("demo", help="compare on-policy distillation, off-policy KD and RL on a toy task",
                       description="Runs on a laptop CPU in about 10 minutes, prints a table (saved to OUT) and draws "
                                   "OUT/demo.png.")
    d.add_argument("--out", default=None, help="output folder (default runs/demo, runs/demo_tools with --tools)")
    d.add_argument("--tools", action="store_true", help="the demo environment instead: lookup_add, whose answer "
                   "needs a tool call; episodes over several turns (docs/episodes.md; default: off, carry_add)")
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
                   help="checkpoint folder (its weights only), 'latest' for the run's newest intact one, or "
                        "'student' for the configured student untrained (default: 'latest' with RUN_DIR, which "
                        "must then hold a checkpoint; with --config, the configured student)")
    e.add_argument("--out", default=None, help="also write the JSON report to this file (default: none)")
    e.add_argument("--json", action="store_true", help="print the JSON report instead of the table (default: table)")
    e.add_argument("--values", default=None,
                   help="also write the per-problem values (JSON) to this file, for paired comparisons "
                        "(default: none)")
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
    c.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run folders (each holds config.yaml, metrics.jsonl and eval/ of 'opdistill train')")
    c.add_argument("--out", default=None, help="PNG path (default FIRST_RUN_DIR/compare.png)")
    c.add_argument("--baseline", default=None,
                   help="per-problem values (opdistill eval --values) of the start the runs share: the paired "
                        "change is measured from it (default: each run's first evaluation)")
    c.add_argument("--metric", action="append", default=None,
                   help="metric to show (repeatable; default the eval accuracy and teacher-KL metrics present)")
    c.set_defaults(fn=_cmd_compare)

    pl = sub.add_parser("plot", help="plot a run's metrics to a PNG",
                        description="Loss, teacher-KL, overlap ratio, masses and accuracy against step.")
    pl.add_argument("run_dir", metavar="RUN_DIR", help="a run folder of 'opdistill train' (it holds metrics.jsonl)")
    pl.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    pl.set_defaults(fn=_cmd_plot)

    s = sub.add_parser("score", help="teacher-score generated responses into a safetensors cache",
                       description="Generate rollout.n responses for --num-prompts prompts (by the teacher or the "
                                   "student) and write teacher top-k and sampled-token log-probs to --out.")
    s.add_argument("--config", required=True, help="YAML config: the models, the task, rollout.* and loss.topk")
    s.add_argument("--out", required=True, help="cache file to write (.safetensors; data.teacher_cache reads it)")
    s.add_argument("--num-prompts", type=_int_at_least(1), default=64,
                   help="prompts to generate for, rollout.n responses each (default 64)")
    s.add_argument("--writer", choices=["teacher", "student"], default="teacher",
                   help="who writes the responses: teacher (off-policy KD, default) or student")
    s.add_argument("--fp16", action="store_true", help="store log-probs in float16 (default float32)")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted.key=value overrides (default: none)")
    s.set_defaults(fn=_cmd_score)

    x = sub.add_parser("export", help="write a run's student as a plain transformers folder (LoRA merged)",
                       description="safetensors weights (LoRA adapters merged), config, generation config and "
                                   "tokenizer: loadable by AutoModelForCausalLM.from_pretrained and vLLM.")
    x.add_argument("run_dir", metavar="RUN_DIR", help="a run folder of 'opdistill train' (it holds checkpoints/)")
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
    st.add_argument("--port", type=_port, default=8000, help="port, 1 to 65535 (default 8000)")
    st.add_argument("--token-file", default=None,
                    help="file holding the bearer token clients must send (default: none, only on 127.0.0.1)")
    st.add_argument("--max-batch-tokens", type=int, default=65536,
                    help="merge concurrent requests up to this many rows x positions (default 65536)")
    st.add_argument("--max-request-tokens", type=int, default=262144,
                    help="refuse (413) a request above this many rows x positions (default 262144)")
    st.add_argument("--max-k", type=int, default=64, help="largest top-K a client may ask (default 64)")
    st.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"],
                    help="the teacher's weights and scoring dtype (default float32)")
    st.add_argument("--threads", type=_int_at_least(1), default=None, help="torch threads (default: half this "
                    "machine's cores when bound to loopback, where the trainer runs too; every core otherwise)")
    st.add_argument("--trust-remote-code", action="store_true", help="allow the model folder's own code (default: off)")
    st.add_argument("--max-model-len", type=int, default=None,
                    help="vllm engine: the longest row it takes (default: the model's context length)")
    st.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="vllm engine on GPU: the share of GPU memory it takes (default 0.9)")
    st.add_argument("--header-timeout-s", type=float, default=10.0,
                    help="close a connection whose request head has not arrived in this many seconds (default 10)")
    st.add_argument("--body-timeout-s", type=float, default=60.0,
                    help="answer 408 to a request whose body has not arrived in this many seconds (default 60)")
    st.set_defaults(fn=_cmd_serve_teacher)

    ck = sub.add_parser("check", help="print the resolved config and check it without training (a dry run)",
                        description="Print the resolved config (YAML plus overrides, every default filled in), then "
                                    "run every check 'train' makes before loading a weight: the config, the model "
                                    "folders' config.json and tokenizers, the data, the teacher settings and cache. "
                                    "Nothing is loaded or written. Exit 0 when a run would start, 2 with the reason "
                                    "when it would be refused.")
    ck.add_argument("--config", required=True, help="YAML config file (docs/trainer.md lists every key)")
    ck.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted.key=value overrides (default: none)")
    ck.add_argument("--nproc", type=int, default=None, metavar="N",
                    help="check as N processes would run it (torchrun --nproc-per-node N: the tensor-parallel mesh, "
                         "each rank's share of the prompts, what FSDP2 is not wired with; default: one process)")
    ck.set_defaults(fn=_cmd_check)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run a command. A user error (:class:`opdistill.errors.UserError`: a config key, a data file, a model folder)
    prints one line and returns 2; ``--debug`` adds its traceback. An interrupt (Ctrl-C, SIGTERM) outside the
    training loop's own handling prints one line and returns 128 + the signal. Any other exception is a bug and
    propagates. No command: the help, status 0. ``argv`` None (the process's own command line, which ends when this
    returns): once the command is over, a signal ends the process at once (no traceback from an exit handler)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    # argparse hands a positional list only the values before the first flag: 'train --config C --resume a=1' must
    # read a=1 as an override too, not as an unrecognized argument
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if argv is None:  # the process's own command line: a second Ctrl-C ends it at once (_first_interrupt)
        _on_signals(_first_interrupt)
    # the format, not the printer, is swapped: a caller that records warnings (pytest.warns) still records them
    formatwarning = warnings.formatwarning
    if not args.debug:
        warnings.formatwarning = _one_line_warning
    try:
        quiet_transformers()  # in here: a Ctrl-C while transformers (and torch) import is one line too
        with console_logging():
            return args.fn(args) or 0
    except (UserError, KeyboardInterrupt) as e:
        return _failed(args, e)
    except Exception as e:  # a bug: its traceback follows; what the run kept first
        disk = disk_error(e)  # the disk full, read-only, ...: the machine's, not a bug; one line
        if disk is not None:
            return _failed(args, disk)
        if getattr(e, "advice", None):
            print(f"opdistill {args.command}: {_rank_tag()}{e.advice}", file=sys.stderr)
        raise
    finally:
        warnings.formatwarning = formatwarning
        if argv is None:  # the command is over: a signal while the process winds down (its threads joined, its
            _on_signals(_exit_now)  # exit handlers run) ends it at once, without a traceback from where it landed


def _exit_now(signum, frame) -> None:
    os._exit(128 + signum)


def _first_interrupt(signum, frame) -> None:
    """SIGINT/SIGTERM before or after the training loop's own handling (train/run/interrupt.py): a
    KeyboardInterrupt (one line, :func:`_failed`), and from now on the next signal ends the process at once."""
    import signal

    _on_signals(_exit_now)
    e = KeyboardInterrupt(f"interrupted by {signal.Signals(signum).name}" if signum != signal.SIGINT else "")
    e.exit_code = 128 + signum
    raise e


def _on_signals(handler) -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, handler)


def _failed(args, e) -> int:
    """A user error (one line, exit 2) or an interrupt before the loop's handler or a second signal
    (train/run/interrupt.py: one line, exit 128 + the signal); ``--debug`` adds the traceback."""
    if args.debug:
        traceback.print_exc()
    where = f"opdistill {args.command}: {_rank_tag()}"
    advice = getattr(e, "advice", None)
    if isinstance(e, KeyboardInterrupt):
        print(where + (str(e) or "interrupted") + (f"; {advice}" if advice else ""), file=sys.stderr)
        return getattr(e, "exit_code", 130)
    print(f"{where}{e.kind}: {e}", file=sys.stderr)
    if advice:
        print(where + advice, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
