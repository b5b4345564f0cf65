"""The non-finite policy: a step with a NaN/inf loss or gradient norm is not applied (counted in
train/nonfinite_steps); train.max_nonfinite_steps in a row stop the run with exit 2 and a message naming the step and
the likely causes; good checkpoints are kept and no checkpoint holds a NaN/inf."""
import pytest
import torch
import yaml
from safetensors.torch import load_file

from opdistill import DistillationConfig, DistillationLoss, TeacherScores, TeacherTopK
from opdistill.cli import main
from opdistill.models import load_model
from opdistill.train.disk.checkpoint import list_checkpoints, verify_checkpoint
from opdistill.runs.files import read_metrics
from opdistill.train.steps.step import StepData, train_step
from tests.trainer_helpers import make_model_dir, tiny_config_dict

CAUSES = ("Likely causes: fp16 overflow (model.dtype=float16: use bfloat16 or float32), a learning rate too high "
          "(optim.lr={lr}), bad data or teacher scores (NaN/inf inputs)")


def _cfg_file(tmp_path, **sections):
    cfg = tiny_config_dict(tmp_path, **sections)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _all_finite(folder):
    tensors = {**load_file(str(folder / "model.safetensors")), **load_file(str(folder / "trainer_state.safetensors"))}
    return all(torch.isfinite(v).all() for v in tensors.values() if v.is_floating_point())


class _InfLoss:
    """A loss whose value is +inf while its gradient stays finite (d(loss + inf)/dw = d loss/dw)."""

    def __init__(self, inner):
        self.inner, self.config = inner, inner.config

    def __getattr__(self, name):  # everything else is the wrapped loss's (signal, token_logprobs, ...)
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        loss, metrics = self.inner(*args, **kwargs)
        return loss + float("inf"), metrics


@pytest.mark.parametrize("bad", ["grad_nan", "grad_inf", "loss_inf"])
def test_a_non_finite_step_is_not_applied(tmp_path, bad):
    model = load_model(make_model_dir(tmp_path / "m", hidden=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    B, S, K, V = 2, 6, 3, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, S), generator=g)
    resp = torch.zeros(B, S, dtype=torch.long)
    resp[:, 2:] = 1
    t_ids = torch.rand(B, S, V, generator=g).argsort(-1)[..., :K]  # distinct ids per position
    t_lp = torch.log_softmax(torch.randn(B, S, K + 1, generator=g), -1)[..., :K].contiguous()
    data = StepData(ids, torch.ones(B, S, dtype=torch.long), resp, scores=TeacherScores(TeacherTopK(t_ids, t_lp)))
    loss_fn = DistillationLoss(DistillationConfig(loss_mode="topk", topk=K, support="tail", divergence="forward"))
    step = dict(micro_batch_tokens=64, grad_clip=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if bad == "loss_inf":
        out = train_step(model, opt, data, loss_fn=_InfLoss(loss_fn), **step)
    else:  # one parameter's gradient overflows (what fp16 or a huge learning rate produce)
        value = float("nan") if bad == "grad_nan" else float("inf")
        hook = model.model.layers[0].mlp.up_proj.weight.register_hook(lambda gr: gr.index_fill(0, torch.tensor([0]),
                                                                                                value))
        out = train_step(model, opt, data, loss_fn=loss_fn, **step)
        hook.remove()
    assert out["train/nonfinite"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the step was not applied
    assert all(p.grad is None for p in model.parameters())  # and its gradients are gone
    assert opt.state_dict()["state"] == {}  # the optimizer never stepped (no moments, no step count)
    out = train_step(model, opt, data, loss_fn=loss_fn, **step)
    assert out["train/nonfinite"] == 0.0 and not all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_overflow_mid_run_stops_with_exit_2_and_keeps_good_checkpoints(tmp_path, capsys, monkeypatch):
    from opdistill.train.steps.collect import Collector

    collect = Collector.__call__

    def poisoned(self, step, student):  # from step 3 on, a gradient overflows to NaN
        if step == 3:
            student.model.layers[0].mlp.up_proj.weight.register_hook(lambda gr: torch.full_like(gr, float("nan")))
        return collect(self, step, student)

    monkeypatch.setattr(Collector, "__call__", poisoned)
    cfg_file = _cfg_file(tmp_path, steps=10, eval={"num_prompts": 0}, checkpoint={"every": 1, "keep_last": 10})
    assert main(["train", "--config", str(cfg_file)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "opdistill train: run error: step 5: the loss or gradient norm was NaN/inf for 3 steps in a row "
        "(train.max_nonfinite_steps=3); none of them was applied and the run is stopped (last checkpoint: step 4). "
        + CAUSES.format(lr=0.01))
    run = tmp_path / "run"
    rows = [r for r in read_metrics(run) if "distillation/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["train/nonfinite_steps"] for r in rows] == [0.0, 0.0, 1.0, 2.0, 3.0]
    assert [r["train/grad_norm"] is None for r in rows] == [False, False, True, True, True]  # NaN logged as null
    ckpts = list_checkpoints(run)
    assert [p.name for p in ckpts] == [f"step_{s:08d}" for s in (1, 2, 3, 4)]
    for c in ckpts:
        verify_checkpoint(c)
        assert _all_finite(c)
    w2, w4 = (load_file(str(c / "model.safetensors")) for c in (ckpts[1], ckpts[3]))
    assert all(torch.equal(w2[k], w4[k]) for k in w2)  # steps 3 and 4 changed nothing

    # a higher limit lets a run ride out a short burst (the counter is "in a row")
    capsys.readouterr()
    assert main(["train", "--config", str(cfg_file), "--overwrite", "train.max_nonfinite_steps=20"]) == 0
    assert [r["train/nonfinite_steps"] for r in read_metrics(run) if "distillation/loss" in r][-1] == 8.0


def test_exploding_learning_rate_stops_the_run_without_a_nan_checkpoint(tmp_path, capsys):
    cfg_file = _cfg_file(tmp_path, steps=10, eval={"num_prompts": 0}, checkpoint={"every": 1, "keep_last": 10},
                         optim={"lr": 1e30})
    assert main(["train", "--config", str(cfg_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("opdistill train: run error: step ") and err.endswith(CAUSES.format(lr=1e30))
    ckpts = list_checkpoints(tmp_path / "run")
    assert ckpts and all(_all_finite(c) for c in ckpts)


def test_non_finite_weights_stop_the_run_at_the_checkpoint(tmp_path, capsys):
    # a finite but absurd weight decay turns the weights to inf/NaN in one applied step (finite loss and gradient)
    cfg_file = _cfg_file(tmp_path, steps=4, eval={"num_prompts": 0}, checkpoint={"every": 1, "keep_last": 10},
                         optim={"weight_decay": 1e300})
    assert main(["train", "--config", str(cfg_file)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "opdistill train: run error: step 1: weight model.embed_tokens.weight holds NaN/inf; the checkpoint is not written. "
        "Likely causes: fp16 overflow (use model.dtype=bfloat16 or float32), a learning rate too high (optim.lr), "
        "bad data or teacher scores")
    assert list_checkpoints(tmp_path / "run") == []
