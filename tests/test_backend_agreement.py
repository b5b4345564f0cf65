"""Every loss family on every back-end (plain / vocab-parallel / fused) x masking x dtype agrees with the float64
definitions of tests/reference.py (``distillation_reference``): the objective, the gradients of the student's
inputs, and the reduced metrics.  Expectations come from reference.py only.  A new case is one row of CASES.

The vocab-parallel rows run in ONE 2-process gloo launch (module fixture) on padded shards (V = 11 over 2 ranks);
each rank checks its own gradient shard and writes its verdict per row, and each row's test reads it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch

from opdistill import (DistillationConfig, DistillationLoss, GlobalBatch, TeacherLogits, TeacherSampled, TeacherTopK,
                       policy_gradient_loss)
from opdistill.fused import StudentHidden, TeacherHidden

from . import reference as R
from .parallel_launch import launch

B, S, V, H, K = 3, 4, 11, 5, 3
WORLD = 2


@dataclass(frozen=True)
class Case:
    name: str
    cfg: dict  # DistillationConfig keyword arguments
    rl: bool = False  # True: policy_gradient_loss alone on the back-end's token log-probs (the trainer's RL method)


CASES = [  # every loss family: top-k support x divergence, sampled-token estimators, full JSD, policy / PPO paths
    Case("topk-truncated-forward", dict(support="truncated")),
    Case("topk-truncated-forward-lpclamp", dict(support="truncated", log_prob_min_clamp=-3.0, loss_agg_mode="token-sum")),
    Case("topk-tail-forward", dict(support="tail", temperature=0.7)),
    Case("topk-tail-reverse", dict(support="tail", divergence="reverse", loss_max_clamp=1.0)),
    Case("topk-tail-jsd0", dict(support="tail", divergence="jsd", beta=0.0)),
    Case("topk-tail-jsd", dict(support="tail", divergence="jsd", beta=0.3, loss_agg_mode="seq-mean-token-mean")),
    Case("topk-tail-jsd1", dict(support="tail", divergence="jsd", beta=1.0)),
    Case("topk-renorm-forward", dict(support="renormalized", loss_agg_mode="seq-mean-token-sum")),
    Case("topk-renorm-reverse", dict(support="renormalized", divergence="reverse", temperature=1.3)),
    Case("topk-renorm-jsd0", dict(support="renormalized", divergence="jsd", beta=0.0, loss_agg_mode="token-sum")),
    Case("topk-renorm-jsd", dict(support="renormalized", divergence="jsd", beta=0.7)),
    Case("topk-renorm-jsd1", dict(support="renormalized", divergence="jsd", beta=1.0, temperature=0.6)),
    Case("sampled-k2", dict(loss_mode="sampled", estimator="k2")),
    Case("sampled-k3", dict(loss_mode="sampled", estimator="k3", loss_agg_mode="seq-mean-token-sum-norm",
                            loss_scale_factor=4.0)),
    Case("sampled-abs", dict(loss_mode="sampled", estimator="abs", temperature=0.8)),
    Case("sampled-k1-pg", dict(loss_mode="sampled", estimator="k1", use_policy_gradient=True)),
    Case("full-jsd0", dict(loss_mode="full", beta=0.0)),
    Case("full-jsd", dict(loss_mode="full", beta=0.3, temperature=0.7, loss_max_clamp=0.2)),
    Case("full-jsd1", dict(loss_mode="full", beta=1.0, loss_agg_mode="seq-mean-token-mean")),
    Case("topk-tail-pg", dict(support="tail", use_policy_gradient=True, clip_ratio_low=0.1, clip_ratio_c=2.0)),
    Case("topk-task-rewards", dict(support="tail", divergence="reverse", use_task_rewards=True, distillation_coef=0.5)),
    Case("sampled-k3-pg-task", dict(loss_mode="sampled", use_policy_gradient=True, use_task_rewards=True,
                                    loss_agg_mode="seq-mean-token-mean")),
    Case("full-task-rewards", dict(loss_mode="full", use_task_rewards=True, temperature=1.2)),
    Case("rl-ppo", dict(loss_mode="sampled", clip_ratio_low=0.1, loss_agg_mode="seq-mean-token-sum"), rl=True),
]
MASKS = {  # [B, S]: holes (a prompt prefix, a fully masked row), nothing masked, everything masked
    "ragged": [[0, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1]],
    "none": [[1] * S] * B,
    "all": [[0] * S] * B,
}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
TOL = {"fp64": dict(rtol=1e-9, atol=1e-10), "fp32": dict(rtol=2e-5, atol=2e-5)}
ROWS = [(c, m, d) for c in CASES for m in MASKS for d in DTYPES]


def row_id(case, masking, dtype) -> str:
    return f"{case.name}-{masking}-{dtype}"


# -- inputs ------------------------------------------------------------------------------------------------------
def make_inputs(masking: str, dtype_name: str, seed: int = 0) -> dict:
    """Clean float64 data (the reference reads it) and, for the code, the same values in ``dtype`` with garbage
    (out-of-range ids, invalid log-probs, NaN) at every masked position."""
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, H, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8).to(dtype)
    bias = (torch.randn(V, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    th = torch.randn(B, S, H, generator=g, dtype=torch.float64).to(dtype)
    tw = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.9).to(dtype)
    tlog = torch.log_softmax((th.double() @ tw.double().T), -1)
    ids = tlog.topk(K, -1).indices  # [B, S, K] distinct ids
    ids[0, 1] = torch.tensor([V - 1, 0, 5])  # the last id (next to the shard padding) and id 0
    lp = tlog.gather(-1, ids)
    lp[2, 0, 2] = float("-inf")  # an empty slot in a valid row
    sampled = torch.randint(0, V, (B, S), generator=g)
    student_lp = torch.log_softmax(torch.nn.functional.linear(h.double(), w.double(), bias.double()), -1)
    old = student_lp.gather(-1, sampled[..., None])[..., 0] + 0.15 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = torch.tensor(MASKS[masking], dtype=torch.bool)
    keep, keep3 = mask, mask[..., None]
    nan = float("nan")
    return dict(
        mask=mask, h=h, w=w, bias=bias, th=th, tw=tw, ids=ids, lp=lp, sampled=sampled, old=old, adv=adv,
        t_sampled=tlog.gather(-1, sampled[..., None])[..., 0],
        code_ids=torch.where(keep3, ids, V + 5),
        code_lp=torch.where(keep3, lp, 1.0).to(dtype),
        code_t_sampled=torch.where(keep, tlog.gather(-1, sampled[..., None])[..., 0], nan).to(dtype),
        code_th=torch.where(keep3, th, nan),
        code_old=torch.where(keep, old, nan).to(dtype),
        code_adv=torch.where(keep, adv, nan).to(dtype),
    )


def student_logits(d) -> torch.Tensor:
    """The plain / vocab-parallel student: z = h W^T + b in the inputs' dtype (a leaf)."""
    return torch.nn.functional.linear(d["h"], d["w"], d["bias"]).detach()


