"""LoRA students (peft), self-distillation against the adapter-free base, and the memory knobs.

``model.lora: {r, alpha, dropout, target_modules}`` wraps the student with peft's LoRA
(:func:`apply_lora`): the base weights are frozen and only the adapters train. The trainer keeps working with the
transformers model itself (peft injects its LoRA layers into it in place), so the sampler, the losses and the fused
lm_head path see an ordinary causal LM; the peft wrapper that owns the adapters is reachable with :func:`peft_of`.

- **lm_head is frozen, never adapted**: ``target_modules`` may not name it (``all-linear``, peft's default choice,
  leaves it out), so the fused path reads the plain head weight and ``check_lm_head`` holds.
- **Checkpoints hold the adapters only**: ``adapter_model.safetensors`` + ``adapter_config.json`` (peft's format,
  written by :func:`save_model`), listed in the checkpoint's manifest like any other file; the base weights are not
  copied (they are the student folder's). Resume loads the adapters (:func:`load_adapters`) and the optimizer state
  of the adapter parameters, so it is exact.
- **Self-distillation** (``model.teacher: self``): the teacher is the same model with the adapters disabled
  (:class:`AdaptersOff`, peft's ``disable_adapter()`` around each call): one copy of the weights in memory.

``train.gradient_checkpointing`` and ``model.attn_implementation`` are the transformers switches
(``gradient_checkpointing_enable(use_reentrant=False)``, ``from_pretrained(attn_implementation=)``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from opdistill.errors import ConfigError
from opdistill.train.run.rules import lora_targets

__all__ = ["SELF", "ADAPTERS", "apply_lora", "peft_of", "AdaptersOff", "self_teacher", "save_model", "load_adapters",
           "merged_model", "enable_gradient_checkpointing"]

SELF = "self"  # model.teacher: self = the student's base model with its adapters off
ADAPTERS = "adapter_model.safetensors"
_PEFT = "_opdistill_peft"  # the PeftModel, kept in the transformers model's __dict__ (not a registered submodule)


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora: needs the optional package peft: pip install 'opdistill[lora]' (or "
                          "pip install peft)") from None
    return peft


def peft_of(model):
    """The peft wrapper of a LoRA student (None for a plain model)."""
    return model.__dict__.get(_PEFT)


def apply_lora(model, lora) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters as ``lora`` (``model.lora``: r, alpha, dropout, target_modules) asks; return
    the transformers model (LoRA layers injected, base frozen, adapters trainable). Deterministic under the torch
    seed (peft initialises A randomly, B at zero: the wrapped model computes exactly the base at first)."""
    peft = _peft()
    lora_targets(lora)  # never the lm_head (opdistill/train/run/rules.py)
    targets = lora.target_modules
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=targets if isinstance(targets, str) else list(targets),
                             bias="none", task_type="CAUSAL_LM")
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # "Target modules {...} not found in the base model"
        raise ConfigError(f"model.lora.target_modules: {str(e).splitlines()[0]}") from None
    inner = wrapped.get_base_model()
    inner.__dict__[_PEFT] = wrapped
    return inner


class AdaptersOff:
    """The LoRA student seen with its adapters disabled: the base model, sharing the student's weights.

    Calls (the model, its backbone through ``get_decoder()`` or ``base_model_prefix``) run inside peft's
    ``disable_adapter()``; every other attribute is the model's own (config, device, lm_head, ...)."""

    def __init__(self, peft_model, module):
        self._peft, self._module = peft_model, module

    def __call__(self, *args, **kwargs):
        with self._peft.disable_adapter():
            return self._module(*args, **kwargs)

    def get_decoder(self):
        return AdaptersOff(self._peft, self._module.get_decoder())

    def requires_grad_(self, requires_grad: bool = True):  # the base is frozen already; the adapters are the student's
        return self

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if name == getattr(self._module, "base_model_prefix", None) and isinstance(value, torch.nn.Module):
            return AdaptersOff(self._peft, value)
        return value


def self_teacher(student):
    """``model.teacher: self``: the student's base model with the adapters off (no second copy of the weights)."""
    wrapped = peft_of(student)
    if wrapped is None:
        raise ConfigError("model.teacher: 'self' (the base model with the adapters off) needs a LoRA student; set "
                          "model.lora")
    return AdaptersOff(wrapped, student)


def save_model(model, folder) -> None:
    """The student's weights into checkpoint folder ``folder``: a LoRA student's adapters (peft's
    ``adapter_model.safetensors`` + ``adapter_config.json``) and its base config, else the whole model
    (``model.safetensors``)."""
    wrapped = peft_of(model)
    if wrapped is None:
        model.save_pretrained(folder, safe_serialization=True)
        return
    wrapped.save_pretrained(folder, safe_serialization=True)
    model.config.save_pretrained(folder)
    readme = Path(folder) / "README.md"  # peft's model card: not ours to ship in a checkpoint
    if readme.exists():
        readme.unlink()


def load_adapters(model, tensors: dict, where: str) -> None:
    """Load peft adapter ``tensors`` (read from ``where``) into LoRA student ``model``; every adapter weight must be
    set (a ValueError naming what is missing or unexpected otherwise)."""
    peft = _peft()
    wrapped = peft_of(model)
    if wrapped is None:
        raise ValueError(f"{where}: holds LoRA adapters but the student has none (set model.lora as the run did)")
    expected = set(peft.get_peft_model_state_dict(wrapped))
    if set(tensors) != expected:
        raise ValueError(f"{where}: adapters do not match the student's (missing {sorted(expected - set(tensors))[:4]}"
                         f", unexpected {sorted(set(tensors) - expected)[:4]})")
    result = peft.set_peft_model_state_dict(wrapped, tensors)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{where}: adapters do not fit the student (unexpected {result.unexpected_keys[:4]})")


def merged_model(model):
    """A plain transformers model: the LoRA adapters merged into the base weights (the model itself when it has
    none). The student is changed in place: call it on a model that is not trained further."""
    wrapped = peft_of(model)
    if wrapped is None:
        return model
    merged = wrapped.merge_and_unload()
    merged.__dict__.pop(_PEFT, None)
    return merged


def enable_gradient_checkpointing(model) -> None:
    """``train.gradient_checkpointing``: recompute each layer's activations in the backward pass (non-reentrant, so a
    frozen embedding in front of LoRA layers still gets gradients through)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"train.gradient_checkpointing: {type(model).__name__} does not support it; set it to "
                          f"false")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
