"""Exact metrics: sums, counts, minima and maxima kept per metric, reduced once per step.

A mean of micro-batch means is not the mean of the step (a 3-token micro-batch would weigh as much as a
3000-token one).  ``MetricSums`` keeps the numerator and the denominator of every metric separately, merges
micro-batches by adding them, and reduces over a process group with two collectives (SUM for numerators and
denominators, MAX for maxima and negated minima), so the logged value is the global token-weighted value the
full batch would give.

Kinds of metric:
    mean      sum of the selected values / their count          (e.g. distillation/student_mass)
    ratio     sum of numerators / sum of denominators            (e.g. distillation/overlap_ratio)
    sum       a plain total                                      (e.g. distillation/loss, already normalised)
    extrema   reported as NAME_min and NAME_max over selected values
An empty selection reports 0.0 (never NaN).  Every rank must record the same metric names (checked).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .ops.checks import check_mask

class MetricSums:
    """Accumulator of exact metrics over the micro-batches of a step (see module docstring)."""

    def __init__(self) -> None:
        self._num: dict[tuple[str, str], torch.Tensor] = {}
        self._den: dict[tuple[str, str], torch.Tensor] = {}
        self._min: dict[tuple[str, str], torch.Tensor] = {}
        self._max: dict[tuple[str, str], torch.Tensor] = {}

    # -- recording ---------------------------------------------------------------------------------------------
    def _slot(self, name: str, kind: str, device) -> tuple[str, str]:
        """Storage is keyed by (name, kind): 'x' as a mean and 'x' as extrema are distinct records."""
        key = (name, kind)
        if key not in self._num:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            self._num[key], self._den[key] = zero.clone(), zero.clone()
            self._min[key] = torch.full((), float("inf"), dtype=torch.float64, device=device)
            self._max[key] = torch.full((), float("-inf"), dtype=torch.float64, device=device)
        return key

    @staticmethod
    def _selected(values: torch.Tensor, mask) -> torch.Tensor:
        values = values.detach().to(torch.float64)
        if mask is None:
            return values.reshape(-1)
        m = check_mask(mask, "mask")
        if m.shape != values.shape:
            raise ValueError(f"mask must have the shape of values {tuple(values.shape)}, got {tuple(m.shape)}")
        return values[m]

    def add_mean(self, name: str, values: torch.Tensor, mask=None) -> None:
        """Accumulate sum and count of ``values`` where ``mask`` is 1."""
        v = self._selected(values, mask)
        key = self._slot(name, "mean", v.device)
        self._num[key] += v.sum()
        self._den[key] += v.numel()

    def add_ratio(self, name: str, numerator, denominator) -> None:
        """Accumulate a ratio of totals: sum(numerator) / sum(denominator)."""
        num = torch.as_tensor(numerator).detach().to(torch.float64).sum()
        key = self._slot(name, "ratio", num.device)
        self._num[key] += num
        self._den[key] += torch.as_tensor(denominator).detach().to(torch.float64).sum().to(num.device)

    def add_sum(self, name: str, value) -> None:
        """Accumulate a plain total (already normalised by the global batch, e.g. a micro-batch loss / D)."""
        v = torch.as_tensor(value).detach().to(torch.float64).sum()
        key = self._slot(name, "sum", v.device)
        self._num[key] += v

    def add_extrema(self, name: str, values: torch.Tensor, mask=None) -> None:
        """Track min and max of ``values`` where ``mask`` is 1 (reported as NAME_min / NAME_max)."""
        v = self._selected(values, mask)
        key = self._slot(name, "extrema", v.device)
        self._den[key] += v.numel()
        if v.numel():
            self._min[key] = torch.minimum(self._min[key], v.min())
            self._max[key] = torch.maximum(self._max[key], v.max())

    def merge(self, other: "MetricSums") -> "MetricSums":
        """Add another accumulator (e.g. the next micro-batch) into this one; returns self."""
        if not isinstance(other, MetricSums):
            raise TypeError(f"can only merge a MetricSums, got {type(other).__name__}")
        for key in other._num:
            self._slot(*key, other._num[key].device)
            self._num[key] += other._num[key]
            self._den[key] += other._den[key]
            self._min[key] = torch.minimum(self._min[key], other._min[key])
            self._max[key] = torch.maximum(self._max[key], other._max[key])
        return self

    def renamed(self, old: str, new: str, *, empty: bool = False) -> "MetricSums":
        """The records whose name starts with ``old``, that prefix replaced by ``new``: their sums, counts and
        extrema copied (exact), or, with ``empty``, the names alone (nothing recorded: they report 0.0)."""
        out = MetricSums()
        for (name, kind), num in self._num.items():
            if name.startswith(old):
                key = out._slot(new + name[len(old):], kind, num.device)
                if not empty:
                    out._num[key] += num
                    out._den[key] += self._den[(name, kind)]
                    out._min[key] = torch.minimum(out._min[key], self._min[(name, kind)])
                    out._max[key] = torch.maximum(out._max[key], self._max[(name, kind)])
        return out

    def keys(self) -> list[tuple[str, str]]:
        """The recorded (name, kind) pairs, sorted."""
        return sorted(self._num)

    # -- reduction ---------------------------------------------------------------------------------------------
    def reduce(self, group=None) -> dict[str, float]:
        """Exact global values over ``group`` (None: this process only).  Every rank must call it."""
        keys = self.keys()
        device = self._num[keys[0]].device if keys else torch.device("cpu")
        distributed = group is not None and dist.get_world_size(group) > 1
        if distributed:
            # Same records on every rank, else the stacked vectors would not line up (or the collective would hang).
            signature = float(zlib.crc32("\x00".join(f"{n}:{k}" for n, k in keys).encode()))
            check = torch.tensor([signature, -signature], dtype=torch.float64, device=device)
            dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
            if check[0].item() != -check[1].item():
                raise ValueError(f"ranks recorded different metrics; this rank has {keys}")
        if not keys:
            return {}
        sums = torch.stack([self._num[k] for k in keys] + [self._den[k] for k in keys])
        extrema = torch.stack([self._max[k] for k in keys] + [-self._min[k] for k in keys])
        if distributed:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(extrema, op=dist.ReduceOp.MAX, group=group)
        n = len(keys)
        num, den = sums[:n].tolist(), sums[n:].tolist()
        hi, lo = extrema[:n].tolist(), [-x for x in extrema[n:].tolist()]
        out: dict[str, float] = {}
        for i, (name, kind) in enumerate(keys):
            if kind == "sum":
                out[name] = num[i]
            elif kind in ("mean", "ratio"):
                out[name] = num[i] / den[i] if den[i] != 0 else 0.0
            else:
                empty = den[i] == 0
                out[f"{name}_min"] = 0.0 if empty else lo[i]
                out[f"{name}_max"] = 0.0 if empty else hi[i]
        return out
