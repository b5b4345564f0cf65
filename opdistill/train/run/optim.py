"""The trainer's optimizer: AdamW with the fastest implementation torch has for the parameters' device.

``optim.implementation`` (docs/trainer.md):
- ``auto`` (default): ``fused`` where torch has a fused AdamW kernel for the device of every parameter (CPU included
  since torch 2.4; CUDA, XPU, MPS...), else ``foreach``.
- ``fused``: one kernel per parameter group (refused with one line when torch has none for the device).
- ``foreach``: torch's multi-tensor path; bitwise the single-tensor one on CPU (tested).
- ``single``: torch's per-parameter loop (the reference; what torch picks by default on CPU).
The fused kernel rounds differently from the reference by about one ulp per step (tested within 1e-7 after a few
steps); resuming a run is exact whichever is used, since the checkpoint carries the optimizer state and the
implementation is part of the run's config (it may not change on ``--resume``).
"""
from __future__ import annotations

import torch

from opdistill.errors import ConfigError

__all__ = ["IMPLEMENTATIONS", "build_optimizer", "fused_supported"]

IMPLEMENTATIONS = ("auto", "fused", "foreach", "single")


def fused_supported(params) -> bool:
    """Whether torch has a fused AdamW kernel for the device (and dtype) of every parameter in ``params``."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:  # an older torch: no fused AdamW outside CUDA
        devices = {"cuda"}
    return all(p.device.type in devices and p.is_floating_point() for p in params)


def build_optimizer(params, optim_cfg, implementation: str | None = None) -> torch.optim.AdamW:
    """AdamW over ``params`` with the ``optim`` section's lr, betas and weight decay, implemented as
    ``implementation`` (default: ``optim_cfg.implementation``, else ``auto``)."""
    params = list(params)
    impl = implementation or getattr(optim_cfg, "implementation", "auto")
    if impl not in IMPLEMENTATIONS:
        raise ConfigError(f"optim.implementation: expected one of {list(IMPLEMENTATIONS)}, got {impl!r}")
    if impl == "auto":
        impl = "fused" if fused_supported(params) else "foreach"
    if impl == "fused" and not fused_supported(params):
        devices = sorted({p.device.type for p in params})
        raise ConfigError(f"optim.implementation=fused: torch {torch.__version__} has no fused AdamW kernel for "
                          f"device {devices}; use optim.implementation=auto or foreach")
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[impl]
    return torch.optim.AdamW(params, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2),
                             weight_decay=optim_cfg.weight_decay, **kw)
