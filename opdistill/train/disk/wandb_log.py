"""Optional Weights & Biases logging (``log.wandb: {project, name, mode}``; the ``wandb`` extra), next to
metrics.jsonl and TensorBoard.

What goes to wandb: the resolved config (``wandb.config``), every step's metrics (the metrics.jsonl row, at its step),
and at each evaluation a ``tables/eval`` table (one row per evaluation so far: step and every ``eval/*`` metric). Files go
to ``RUN_DIR/wandb/`` (a run-dir entry: removed by ``--overwrite``). ``mode: offline`` writes the run there with no
network (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later); ``disabled`` logs nothing. The wandb run id is
kept in ``RUN_DIR/wandb/opdistill-run-id``, so ``--resume`` continues the same wandb run.
"""
from __future__ import annotations

import math
import os
import secrets
from pathlib import Path

from opdistill.errors import ConfigError

__all__ = ["WandbLogger", "open_wandb"]

_ID_FILE = "opdistill-run-id"


class WandbLogger:
    def __init__(self, run_dir: str | os.PathLike, config: dict, *, project: str, name: str | None, mode: str,
                 start_step: int = 0):
        try:
            import wandb
        except ImportError:
            raise ConfigError("log.wandb: needs the optional package wandb: pip install 'opdistill[wandb]' (or set "
                              "log.wandb to null)") from None
        self.wandb = wandb
        folder = Path(run_dir) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / _ID_FILE
        run_id = id_file.read_text().strip() if start_step > 0 and id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=name, mode=mode, dir=str(run_dir), id=run_id, config=config,
                              resume="allow", settings=wandb.Settings(silent=True, console="off"))
        self.eval_rows: list[dict] = []

    def log(self, step: int, metrics: dict) -> None:
        row = {k: float(v) for k, v in metrics.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        evals = {k: v for k, v in row.items() if k.startswith("eval/")}
        if evals:
            self.eval_rows.append({"step": step, **evals})
            columns = ["step"] + sorted({k for r in self.eval_rows for k in r if k != "step"})
            row["tables/eval"] = self.wandb.Table(columns=columns,
                                                 data=[[r.get(c) for c in columns] for r in self.eval_rows])
        self.run.log(row, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def open_wandb(log_cfg, run_dir, config: dict, start_step: int = 0) -> WandbLogger | None:
    """The wandb logger ``log.wandb`` asks for (None when it is null)."""
    wc = getattr(log_cfg, "wandb", None)
    if wc is None:
        return None
    return WandbLogger(run_dir, config, project=wc.project, name=wc.name, mode=wc.mode, start_step=start_step)
