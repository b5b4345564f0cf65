"""Launch target of tests/test_trainer_distributed.py: the trainer at world size 2 (gloo), several runs in one launch.

``plan.json`` in ``out_dir`` lists the runs (name, config dict, options); each rank runs them in order. The tokens
every rank sampled are recorded per step (``{name}_tokens_rank{r}.json``) by wrapping the loop's
``generate_rollouts``, so the test can compare them with the one-process run's.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from opdistill.engines import vllm as engines  # EngineSet: the loop's rollouts go through its generate_rollouts
from opdistill.train import loop
from opdistill.train.config import load_config


def record_rollouts(sink: dict):
    """Wrap the sampler the loop's ``EngineSet`` calls (``opdistill.engines.vllm.generate_rollouts``) so that each call's rows (their tokens, keyed by step and global prompt index)
    land in ``sink``; returns a function that restores the original."""
    original = engines.generate_rollouts

    def recording(*args, step, prompt_offset=0, **kwargs):
        ro = original(*args, step=step, prompt_offset=prompt_offset, **kwargs)
        for row, p in enumerate(ro.prompt_index):
            tokens = ro.input_ids[row][ro.attention_mask[row].bool()].tolist()
            sink.setdefault(str(step), {}).setdefault(str(prompt_offset + p), []).append(tokens)
        return ro

    engines.generate_rollouts = recording
    return lambda: setattr(engines, "generate_rollouts", original)


def run_plan(rank: int, world: int, out_dir: str) -> None:
    plan = json.loads((Path(out_dir) / "plan.json").read_text())
    for item in plan:
        cfg = load_config(base=item["config"])
        if item.get("prepare_resume_from") is not None:  # a copy of a finished run cut back to one checkpoint
            if rank == 0:
                src, dst = Path(item["prepare_resume_from"]), Path(cfg.run_dir)
                shutil.copytree(src, dst)
                for ckpt in (dst / "checkpoints").iterdir():
                    if int(ckpt.name.split("_")[1]) > item["resume_step"]:
                        shutil.rmtree(ckpt)
            dist.barrier()
        sink: dict = {}
        restore = record_rollouts(sink)
        try:
            loop.run_training(cfg, resume=item.get("resume", False), quiet=True)
        finally:
            restore()
        with open(os.path.join(out_dir, f"{item['name']}_tokens_rank{rank}.json"), "w") as f:
            json.dump(sink, f)
