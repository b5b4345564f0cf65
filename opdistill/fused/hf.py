"""transformers integration: the ONE reader of a causal LM's lm_head (``read_lm_head``: the teacher, the fused path
and the trainer all read heads through it), and the backbone run that feeds the fused ops (``causal_lm_hidden``).

logits = softcap(logit_scale * (hidden @ W^T + b)), W = ``get_output_embeddings().weight`` (tied embeddings: the
input embedding's Parameter, so gradients land on it as through the model's own head).  Known transforms: a constant
logit multiplier (Cohere ``logit_scale``, Granite ``logits_scaling`` (divides), Falcon-H1 ``lm_head_multiplier``), which
the fused ops fold exactly into the temperature (z * c / tau == z / (tau / c)); soft-capping c * tanh(z / c) (Gemma 2
``final_logit_softcapping``), which the teacher applies and the fused path refuses (not a rescaling).  Any other
head-related multiplier/soft-cap key, and a head that is not a plain linear layer, are refused everywhere.
``check_lm_head`` compares the model's own logits with the fused head's on a few tokens: run it once at start-up.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from .inputs import StudentHidden

# config key -> how the model applies it to the logits
_LOGIT_MULTIPLIERS = {"logit_scale": "multiply", "logits_scaling": "divide", "lm_head_multiplier": "multiply"}
_SOFTCAP_KEY = "final_logit_softcapping"
# other keys that look like they act on the head's output: refused unless neutral
_SUSPECT_KEY = re.compile(r"^(final_)?(logit|logits|output|lm_head)_.*(scal|cap|mult)")


@dataclass(frozen=True)
class LMHead:
    """A causal LM's output head: weight ``[V, H]``, bias ``[V]`` or None, logit_scale > 0, softcap c or None (off);
    ``model``: the config class name, for messages."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    logit_scale: float
    softcap: float | None
    model: str

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> fp32 ``[..., V]``, the model's own logits (the matmul in the weight's dtype, as the model)."""
        z = torch.nn.functional.linear(hidden, self.weight, self.bias).float()
        if self.logit_scale != 1.0:
            z = z * self.logit_scale
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z


def _positive(name: str, key: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name}.{key}={v!r}: expected a finite positive number")
    return float(v)


def head_transform(config) -> tuple[float, float | None]:
    """(logit_scale, softcap or None) that a model with this transformers ``config`` applies to its lm_head's output
    (module docstring); raises ValueError for a transform opdistill does not know. Reads the config only: a model
    folder can be checked before its weights are loaded."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = type(cfg).__name__
    scale = 1.0
    for key, how in _LOGIT_MULTIPLIERS.items():
        if getattr(cfg, key, None) is not None:
            v = _positive(name, key, getattr(cfg, key))
            scale = scale * v if how == "multiply" else scale / v
    cap = getattr(cfg, _SOFTCAP_KEY, None)
    cap = None if cap is None else _positive(name, _SOFTCAP_KEY, cap)
    for key, v in cfg.to_dict().items():
        if key in _LOGIT_MULTIPLIERS or key == _SOFTCAP_KEY or not _SUSPECT_KEY.match(key):
            continue
        if v not in (None, 1, 1.0, False):
            raise ValueError(
                f"{name}.{key}={v!r} looks like a transform of the lm_head output that opdistill does not know; "
                "refusing rather than computing a different loss. Extend opdistill.fused.hf._LOGIT_MULTIPLIERS if "
                "it is a plain logit multiplier"
            )
    return float(scale), cap


def read_lm_head(model) -> LMHead:
    """The lm_head of a transformers causal LM with the transform its config applies to the logits (see the module
    docstring); raises TypeError for a head that is not a plain linear layer, ValueError for an unknown transform."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"{type(model).__name__} has no output embedding (lm_head) with a weight; is it a causal LM?")
    if not isinstance(head, torch.nn.Linear):  # e.g. a LoRA- or quantisation-wrapped head
        raise TypeError(
            f"{type(model).__name__}'s lm_head is a {type(head).__name__}, not a plain linear layer; reading its "
            "weight would compute a different function"
        )
    config = model.config
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale, cap = head_transform(config)
    return LMHead(head.weight, head.bias, scale, cap, type(cfg).__name__)


def lm_head_of(model) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(weight [V, H], bias [V] or None, logit_scale) of the head ``read_lm_head`` reads, for the fused ops (which
    fold the multiplier into the temperature); raises for soft-capping, which is not a rescaling."""
    head = read_lm_head(model)
    if head.softcap is not None:
        raise ValueError(
            f"{head.model}.{_SOFTCAP_KEY}={head.softcap!r}: the model soft-caps its logits (c * tanh(z / c)), which "
            "the fused lm_head path does not implement; use the unfused path (model logits) for this model"
        )
    return head.weight, head.bias, head.logit_scale


def backbone_of(model):
    """The module that returns a causal LM's final hidden states (``get_decoder()``, else ``base_model_prefix``)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or dec is model:
        dec = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if dec is None or dec is model:
        raise TypeError(f"cannot find the backbone of {type(model).__name__} (get_decoder() / base_model_prefix)")
    return dec


def no_cache_kwargs(model) -> dict:
    """``{"use_cache": False}`` for a transformers model (its config has ``use_cache``), else ``{}``: a forward
    that is not a decode step (scoring, a training forward) need not build a KV cache, which transformers does by
    default (``config.use_cache``) and throws away after the call. The outputs are the same. A wrapper with
    ``.module`` (DDP) is looked through."""
    m = model
    while not hasattr(m, "config") and hasattr(m, "module"):
        m = m.module
    return {"use_cache": False} if getattr(getattr(m, "config", None), "use_cache", None) is not None else {}


def causal_lm_hidden(model, input_ids=None, attention_mask=None, **kwargs) -> StudentHidden:
    """Run the backbone of a transformers causal LM and return its final hidden states with its lm_head.

    ``hidden[:, t]`` predicts token t+1, exactly as ``model(...).logits[:, t]`` does.  Extra keyword arguments
    (``position_ids``, ``inputs_embeds``, ...) go to the backbone.  Raises for heads that are not a plain linear
    map up to a constant logit multiplier (``lm_head_of``).
    """
    weight, bias, scale = lm_head_of(model)
    out = backbone_of(model)(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return StudentHidden(hidden, weight, bias, scale)


@torch.no_grad()
def check_lm_head(model, input_ids, attention_mask=None, *, atol: float = 1e-3) -> float:
    """Compare ``model(...).logits`` with ``hidden @ W.T (+ b) * logit_scale`` on ``input_ids`` (keep it short);
    raises ValueError if they differ by more than ``atol`` relative to the logits' scale, returns the max difference."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    sh = causal_lm_hidden(model, input_ids, attention_mask)
    ours = torch.nn.functional.linear(sh.hidden.float(), sh.weight.float(),
                                      None if sh.bias is None else sh.bias.float()) * sh.logit_scale
    diff = float((ours - logits).abs().max()) if logits.numel() else 0.0
    scale = max(float(logits.abs().max()) if logits.numel() else 0.0, 1.0)
    if diff > atol * scale:
        raise ValueError(
            f"{type(model).__name__}: the fused head (hidden @ lm_head.T * {sh.logit_scale}) differs from the model's "
            f"logits by {diff:.3g} (scale {scale:.3g}); the model's head does something the fused path does not"
        )
    return diff
