"""Input validation shared by every op: one place, one message style.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value) with a message
that names the argument, says what was expected and shows what was received.  Data-dependent checks (ids in
range, no NaN) read tensor values; they are cheap next to the ops they guard and they are what turns a silent NaN
three hours into a run into an error on the first step.
"""

from __future__ import annotations

import math

import torch

# Teacher top-k mass may exceed 1 by rounding (fp16 log-probs, a server's own softmax); more than this is a bug
# (logits passed as log-probs, a temperature applied twice).
MASS_TOLERANCE = 1e-3
LOGPROB_TOLERANCE = math.log1p(MASS_TOLERANCE)

SUPPORTS = ("truncated", "tail", "renormalized")
DIVERGENCES = ("forward", "reverse", "jsd")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (for references and gradcheck); everything else is computed in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_float(x: torch.Tensor, name: str) -> None:
    check_tensor(x, name)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_int(x: torch.Tensor, name: str) -> None:
    check_tensor(x, name)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32/int64 token ids), got dtype {x.dtype}")


def check_logits(logits: torch.Tensor, name: str = "student_logits") -> int:
    """Logits are ``[..., V]`` with at least one leading dim; returns V."""
    check_float(logits, name)
    if logits.dim() < 2:
        raise ValueError(f"{name} must have shape [..., V] with at least one leading dim, got {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError(f"{name} has an empty vocabulary dim: shape {tuple(logits.shape)}")
    return logits.shape[-1]


def check_choice(value, name: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_unit_interval(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def check_temperature(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {value!r}")


def check_ids_in_range(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    if ids.numel() and (bool((ids < 0).any()) or bool((ids >= vocab_size).any())):
        lo, hi = int(ids.min()), int(ids.max())
        raise ValueError(f"{name} must lie in [0, {vocab_size}) (the vocabulary), got values in [{lo}, {hi}]")


def check_teacher_logprobs(logprobs: torch.Tensor, name: str, *, allow_neg_inf: bool) -> None:
    """No NaN, no +inf, no positive log-probs; -inf only where it means an empty slot."""
    check_float(logprobs, name)
    if not logprobs.numel():
        return
    if bool(torch.isnan(logprobs).any()):
        raise ValueError(f"{name} contains NaN")
    if bool(torch.isposinf(logprobs).any()):
        raise ValueError(f"{name} contains +inf; log-probabilities must be <= 0")
    if not allow_neg_inf and bool(torch.isneginf(logprobs).any()):
        raise ValueError(f"{name} contains -inf; the log-prob of a sampled token must be finite")
    top = float(logprobs.max())
    if top > LOGPROB_TOLERANCE:
        raise ValueError(
            f"{name} must be log-probabilities (<= 0), got a maximum of {top:.4g}; were logits passed instead?"
        )


def check_topk_inputs(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, *,
                      support: str, divergence: str, beta: float, log_prob_min_clamp, temperature: float,
                      vocab_size: int | None = None, validate: bool | str = True) -> None:
    """Every check of ``topk_divergence`` (and its vocab-parallel / fused variants).

    ``vocab_size`` is the true vocabulary when ``student_logits`` is only a shard (or absent); ids are checked
    against it.  ``validate=False`` skips the checks that read tensor values (ids in range, teacher log-probs, mass,
    duplicates: each a device-to-host sync), keeping those of types, shapes and arguments; ``validate="student"`` skips
    them too (the teacher signal was checked where it was made: ``TeacherTopK(validated=True)``) while the op still
    checks the student's values.  Raises before any math.
    """
    check_choice(support, "support", SUPPORTS)
    check_choice(divergence, "divergence", DIVERGENCES)
    if support == "truncated" and divergence != "forward":
        raise ValueError(
            f"support='truncated' only supports divergence='forward', got {divergence!r}: on the truncated support "
            "the student can lower the loss by shrinking its own mass on the teacher's ids (unstable; verl dropped "
            "it). Use support='tail' or 'renormalized' for reverse/jsd."
        )
    check_unit_interval(beta, "beta")
    check_temperature(temperature)
    if log_prob_min_clamp is not None:
        if support != "truncated":
            raise ValueError(
                f"log_prob_min_clamp is only defined for support='truncated' (verl's forward_kl_topk), got "
                f"support={support!r}: clamping breaks the normalisation the tail/renormalized divergences rely on"
            )
        if isinstance(log_prob_min_clamp, bool) or not isinstance(log_prob_min_clamp, (int, float)) or not math.isfinite(
            log_prob_min_clamp
        ):
            raise ValueError(f"log_prob_min_clamp must be a finite number or None, got {log_prob_min_clamp!r}")

    check_int(teacher_ids, "teacher_ids")
    check_float(teacher_logprobs, "teacher_logprobs")
    if student_logits is not None:
        V = check_logits(student_logits)
        lead = tuple(student_logits.shape[:-1])
        if teacher_ids.dim() != student_logits.dim() or tuple(teacher_ids.shape[:-1]) != lead:
            raise ValueError(
                f"teacher_ids must have shape {lead + ('K',)} (the leading dims of student_logits {tuple(student_logits.shape)}"
                f" plus K), got {tuple(teacher_ids.shape)}"
            )
        if vocab_size is None:
            vocab_size = V
    if vocab_size is None:
        raise ValueError("vocab_size is required when student_logits is not given")
    if teacher_ids.dim() < 2:
        raise ValueError(f"teacher_ids must have shape [..., K], got {tuple(teacher_ids.shape)}")
    if teacher_logprobs.shape != teacher_ids.shape:
        raise ValueError(
            f"teacher_logprobs must have the shape of teacher_ids {tuple(teacher_ids.shape)}, got {tuple(teacher_logprobs.shape)}"
        )
    K = teacher_ids.shape[-1]
    if K < 1:
        raise ValueError(f"teacher_ids must have K >= 1 slots per token, got K={K}")
    if K > vocab_size:
        raise ValueError(f"teacher_ids has K={K} slots but the vocabulary has only V={vocab_size} tokens (need K <= V)")
    if validate is not True:
        return
    check_ids_in_range(teacher_ids, vocab_size, "teacher_ids")
    check_teacher_logprobs(teacher_logprobs, "teacher_logprobs", allow_neg_inf=True)
    if teacher_logprobs.numel():
        mass = torch.exp(teacher_logprobs.to(compute_dtype(teacher_logprobs.dtype))).sum(-1)
        worst = float(mass.max())
        if worst > 1.0 + MASS_TOLERANCE:
            raise ValueError(
                f"teacher_logprobs: the teacher mass on the top-k ids must be <= 1 (+{MASS_TOLERANCE} rounding), got "
                f"{worst:.6g}; are these log-probs of a single distribution (temperature 1, one row per position)?"
            )
    if support != "truncated":
        check_no_duplicates(teacher_ids, teacher_logprobs, support)


def check_no_duplicates(teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, support: str) -> None:
    """Duplicate ids among the non-empty slots of a row would count their mass twice."""
    if teacher_ids.numel() == 0 or teacher_ids.shape[-1] < 2:
        return
    # Empty slots (-inf) get distinct negative sentinels so they never collide with a real id or each other.
    K = teacher_ids.shape[-1]
    sentinel = -1 - torch.arange(K, device=teacher_ids.device, dtype=torch.int64)
    ids = torch.where(torch.isneginf(teacher_logprobs), sentinel, teacher_ids.to(torch.int64))
    ids, _ = ids.sort(dim=-1)
    dup = ids[..., 1:] == ids[..., :-1]
    if bool(dup.any()):
        where = dup.any(-1).nonzero()[0].tolist()
        raise ValueError(
            f"teacher_ids has duplicate ids within a row (first at position {where}); support={support!r} would "
            "count their mass twice. Deduplicate, or mark repeats as empty slots with log-prob -inf."
        )


def check_same_shape(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{a_name} and {b_name} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")


def check_mask(mask: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """A mask is bool or numeric holding only 0 and 1; returns it as bool."""
    check_tensor(mask, name)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{name} must be a bool or 0/1 numeric tensor, got dtype {mask.dtype}")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[:4].tolist()
        raise ValueError(f"{name} must contain only 0 and 1 (a response mask, not weights), got values like {bad}")
    return mask != 0


def check_finite_rows(bad: torch.Tensor, name: str) -> None:
    """Raise if any entry of ``bad`` (bool, the leading shape of ``name``) is set: that position of ``name`` holds a
    non-finite value where it counts.  The callers derive ``bad`` from values they compute anyway (a row's
    log-sum-exp is NaN or +inf exactly when the row holds a NaN or +inf, or no finite entry), so the check costs one
    reduction over ``[...]`` and one device-to-host sync; ``validate=False`` skips it."""
    if bad.numel() and bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(
            f"{name} is not finite at position {pos} (a NaN or +inf, or no finite value in the row) where the loss "
            "reads it; look for NaN weights or fp16 overflow, or mask that position (validate=False skips this check)"
        )
