"""Weights follow the umask like every other file (safetensors writes 0600): checkpoints, exports, teacher caches."""
import json
import os
import stat
from pathlib import Path

import pytest

from opdistill.cli import main
from opdistill.train import load_config, run_training
from tests.trainer_helpers import tiny_config_dict


def _modes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("umask", [0o022, 0o007])
def test_weights_follow_the_umask(tmp_path, umask, capsys):
    cfg = tiny_config_dict(tmp_path, steps=1, eval={"num_prompts": 0})
    old = os.umask(umask)
    try:
        run_training(load_config(base=cfg), quiet=True)
        assert main(["export", cfg["run_dir"], "--out", str(tmp_path / "export")]) == 0
        # issue 35 item 7: export says which checkpoint it wrote, on the terminal and in the folder
        assert capsys.readouterr().out.strip() == (f"wrote {tmp_path / 'export'}: the student of {cfg['run_dir']} at "
                                                   f"step 1 (checkpoints/step_00000001)")
        assert json.loads((tmp_path / "export" / "opdistill_export.json").read_text()) == {
            "run_dir": str(Path(cfg["run_dir"]).resolve()), "checkpoint": "step_00000001", "step": 1}
        assert main(["score", "--config", _write(tmp_path, cfg), "--out", str(tmp_path / "cache.safetensors"),
                     "--num-prompts", "2"]) == 0
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    ckpt = _modes(Path(cfg["run_dir"]) / "checkpoints" / "step_00000001")
    assert {"model.safetensors", "trainer_state.safetensors", "manifest.json"} <= set(ckpt)
    assert {name: oct(m) for name, m in ckpt.items() if m != want} == {}
    exported = _modes(tmp_path / "export")
    assert "model.safetensors" in exported and {n: oct(m) for n, m in exported.items() if m != want} == {}
    assert oct(stat.S_IMODE((tmp_path / "cache.safetensors").stat().st_mode)) == oct(want)


def _write(tmp_path: Path, cfg: dict) -> str:
    import yaml

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)
