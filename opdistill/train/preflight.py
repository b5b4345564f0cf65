"""Checks that need the loaded models, run right after they load and before any evaluation or training.

:func:`opdistill.train.config.load_config` checks everything a config alone can tell; what is left needs the models:
K against the vocabulary, prompt length against the model's positions, the weights' dtype. Each failure is a
:class:`ConfigError` (or a :class:`DataError` for a dataset row) whose one-line message names the key to change.
"""
from __future__ import annotations

import warnings

import torch

from opdistill.data import DatasetTask, PromptSource, Task
from opdistill.data.prompts import warn_unknown_chars
from opdistill.errors import ConfigError, ModelError
from opdistill.models import resolve_model_path
from opdistill.train.config import TrainerConfig

__all__ = ["check_model_folders", "check_finite_weights", "check_finite_model", "check_against_models",
           "model_positions"]


def check_model_folders(cfg: TrainerConfig) -> None:
    """Before loading: each of ``model.student`` / ``model.teacher`` names a model folder (or a builtin, or a hub
    id); a ConfigError / ModelError names the key otherwise (``model.student: no such folder '...'``)."""
    from opdistill.models import model_folder

    for key, name in (("model.student", cfg.model.student), ("model.teacher", cfg.model.teacher)):
        if name and not (key == "model.teacher" and name == "self"):  # self: the LoRA student's base
            try:
                path = resolve_model_path(name)
            except (ValueError, FileNotFoundError) as e:  # an unknown builtin, a missing packaged model
                raise ConfigError(f"{key}: {str(e).removeprefix('model: ')}") from None
            model_folder(path, key)


def check_finite_weights(cfg: TrainerConfig, student, teacher) -> None:
    """Refuse a loaded model holding a NaN/inf weight (a corrupt or diverged folder), naming the key and the tensor:
    otherwise the first evaluation or training step fails deep inside the loss, or every step is skipped as
    non-finite. One pass over the weights, right after loading."""
    for key, model in (("model.student", student), ("model.teacher", teacher)):
        if model is not None:
            check_finite_model(key, model, getattr(cfg.model, key.split('.')[1]))


def check_finite_model(key: str, model, path) -> None:
    """:func:`check_finite_weights` for one model loaded from ``path`` (a ``teachers`` entry's: ``key``
    teachers.N.path)."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ModelError(f"{key}: weight {name} of {path!r} holds NaN/inf (a corrupt or diverged model folder); "
                             f"use an intact model folder")


def model_positions(model) -> int | None:
    """How many positions the model was built for (None when its config does not say)."""
    c = model.config
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)


def check_against_models(cfg: TrainerConfig, tokenizer, student, teacher, task: Task, *,
                         training: bool = True) -> None:
    """Refuse, naming the key, what the config asks and the loaded models cannot do; fit a dataset's prompts.

    - fp16 student weights when training (``model.dtype``): there is no loss scaling, so small gradients flush to 0
      and one overflow makes every weight NaN;
    - ``loss.topk`` (distillation methods) and ``eval.topk`` above the vocabulary;
    - ``rollout.max_new_tokens`` / ``eval.max_new_tokens`` leaving no room for a prompt within the positions;
    - prompts longer than positions - max_new_tokens: a dataset's rows are refused or cut (``data.overlong``), a
      generated task's (its held-out set and first training batch) are refused naming ``data.task_args``;
    - characters the tokenizer maps to its unknown token: one warning with a count;
    - NaN/inf weights in either model (:func:`check_finite_weights`).

    ``training=False`` (``opdistill eval`` / ``score``): the same checks but fp16 weights, which are fine there.
    """
    check_finite_weights(cfg, student, teacher)
    if training and cfg.train.steps > 0 and any(p.dtype == torch.float16 for p in student.parameters() if p.requires_grad):
        raise ConfigError("model.dtype: float16 training is refused: the trainer has no loss scaling, so small "
                          "gradients flush to zero and one overflow turns every weight into NaN; use bfloat16 or "
                          "float32 (float16 is fine for eval and score)")
    head = student.get_output_embeddings()
    vocab = head.weight.shape[0] if head is not None else student.config.vocab_size
    if cfg.train.method != "rl" and cfg.loss.topk is not None and cfg.loss.topk > vocab:
        raise ConfigError(f"loss.topk: expected at most the vocabulary size {vocab}, got {cfg.loss.topk}")
    if cfg.eval.topk > vocab:
        raise ConfigError(f"eval.topk: expected at most the vocabulary size {vocab}, got {cfg.eval.topk}")

    positions = [n for n in (model_positions(m) for m in (student, teacher) if m is not None) if n]
    if not positions:
        return
    positions = min(positions)
    new_key, new = max((("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
                        ("eval.max_new_tokens", cfg.eval.max_new_tokens or 0)), key=lambda kv: kv[1])
    budget = positions - new  # the longest prompt that leaves room for max_new_tokens within the positions
    if budget < 1:
        raise ConfigError(f"{new_key}: expected at most {positions - 1} (the model has {positions} positions and a "
                          f"prompt needs at least one), got {new}")
    if isinstance(task, DatasetTask):
        if not task.has_held_out and cfg.eval.num_prompts:
            warnings.warn(f"data: {cfg.data.path} has no held-out rows, so eval/* measures prompts drawn from the "
                          f"training rows; set data.eval_path, data.eval_split or data.eval_fraction (docs/data.md)",
                          stacklevel=2)
        task.fit_prompts(tokenizer, budget, overlong=cfg.data.overlong, use_chat_template=cfg.data.use_chat_template)
        return
    source = PromptSource(task, cfg.train.seed, cfg.data.eval_seed)
    problems = source.held_out(cfg.eval.num_prompts) + source.batch(1, cfg.data.prompts_per_step)
    too_long = warn_unknown_chars(tokenizer, [p.prompt for p in problems], [task.name] * len(problems),
                                  f"task {task.name}", max_tokens=budget, use_chat_template=cfg.data.use_chat_template)
    if too_long:
        raise ConfigError(f"data.task_args: {task.name} prompts reach {max(n for _, n in too_long)} tokens, more than "
                          f"the {budget} the model allows ({positions} positions - {new} for {new_key}); use smaller "
                          f"task_args or a lower {new_key}")
