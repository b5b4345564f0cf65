"""transformers integration: run a causal LM's backbone, hand its final hidden states and lm_head to the fused ops.

    student = causal_lm_hidden(model, input_ids, attention_mask=mask)     # StudentHidden, no [B, S, V] logits
    res = fused_topk_divergence(student.hidden, student.weight, ids, lp, bias=student.bias,
                                temperature=student.temperature(tau))

The lm_head is ``model.get_output_embeddings()``: with tied embeddings it *is* the input embedding's Parameter, so the
weight gradient lands on the embedding as it would through the model's own head.  A head that does more than a
linear map cannot be fused silently:

- a constant logit multiplier is folded exactly into the temperature (logits * c / tau == logits / (tau / c)):
  Cohere's ``logit_scale`` (multiplies), Granite's ``logits_scaling`` (divides), Falcon-H1's ``lm_head_multiplier``;
- logit soft-capping (Gemma 2's ``final_logit_softcapping``) is not a rescaling, so the model is refused, and so is
  any other head-related multiplier/soft-cap key in the config that this module does not know.

``check_lm_head`` compares the model's own logits with the fused head's on a few tokens: run it once at start-up.
"""

from __future__ import annotations

import math
import re

import torch

from .inputs import StudentHidden

# config key -> how the model applies it to the logits
_LOGIT_MULTIPLIERS = {"logit_scale": "multiply", "logits_scaling": "divide", "lm_head_multiplier": "multiply"}
_SOFTCAP_KEYS = ("final_logit_softcapping", "logit_softcapping", "output_softcapping")
# other keys that look like they act on the head's output: refused unless neutral
_SUSPECT_KEY = re.compile(r"^(final_)?(logit|logits|output|lm_head)_.*(scal|cap|mult)")


def lm_head_logit_scale(config) -> float:
    """The constant the model's head multiplies its logits by; raises for soft-capping or unknown head transforms."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = type(cfg).__name__
    for key in _SOFTCAP_KEYS:
        if getattr(cfg, key, None) is not None:
            raise ValueError(
                f"{name}.{key}={getattr(cfg, key)!r}: the model soft-caps its logits (c * tanh(z / c)), which the fused "
                "lm_head path does not implement; use the unfused path (model logits) for this model"
            )
    scale = 1.0
    for key, how in _LOGIT_MULTIPLIERS.items():
        v = getattr(cfg, key, None)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name}.{key}={v!r}: expected a finite positive logit multiplier")
        scale = scale * v if how == "multiply" else scale / v
    for key, v in cfg.to_dict().items():
        if key in _LOGIT_MULTIPLIERS or key in _SOFTCAP_KEYS or not _SUSPECT_KEY.match(key):
            continue
        if v not in (None, 1, 1.0, False):
            raise ValueError(
                f"{name}.{key}={v!r} looks like a transform of the lm_head output that the fused path does not know; "
                "refusing rather than computing a different loss. Use the unfused path, or extend "
                "opdistill.fused.hf._LOGIT_MULTIPLIERS if it is a plain logit multiplier"
            )
    return float(scale)


def lm_head_of(model) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(weight [V, H], bias [V] or None, logit_scale) of a transformers causal LM's output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(f"{type(model).__name__} has no output embedding (lm_head) with a weight; is it a causal LM?")
    if not isinstance(head, torch.nn.Linear):  # e.g. a LoRA- or quantisation-wrapped head
        raise TypeError(
            f"{type(model).__name__}'s lm_head is a {type(head).__name__}, not a plain linear layer; the fused path "
            "would compute a different function"
        )
    return head.weight, head.bias, lm_head_logit_scale(model.config)


def _backbone(model):
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or dec is model:
        dec = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if dec is None or dec is model:
        raise TypeError(f"cannot find the backbone of {type(model).__name__} (get_decoder() / base_model_prefix)")
    return dec


def causal_lm_hidden(model, input_ids=None, attention_mask=None, **kwargs) -> StudentHidden:
    """Run the backbone of a transformers causal LM and return its final hidden states with its lm_head.

    ``hidden[:, t]`` predicts token t+1, exactly as ``model(...).logits[:, t]`` does.  Extra keyword arguments
    (``position_ids``, ``inputs_embeds``, ...) go to the backbone.  Raises for heads that are not a plain linear
    map up to a constant logit multiplier (see the module docstring).
    """
    weight, bias, scale = lm_head_of(model)
    out = _backbone(model)(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
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
