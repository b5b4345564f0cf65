"""The trainer's AdamW (opdistill/train/run/optim.py): the fused / foreach kernels against a float64 AdamW written out
here, bitwise agreement where torch promises it, exact resume through a checkpoint, and the refusals."""
import pytest
import torch

from opdistill.data import CARRY_ADD_CHARS
from opdistill.errors import ConfigError
from opdistill.models import build_tiny_llama, char_tokenizer
from opdistill.train.disk.checkpoint import load_checkpoint, save_checkpoint
from opdistill.train.run.config import OptimConfig, load_config
from opdistill.train.run.optim import build_optimizer, fused_supported


def _cfg(**optim):
    return OptimConfig(**optim)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _llama(seed=0):
    return build_tiny_llama(char_tokenizer(CARRY_ADD_CHARS), hidden_size=16, num_layers=1, num_heads=2, seed=seed)


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return lambda p: torch.randn(p.shape, generator=g)


def _run(model, opt, steps, start=0):
    for s in range(start, start + steps):
        draw = _grads(s)
        for p in model.parameters():
            p.grad = draw(p)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _adamw_fp64(params, steps, lr, b1, b2, wd, eps=1e-8):
    """AdamW (decoupled weight decay, bias-corrected moments) in float64, from its definition."""
    ps = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    for s in range(steps):
        draw = _grads(s)
        for i, p in enumerate(ps):
            g = draw(params[i]).double()
            p.mul_(1 - lr * wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat, vhat = m[i] / (1 - b1 ** (s + 1)), v[i] / (1 - b2 ** (s + 1))
            p.sub_(lr * mhat / (vhat.sqrt() + eps))
    return ps


def test_auto_is_fused_on_cpu_and_every_kernel_is_adamw():
    assert fused_supported(list(_model().parameters()))  # torch >= 2.4 has a fused CPU AdamW
    oc = _cfg(lr=1e-3, weight_decay=0.1, beta1=0.8, beta2=0.99)
    assert oc.implementation == "auto"
    ref = _adamw_fp64(list(_model().parameters()), 3, 1e-3, 0.8, 0.99, 0.1)
    out = {}
    for impl in ("auto", "fused", "foreach", "single"):
        model = _model()
        opt = build_optimizer(model.parameters(), oc, implementation=impl)
        assert opt.defaults["fused"] is (True if impl in ("auto", "fused") else None)
        assert opt.defaults["foreach"] is {"foreach": True, "single": False}.get(impl)
        assert opt.defaults["lr"] == 1e-3 and opt.defaults["betas"] == (0.8, 0.99)
        assert opt.defaults["weight_decay"] == 0.1
        _run(model, opt, 3)
        out[impl] = [p.detach().clone() for p in model.parameters()]
        for got, want in zip(out[impl], ref):  # fp32 rounding of 3 steps (~1e-7 on weights of size ~0.2)
            torch.testing.assert_close(got.double(), want, atol=2e-7, rtol=0)
    for a, b in zip(out["foreach"], out["single"]):  # torch's multi-tensor path is the reference bit for bit
        assert torch.equal(a, b)
    for a, b in zip(out["auto"], out["fused"]):
        assert torch.equal(a, b)
    # torch's default AdamW (what the trainer built before) is the single-tensor path on CPU
    model = _model()
    _run(model, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1), 3)
    for a, b in zip(model.parameters(), out["single"]):
        assert torch.equal(a.detach(), b)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_resume_through_a_checkpoint_is_exact(tmp_path, impl):
    oc = _cfg(lr=1e-2, weight_decay=0.01)
    full = _llama()
    opt = build_optimizer(full.parameters(), oc, implementation=impl)
    _run(full, opt, 5)

    first = _llama()
    opt1 = build_optimizer(first.parameters(), oc, implementation=impl)
    sched1 = torch.optim.lr_scheduler.LambdaLR(opt1, lambda s: 1.0)
    _run(first, opt1, 3)
    path = save_checkpoint(tmp_path, 3, first, opt1, sched1, {"train_time": 0.0})
    resumed = _llama(seed=7)  # other weights: all come from the checkpoint
    opt2 = build_optimizer(resumed.parameters(), oc, implementation=impl)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    load_checkpoint(path, resumed, opt2, sched2)
    assert opt2.param_groups[0]["fused"] is opt1.param_groups[0]["fused"]
    _run(resumed, opt2, 2, start=3)
    for a, b in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(a, b)


def test_refusals():
    meta = [torch.nn.Parameter(torch.zeros(3, device="meta"))]  # a device torch has no fused kernel for
    assert not fused_supported(meta)
    with pytest.raises(ConfigError, match=r"^optim.implementation=fused: torch .* has no fused AdamW kernel for device "
                                          r"\['meta'\]; use optim.implementation=auto or foreach$"):
        build_optimizer(meta, _cfg(), implementation="fused")
    assert build_optimizer(meta, _cfg()).defaults["foreach"] is True  # auto falls back to foreach
    with pytest.raises(ConfigError, match=r"^optim.implementation: expected one of \['auto', 'fused', 'foreach', "
                                          r"'single'\], got 'adam'$"):
        build_optimizer(list(_model().parameters()), _cfg(), implementation="adam")
    with pytest.raises(ConfigError, match="^optim.implementation: "):
        load_config(None, overrides=["model.student=s", "optim.implementation=adam"])
