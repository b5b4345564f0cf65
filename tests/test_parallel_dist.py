"""Vocab-parallel ops and data-parallel training on real gloo processes (2 and 4 ranks), vs one process.

One launch per world size runs every check of that size (see tests/parallel_training.py): the op checks assert
inside the workers; the training runs leave their final parameters and reduced metrics for the tests below.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from . import parallel_op_checks as C
from . import parallel_training as W
from .parallel_launch import launch

# A hung collective fails after gloo's 120 s timeout; this bounds the whole launch as well.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def reference():
    """(a) one process, 4 micro-batches, padded; and the same with the packed layout (d)."""
    return {"padded": W.reference_run(packed=False), "packed": W.reference_run(packed=True)}


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ranks2"))
    launch("tests.parallel_training:ranks2", 2, out)
    return out


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ranks4"))
    launch("tests.parallel_training:ranks4", 4, out)
    return out


def load(out_dir, tag):
    with open(os.path.join(out_dir, f"{tag}.json")) as f:
        return torch.load(os.path.join(out_dir, f"{tag}.pt")), json.load(f)


def assert_same_run(got, ref, tol=1e-5):
    params, history = got
    ref_params, ref_history = ref
    assert params.keys() == ref_params.keys()
    for name in params:
        err = (params[name] - ref_params[name]).abs().max().item()
        assert err <= tol, f"{name}: max abs difference {err:.3g}"
    moved = max((ref_params[n] - W.tiny_model().state_dict()[n]).abs().max().item() for n in ["lm_head.weight"])
    assert moved > 1e-3, "training did not move the parameters; the comparison would be vacuous"
    assert len(history) == len(ref_history) == W.TRAIN_STEPS
    for step, (m, r) in enumerate(zip(history, ref_history)):
        assert m.keys() == r.keys(), (step, sorted(set(m) ^ set(r)))
        for k in m:
            assert m[k] == pytest.approx(r[k], rel=1e-9, abs=1e-12), (step, k, m[k], r[k])


def test_padded_equals_packed_one_process(reference):
    assert_same_run(reference["packed"], reference["padded"])


def test_ops_two_ranks(ranks2):
    with open(os.path.join(ranks2, "ops_checks.txt")) as f:
        assert int(f.read()) == 2 * 2 * 2 * (len(C.COMBOS) + 4) + 40


def test_ddp_two_ranks_equals_one_process(ranks2, reference):
    assert_same_run(load(ranks2, "ddp"), reference["padded"])


def test_fsdp2_two_ranks_packed_equals_one_process(ranks2, reference):
    assert_same_run(load(ranks2, "fsdp"), reference["padded"])


def test_ops_four_ranks(ranks4):
    with open(os.path.join(ranks4, "ops_checks.txt")) as f:
        assert int(f.read()) == 2 * 2 * 2 * (len(C.COMBOS) + 4) + 40


def test_dp_x_tp_mesh_equals_one_process(ranks4, reference):
    assert_same_run(load(ranks4, "tp2x2"), reference["padded"])
