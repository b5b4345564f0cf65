"""Optional wandb logging (log.wandb): offline mode writes its files under RUN_DIR/wandb with no network."""
import json
from pathlib import Path

import pytest

from opdistill.train import load_config, run_training
from opdistill.runs.files import read_metrics
from tests.trainer_helpers import tiny_config_dict


def test_wandb_config_keys(tmp_path):
    base = tiny_config_dict(tmp_path, steps=1)
    cfg = load_config(base=base, overrides=["log.wandb.project=p", "log.wandb.mode=offline"])
    assert cfg.log.wandb.project == "p" and cfg.log.wandb.mode == "offline" and cfg.log.wandb.name is None
    assert load_config(base=base).log.wandb is None
    with pytest.raises(ValueError, match=r"^log\.wandb\.mode: expected one of online/offline/disabled, got 'cloud'$"):
        load_config(base=base, overrides=["log.wandb.mode=cloud"])


def test_wandb_offline_run_writes_its_files(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there: offline must not need it
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    d = tiny_config_dict(tmp_path, steps=2, eval={"num_prompts": 2, "batch_size": 2, "every": 1})
    d["log"]["wandb"] = {"project": "opd-test", "name": "tiny", "mode": "offline"}
    run_training(load_config(base=d), quiet=True)
    # run.finish() can return before wandb's writer service has flushed the offline file; a process exit waits for
    # it (wandb's atexit teardown), which this in-process test does explicitly
    wandb.teardown()
    folder = Path(d["run_dir"]) / "wandb"
    runs = list(folder.glob("offline-run-*"))
    assert len(runs) == 1
    run_id = (folder / "opdistill-run-id").read_text().strip()
    data = (runs[0] / f"run-{run_id}.wandb").read_bytes()
    assert b"distillation/loss" in data and b"train/grad_norm" in data  # per-step metrics
    assert b"carry_add" in data  # the config
    tables = sorted(runs[0].glob("files/media/table/tables/eval_*.table.json"), key=lambda p: p.stat().st_size)
    table = json.loads(tables[-1].read_text())  # the last evaluation's table: one row per evaluation so far
    rows = read_metrics(d["run_dir"])
    evals = [r for r in rows if "eval/greedy_acc" in r]
    assert [row[0] for row in table["data"]] == [r["step"] for r in evals] == [0, 1, 2]
    col = table["columns"].index("eval/teacher_kl")
    assert [row[col] for row in table["data"]] == pytest.approx([r["eval/teacher_kl"] for r in evals])