# -- one row on one back-end -------------------------------------------------------------------------------------
def run_code(case: Case, d: dict, student, *, tp_group=None, vocab_size=None, teacher_logits=None, dp_group=None):
    """DistillationLoss on ``student`` (logits, a shard, or a StudentHidden); returns (objective, reduced metrics)."""
    cfg = DistillationConfig(**case.cfg)
    loss_fn = DistillationLoss(cfg, vocab_group=tp_group, vocab_size=vocab_size)
    batch = GlobalBatch.from_masks(d["mask"], group=dp_group, loss_scale_factor=cfg.loss_scale_factor)
    if case.rl:
        lp = loss_fn.backend(student).token_logprobs(student, d["sampled"], temperature=cfg.temperature)
        loss, metrics = policy_gradient_loss(lp, d["code_old"], d["code_adv"], d["mask"], batch, group=dp_group,
                                             loss_agg_mode=cfg.loss_agg_mode, clip_ratio_low=cfg.clip_ratio_low,
                                             clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c)
        return loss, metrics.reduce(group=dp_group)
    if cfg.loss_mode == "topk":
        teacher = TeacherTopK(d["code_ids"], d["code_lp"])
    elif cfg.loss_mode == "sampled":
        teacher = TeacherSampled(d["code_t_sampled"])
    elif isinstance(student, StudentHidden):
        teacher = TeacherHidden(d["code_th"], d["tw"] / 2, logit_scale=2.0)
    else:
        teacher = TeacherLogits(teacher_logits)
    loss, metrics = loss_fn(student, teacher, d["mask"], batch, sampled_ids=d["sampled"], old_logprobs=d["code_old"],
                            task_advantages=d["code_adv"], group=dp_group)
    return loss, metrics.reduce(group=dp_group)


