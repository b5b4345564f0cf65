"""Which device the trainer's models live on (``train.device``; docs/distributed.md).

``cpu`` (default) keeps everything where it was: the models on the CPU, gloo under torchrun. ``cuda`` places the
student and the teacher on ``cuda:LOCAL_RANK`` (torchrun's local rank; 0 in a plain process) right after they load;
under torchrun the process group is then nccl for CUDA tensors and gloo for the CPU tensors the loop reduces
(``cpu:gloo,cuda:nccl``). Rollouts, teacher scores and the step's rows stay on the CPU between phases; each consumer
(the sampler, the teacher scorer, :func:`opdistill.train.steps.step.train_step`, the evaluation) moves what it reads to
its model's device. The CUDA path runs only on a machine with a GPU (scripts/gpu_check.py); the default suite runs on CPU.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from opdistill.loss import GroupedScores, TeacherScores
from opdistill.errors import ConfigError

__all__ = ["run_device", "place_models", "data_to"]


def run_device(cfg) -> torch.device:
    """The device of this process's models: ``cpu``, or ``cuda:LOCAL_RANK`` (refused with one line when torch sees no
    CUDA device, or fewer than LOCAL_RANK + 1)."""
    if cfg.train.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device: cuda, but torch sees no CUDA device here (torch.cuda.is_available() is "
                          f"False; torch {torch.__version__}, built with CUDA {torch.version.cuda}); use "
                          "train.device=cpu or a machine with a GPU")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise ConfigError(f"train.device: cuda, but this process is local rank {local} and torch sees "
                          f"{torch.cuda.device_count()} CUDA device(s); start at most that many processes per node")
    return torch.device("cuda", local)


def place_models(device: torch.device, student, teacher, *, teacher_sharded: bool = False,
                 student_sharded: bool = False):
    """(student, teacher) on ``device``. ``teacher_sharded``: leave the teacher where it loaded (``fully_shard``
    moves each of its shards to the mesh's device, one layer at a time, so the whole teacher never sits on one
    device); ``student_sharded``: the student likewise (built without weights, its shards read on the device). A
    teacher of None stays None; ``model.teacher: self`` follows the student."""
    if device.type == "cpu":
        return student, teacher
    torch.cuda.set_device(device)
    if not student_sharded:
        student = student.to(device)
    if isinstance(teacher, torch.nn.Module) and not teacher_sharded:
        teacher = teacher.to(device)
    return student, teacher


def data_to(data, device: torch.device):
    """A :class:`~opdistill.train.steps.step.StepData` with every tensor (scores and metric groups included) on
    ``device`` (itself when already there). Scores still on their way (a Future) follow the rows when they arrive
    (``StepData.teacher_scores``)."""
    if data.input_ids.device == device:
        return data
    return dataclasses.replace(data, **{f.name: _to(getattr(data, f.name), device) for f in dataclasses.fields(data)})


def _to(v, device: torch.device):
    """A tensor, TeacherScores or dict of tensors on ``device``; anything else (None, a Future) as it is."""
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, dict):
        return {k: _to(x, device) for k, x in v.items()}
    if isinstance(v, (TeacherScores, GroupedScores)):
        return v.to(device)
    return v
