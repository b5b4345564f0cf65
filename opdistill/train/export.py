"""``opdistill export RUN_DIR [--checkpoint latest] --out DIR``: a run's student as a plain transformers folder.

The folder holds ``model.safetensors`` (LoRA adapters merged into the base weights; no peft needed to load it),
``config.json``, ``generation_config.json`` and the tokenizer files: ``AutoModelForCausalLM.from_pretrained(DIR)``
and vLLM load it as they load any Hugging Face model. The checkpoint is verified (manifest) before it is read; the
folder is written into a temporary sibling and renamed into place, and an existing non-empty ``--out`` is refused, as
is an ``--out`` inside a run's entries (a checkpoint folder, ``eval/``, ...: the run's rotation would delete the
export; ``opdistill.runs.outputs``) and an ``--out`` another process is exporting to (a file lock beside it).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from opdistill.errors import ConfigError
from opdistill.models import resolve_model_path
from opdistill.runs.outputs import check_output_path, output_lock
from opdistill.train.checkpoint import load_weights, resume_checkpoint, verify_checkpoint
from opdistill.train.config import load_config
from opdistill.train.inputs import check_inputs, local_inputs
from opdistill.train.lora import apply_lora, merged_model
from opdistill.train.rundir import CheckpointError, follow_umask

__all__ = ["export_run"]


def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, checkpoint: str = "latest",
               accept_changed: tuple = ()) -> Path:
    """Write RUN_DIR's student at ``checkpoint`` (``latest``: the newest intact one; or a checkpoint folder) to
    ``out`` as a plain transformers folder; return its path. The student folder (a LoRA run's base, the tokenizer)
    must be the one the run recorded (train/inputs.py) unless ``accept_changed`` names ``model.student``."""
    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"RUN_DIR: '{run_dir}' holds no config.yaml (expected the run_dir of an opdistill train run)")
    _check_out(out)
    check_output_path(out, "--out")
    with output_lock(out, "--out"):
        _check_out(out)  # again, under the lock: another export may have finished in between
        return _export(run_dir, out, checkpoint, tuple(accept_changed))


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: '{out}' exists and is not an empty folder; choose a new folder")


def _export(run_dir: Path, out: Path, checkpoint: str, accept: tuple) -> Path:
    from opdistill.models import load_model, load_tokenizer, truncate_layers

    cfg = load_config(run_dir / "config.yaml")
    check_inputs(run_dir, local_inputs(cfg, only=("model.student",)), accept, what="export")
    if checkpoint == "latest":
        ckpt = resume_checkpoint(run_dir)
    else:
        ckpt = Path(checkpoint)
        verify_checkpoint(ckpt)
    mc = cfg.model
    path = resolve_model_path(mc.student)
    tok = load_tokenizer(path, trust_remote_code=mc.trust_remote_code, key="model.student")
    model = load_model(path, dtype=mc.dtype, trust_remote_code=mc.trust_remote_code, key="model.student")
    if mc.student_from_teacher_layers:
        model = truncate_layers(model, mc.student_from_teacher_layers)
    if mc.lora is not None:
        model = apply_lora(model, mc.lora)
    load_weights(ckpt, model)
    model = merged_model(model)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        if not (tmp / "model.safetensors").is_file() and not (tmp / "model.safetensors.index.json").is_file():
            raise CheckpointError(f"{tmp}: transformers wrote no safetensors weights")
        follow_umask(tmp)  # safetensors writes 0600: a vLLM server running as another user could not read it
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