def run_reference(case: Case, d: dict, z64: torch.Tensor, teacher_logits=None):
    """The reference on the values the code saw (``teacher_logits``: the full teacher's logits, default th tw^T)."""
    cfg = case.cfg
    if case.rl:
        keys = ("temperature", "loss_agg_mode", "loss_scale_factor", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
        return R.policy_reference(z64, d["mask"], d["sampled"], d["old"], d["adv"],
                                  **{k: v for k, v in cfg.items() if k in keys})
    mode = cfg.get("loss_mode", "topk")
    if mode == "topk":
        teacher = (d["ids"], d["lp"])
    elif mode == "sampled":
        teacher = d["t_sampled"]
    else:
        teacher = d["th"].double() @ d["tw"].double().T if teacher_logits is None else teacher_logits.double()
    return R.distillation_reference(z64, d["mask"], teacher, **cfg, sampled_ids=d["sampled"],
                                    old_logprobs=d["old"], advantages=d["adv"])


def grads(loss, leaves):
    gs = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(gs, leaves)]


def compare(what: str, got, want, tol) -> None:
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64),
                               msg=lambda m: f"{what}: {m}", **tol)


def compare_metrics(got: dict, want: dict, tol) -> None:
    for k, v in want.items():
        assert k in got, f"metric {k} missing; got {sorted(got)}"
        compare(f"metric {k}", got[k], v, tol)


