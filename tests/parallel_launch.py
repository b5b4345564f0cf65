"""Launching gloo processes for the parallel tests, and a counter that proves no collective ran.

Each launch costs a few seconds, so one launch of P ranks runs every P-rank check (``tests/parallel_training.py``
holds the launch targets).  A failure in any rank raises in the launching process with that rank's traceback.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "barrier")


# -- launching ---------------------------------------------------------------------------------------------------
def launch(target: str, world: int, out_dir: str) -> None:
    """Run ``target(rank, world, out_dir)`` ("module:function") on ``world`` gloo processes; a failure in any rank
    raises here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(world, port, target, out_dir), nprocs=world, join=True)


def _entry(rank: int, world: int, port: int, target: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        module, name = target.split(":")
        getattr(importlib.import_module(module), name)(rank, world, out_dir)
    finally:
        dist.destroy_process_group()


class CollectiveCounter:
    """Replace every torch.distributed collective by a counter (context manager) -- for the no-collective tests."""

    def __init__(self):
        self.calls: list[str] = []

    def __enter__(self):
        self._saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        for n in self._saved:
            setattr(dist, n, functools.partial(self._record, n))
        return self

    def _record(self, name, *args, **kwargs):
        self.calls.append(name)
        raise AssertionError(f"unexpected collective dist.{name}")

    def __exit__(self, *exc):
        for n, f in self._saved.items():
            setattr(dist, n, f)
        return False