def check_row(backend: str, case: Case, masking: str, dtype_name: str, *, rank=0, tp_group=None, dp_group=None):
    """Run one row on ``backend`` and compare with the reference; raises AssertionError naming what differs."""
    d = make_inputs(masking, dtype_name)
    tol = TOL[dtype_name]
    if backend == "fused":  # the head as a model with logit multiplier 2 has it: same logits h W^T + b
        h, w, b = (x.clone().requires_grad_(True) for x in (d["h"], d["w"] / 2, d["bias"] / 2))
        loss, metrics = run_code(case, d, StudentHidden(h, w, b, logit_scale=2.0))
        got = grads(loss, [h, w, b])
        h64, w64, b64 = (x.detach().double().requires_grad_(True) for x in (h, w, b))
        ref, ref_metrics = run_reference(case, d, torch.nn.functional.linear(h64, w64, b64) * 2.0)
        want = grads(ref, [h64, w64, b64])
        names = ("grad hidden", "grad weight", "grad bias")
    else:
        z = student_logits(d)
        tz = (d["th"] @ d["tw"].T).to(z.dtype)
        if backend == "plain":
            x = z.clone().requires_grad_(True)
            loss, metrics = run_code(case, d, x, teacher_logits=torch.where(d["mask"][..., None], tz, float("nan")))
        else:  # vocab-parallel: this rank's padded shard [..., Vl], garbage in the padding columns
            vl = -(-V // WORLD)
            pad = lambda y, v: torch.cat([y, torch.full(y.shape[:-1] + (vl * WORLD - V,), v, dtype=y.dtype)], -1)
            x = pad(z, 30.0)[..., rank * vl : (rank + 1) * vl].clone().requires_grad_(True)
            t = pad(torch.where(d["mask"][..., None], tz, float("nan")), -7.0)[..., rank * vl : (rank + 1) * vl]
            loss, metrics = run_code(case, d, x, tp_group=tp_group, vocab_size=V, teacher_logits=t, dp_group=dp_group)
        (gx,) = grads(loss, [x])
        z64 = z.double().requires_grad_(True)
        ref, ref_metrics = run_reference(case, d, z64, teacher_logits=tz)
        (gz,) = grads(ref, [z64])
        if backend == "vocab-parallel":
            start, width = rank * vl, max(0, min(vl, V - rank * vl))
            assert not gx[..., width:].any(), "gradient on the padding columns"
            gx, gz = gx[..., :width], gz[..., start : start + width]
        got, want, names = [gx], [gz], ("grad logits",)
    assert loss.dtype == (torch.float64 if dtype_name == "fp64" else torch.float32), f"objective dtype {loss.dtype}"
    compare("objective", loss.detach(), ref.detach(), tol)
    for n, a, e in zip(names, got, want):
        assert torch.isfinite(a).all(), f"{n} is not finite"
        compare(n, a, e, tol)
    compare_metrics(metrics, ref_metrics, tol)
    if masking != "all":
        assert any(a.abs().max() > 0 for a in got), "vacuous: no gradient"


# -- the tests ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["plain", "fused"])
@pytest.mark.parametrize("case,masking,dtype_name", ROWS, ids=[row_id(*r) for r in ROWS])
def test_in_process_backends_agree_with_reference(backend, case, masking, dtype_name):
    check_row(backend, case, masking, dtype_name)


def _vp_worker(rank: int, world: int, out_dir: str) -> None:
    """Every row on the vocab-parallel back-end (tests/parallel_launch.py initialises the gloo group)."""
    import torch.distributed as dist

    from opdistill.loss import select_backend

    dp = [dist.new_group([r]) for r in range(world)][rank]  # pure tensor parallelism: data-parallel size 1
    verdicts = {}
    for case, masking, dtype_name in ROWS:
        try:
            check_row("vocab-parallel", case, masking, dtype_name, rank=rank, tp_group=dist.group.WORLD, dp_group=dp)
            verdicts[row_id(case, masking, dtype_name)] = "ok"
        except Exception as e:  # comparisons run after every collective of the row: the ranks stay in step
            verdicts[row_id(case, masking, dtype_name)] = f"rank {rank}: {e}"
    # a DTensor sharded on the vocabulary selects the vocab-parallel back-end without a group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dt = distribute_tensor(torch.randn(2, 2 * world), init_device_mesh("cpu", (world,)), [Shard(-1)])
    verdicts["dtensor"] = select_backend(dt).name
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(verdicts, f)


@pytest.fixture(scope="module")
def vp_verdicts(tmp_path_factory):
    out = tmp_path_factory.mktemp("vp_agreement")
    launch("tests.test_backend_agreement:_vp_worker", WORLD, str(out))
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {k: [v[k] for v in per_rank] for k in per_rank[0]}


@pytest.mark.parametrize("case,masking,dtype_name", ROWS, ids=[row_id(*r) for r in ROWS])
def test_vocab_parallel_agrees_with_reference(vp_verdicts, case, masking, dtype_name):
    verdicts = vp_verdicts[row_id(case, masking, dtype_name)]
    assert verdicts == ["ok"] * WORLD, "\n".join(v for v in verdicts if v != "ok")


def test_dtensor_logits_select_the_vocab_parallel_backend(vp_verdicts):
    assert vp_verdicts["dtensor"] == ["vocab-parallel"] * WORLD


# -- the dispatch itself ---------------------------------------------------------------------------------------------
def test_one_dispatch_picks_the_backend_from_the_student_and_the_layout():
    from opdistill.loss import select_backend

    z, sh = torch.randn(2, 3, V), StudentHidden(torch.randn(2, 3, H), torch.randn(V, H))
    assert select_backend(z).name == "plain"
    assert select_backend(z, vocab_size=V).name == "vocab-parallel"  # padded shards on one rank
    assert select_backend(sh).name == "fused" and select_backend(sh).weighted_topk is not None
    assert select_backend(z).weighted_topk is None
    assert DistillationLoss(DistillationConfig(), vocab_size=V).backend(z).name == "vocab-parallel"


def test_dispatch_refusals():
    from opdistill.loss import select_backend

    sh = StudentHidden(torch.randn(2, 3, H), torch.randn(V, H))
    with pytest.raises(TypeError, match=r"^student must be logits \(a torch.Tensor or DTensor\) or a StudentHidden, "
                                        r"got list$"):
        select_backend([1.0])
    with pytest.raises(ValueError, match=r"^vocab_size=11 describes padded logit shards; a StudentHidden's vocabulary "
                                         r"is its weight's rows \(over vocab_group\): drop vocab_size$"):
        select_backend(sh, vocab_size=V)
    with pytest.raises(ValueError, match=r"^vocab_size must be an int >= 1 or None, got 0$"):
        DistillationLoss(DistillationConfig(), vocab_size=0)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^sampled_ids must have the shape of mask \(2, 3\), got \(2,\)$"):
        DistillationLoss(DistillationConfig(use_policy_gradient=True))(
            torch.randn(2, 3, V), TeacherTopK(torch.arange(K).expand(2, 3, K), torch.full((2, 3, K), -2.0)),
            mask, GlobalBatch.from_masks(mask), sampled_ids=torch.zeros(2, dtype=torch.long),
            old_logprobs=torch.zeros(2, 3))
