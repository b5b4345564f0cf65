"""The teacher wire (issue 37): a teacher server is who it says it is on every answer, and every remote input is
bounded.

Servers run in this process (uvicorn in a thread): the real app (``opdistill.serve.app.create_app``) over the tiny
teachers, restarted on the same port with another teacher; and a stand-in whose ``/info``, ``/v1/score``,
``/v1/lm_head`` and ``/v1/tokenizer`` answer what each test sets (a broken or hostile server). Expectations come from
the in-process teacher scoring the same rows, never from the code under test.
"""
import functools
import json
import logging
import struct
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("httpx", reason="the serve extra (pip install -e '.[serve]') is not installed")
pytest.importorskip("fastapi", reason="the serve extra (pip install -e '.[serve]') is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra (pip install -e '.[serve]') is not installed")

from opdistill.errors import ConfigError  # noqa: E402
from opdistill.models import load_model, load_tokenizer  # noqa: E402
from opdistill.serve.app import TeacherService, create_app, score_rows  # noqa: E402
from opdistill.teachers import LocalTeacher, RemoteTeacher, ScoreRequest, TeacherPool  # noqa: E402
from opdistill.teachers.http import TeacherServiceError  # noqa: E402
from opdistill.teachers.wire import MAGIC, encode_head  # noqa: E402
from opdistill.train import load_config  # noqa: E402
from tests.test_teacher_pool import _rows as pool_rows  # noqa: E402
from tests.server_helpers import free_port  # noqa: E402
from tests.trainer_helpers import make_model_dir, tiny_config_dict  # noqa: E402


class Served:
    """An ASGI app served by uvicorn on 127.0.0.1:``port`` in a thread of this process, until :meth:`stop`."""

    def __init__(self, app, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        assert self.server.started, "the in-process server did not start"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wire")
    cfg = tiny_config_dict(tmp)  # tmp/teacher (seed 1), tmp/student
    other = make_model_dir(tmp / "other_teacher", hidden=32, layers=2, seed=7)  # the same tokenizer, other weights
    return cfg["model"]["teacher"], other, load_tokenizer(cfg["model"]["teacher"])


def service(path, tok, model_id="the-teacher"):
    return TeacherService(LocalTeacher(load_model(path)), tok, model_id=model_id, max_k=8)


_rows = functools.partial(pool_rows, 4)  # 4 rows of the pool tests' kind


def _one_line(msg: str):
    assert "\n" not in msg and "Traceback" not in msg, msg


# -- 1. identity on every answer ---------------------------------------------------------------------------------------
def test_a_server_restarted_with_another_teacher_is_refused_on_its_next_answer(models):
    teacher, other, tok = models
    port = free_port()
    first = Served(create_app(service(teacher, tok)), port)
    client = RemoteTeacher(first.url, retries=3, backoff_s=0.2)
    try:
        client.check_student(tok, k=4)
        rows = _rows()
        client.score(rows, ScoreRequest(k=4, sampled=True, what="step 1"))
        first.stop()  # the server restarts (the same name and port) serving another teacher
        second = Served(create_app(service(other, tok)), port)
        try:
            with pytest.raises(TeacherServiceError, match="answered by another teacher") as e:
                client.score(rows, ScoreRequest(k=4, sampled=True, what="step 2"))
        finally:
            second.stop()
    finally:
        client.close()
    msg = str(e.value)
    _one_line(msg)
    assert type(e.value).__name__ == "TeacherChanged"
    assert msg.startswith(f"teacher.url={first.url}: POST /v1/score (step 2) was answered by another teacher than the "
                          f"one accepted at start (teacher_weights_sha256: accepted ")
    assert "continue the run with --resume" in msg


@pytest.fixture(scope="module")
def live(models):
    """The real app over the teacher, its TeacherService at hand (a test changes what it answers, then restores)."""
    teacher, _, tok = models
    svc = service(teacher, tok)
    served = Served(create_app(svc), free_port())
    yield served.url, svc
    served.stop()


def test_an_answer_whose_model_or_identity_differs_from_its_info_is_refused(models, live):
    _, _, tok = models
    url, svc = live
    rows = _rows(seed=1)
    with RemoteTeacher(url, payload="json") as client:
        client.check_student(tok, k=4)
        svc.model_id = "another-model"  # /info still names the-teacher; the answers say another-model
        try:
            with pytest.raises(TeacherServiceError, match="answered by another teacher") as e:
                client.score(rows, ScoreRequest(k=4, sampled=True, what="step 3"))
        finally:
            svc.model_id = "the-teacher"
        assert "model: accepted 'the-teacher', answered 'another-model'" in str(e.value)
        _one_line(str(e.value))
        saved = svc.identity
        svc.identity = None  # a server whose /info promised its identity on every answer answers without it
        try:
            with pytest.raises(TeacherServiceError, match="answered by another teacher") as e:
                client.score(rows, ScoreRequest(k=4, sampled=True, what="step 4"))
        finally:
            svc.identity = saved
        assert "promised it on every answer" in str(e.value)
        client.score(rows, ScoreRequest(k=4, sampled=True, what="step 5"))  # as it was: accepted


def test_an_older_server_without_identity_on_its_answers_is_still_read(models, live):
    _, _, tok = models
    url, svc = live
    saved_info, saved_identity = dict(svc.info), getattr(svc, "identity", None)
    svc.info.pop("answer_identity", None)
    svc.identity = None
    try:
        with RemoteTeacher(url) as client:
            client.check_student(tok, k=4)
            got = client.score(_rows(seed=2), ScoreRequest(k=4, sampled=True))
        want = svc.teacher.score(_rows(seed=2), ScoreRequest(k=4, sampled=True))
        assert torch.equal(got.topk.ids, want.topk.ids) and torch.equal(got.topk.logprobs, want.topk.logprobs)
    finally:
        svc.info.clear()
        svc.info.update(saved_info)
        svc.identity = saved_identity


def test_a_pool_takes_out_a_server_restarted_with_another_teacher_and_goes_on(models, caplog):
    teacher, other, tok = models
    ports = [free_port(), free_port()]
    servers = [Served(create_app(service(teacher, tok)), p) for p in ports]
    clients = [RemoteTeacher(s.url, key=f"teacher.url.{i}", retries=1, backoff_s=0.1) for i, s in enumerate(servers)]
    pool = TeacherPool(clients, probe_s=60, patience_s=5)
    rows, req = _rows(seed=3), ScoreRequest(k=4, sampled=True, what="step 2")
    local = LocalTeacher(load_model(teacher))
    try:
        pool.check_student(tok, k=4)
        pool.score(rows, req)
        servers[1].stop()
        servers[1] = Served(create_app(service(other, tok)), ports[1])  # the second comes back as another teacher
        with caplog.at_level(logging.WARNING, logger="opdistill.teachers.pool"):
            got = pool.score(rows, req)
        halves = [local.score(rows.select(torch.arange(0, 2)), req), local.score(rows.select(torch.arange(2, 4)), req)]
        assert torch.equal(got.topk.ids[:2], halves[0].topk.ids) and torch.equal(got.topk.ids[2:], halves[1].topk.ids)
        assert torch.equal(got.topk.logprobs[2:], halves[1].topk.logprobs)  # the teacher's, not the other's
        assert pool.metrics()["teacher/servers_healthy"] == 1
        lines = [r.getMessage() for r in caplog.records if "taken out of the pool" in r.getMessage()]
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"teacher.url.1={servers[1].url}: taken out of the pool (POST /v1/score (step 2 "
                                   f"[rows 2:4]) was answered by another teacher than the one accepted at start "
                                   f"(teacher_weights_sha256: accepted ")
        assert "connect" not in lines[0].lower()
    finally:
        pool.close()
        for s in servers:
            s.stop()


# -- 2. pool entries normalized ---------------------------------------------------------------------------------------
class _Client:
    background, engine_name, limits = False, "hf", {}

    def __init__(self, url):
        self.url = url

    def close(self):
        pass


def test_a_pool_refuses_one_server_listed_under_aliases():
    for urls, pair in [(["http://127.0.0.1:8123", "http://localhost:8123", "http://127.1:8123"], (0, 1)),
                       (["http://127.0.0.1:8124", "http://127.0.0.1:8125", "http://127.1:8125/"], (1, 2))]:
        with pytest.raises(ConfigError) as e:
            TeacherPool([_Client(u) for u in urls], key="teacher.url")
        i, j = pair
        msg = str(e.value)
        _one_line(msg)
        assert msg.startswith(f"teacher.url: entries {i} ({urls[i]}) and {j} ({urls[j]}) are one server (http, "
                              f"127.0.0.1, port {8123 if i == 0 else 8125}); list each server of a pool once"), msg
    # other ports, or http and https: other servers
    TeacherPool([_Client(u) for u in ["http://127.0.0.1:8123", "http://localhost:8124", "https://127.1:8123"]]).close()


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://[::1:80", "http://127.0.0.1:0", "http://:80",
                                 "http://h:port"])
def test_a_malformed_teacher_url_is_one_config_line(url):
    base = {"model": {"student": "s"}, "loss": {"topk": 4}}
    for value in (url, ["http://127.0.0.1:8000", url]):
        with pytest.raises(ConfigError, match=r"^teacher.url: ") as e:
            load_config(base={**base, "teacher": {"url": value}})
        _one_line(str(e.value))
        assert url in str(e.value)


# -- a stand-in server answering what a test sets ----------------------------------------------------------------------
def stand_in_app(state: dict):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    app = FastAPI()

    @app.get("/info")
    def info():
        return JSONResponse(state["info"])

    @app.post("/v1/score")
    async def score(request: Request):
        body, media = state["score"](await request.json())
        return Response(body, media_type=media)

    @app.get("/v1/lm_head")
    def lm_head():
        return Response(state["head"], media_type="application/octet-stream")

    @app.get("/v1/tokenizer")
    def tokenizer():
        return JSONResponse(state["tokenizer"])

    return app


@pytest.fixture(scope="module")
def stand_in(models):
    teacher, _, tok = models
    svc = service(teacher, tok)
    state: dict = {}
    served = Served(stand_in_app(state), free_port())
    yield served.url, state, svc
    served.stop()


def _fresh(state, svc, **info):
    """The stand-in's /info: the real server's (what its app answers), with ``info`` changed."""
    state.clear()
    state["info"] = {**svc.info, "max_request_tokens": 262144, **info}


def _binary(header: dict, arrays: list) -> bytes:
    """An opdistill-v1 payload of ``header`` and ``arrays`` [(name, array as it travels)], laid out as the server
    lays it out (a test writes the arrays a broken server would)."""
    entries, offset = [], 0
    for name, a in arrays:
        entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
        offset += a.nbytes
    hb = json.dumps({**header, "arrays": entries}).encode()
    return b"".join([MAGIC, struct.pack("<I", len(hb)), hb] + [np.ascontiguousarray(a).tobytes() for _, a in arrays])


def _answer(svc, body, *, hidden=None):
    """The real answer to ``body`` (ScoreResult) and its binary header fields."""
    t = lambda name: torch.tensor(body[name])  # noqa: E731
    r = score_rows(svc.teacher, t("input_ids"), t("attention_mask"), t("response_mask"), k=body["k"],
                   temperature=body["temperature"], hidden=hidden)
    header = {"model": svc.model_id, "temperature": r.temperature, "num_positions": len(r.next_logprobs),
              "k": body["k"], "num_requested": None, "logprobs": "fp32"}
    if getattr(svc, "identity", None) is not None:  # what the real server sends (an older one: nothing)
        header["teacher"] = svc.identity
    return r, header


def _score_answers(state, svc, change):
    """/v1/score answers the real scores, laid out by ``change(result, header)`` -> (header, arrays)."""
    def score(body):
        r, header = _answer(svc, body, hidden=body.get("hidden"))
        h, arrays = change(r, header)
        return _binary(h, arrays), "application/x-opdistill-v1;logprobs=fp32"
    state["score"] = score


def _lp(r):
    return [("next_logprobs", r.next_logprobs[:, None].astype("<f4")), ("topk_ids", r.topk_ids.astype("<u2")),
            ("topk_logprobs", r.topk_logprobs.astype("<f4"))]


# -- 3. every field of every answer validated by type and range --------------------------------------------------------
def test_ids_sent_as_floats_are_refused_both_ways(models, live, stand_in):
    import httpx

    _, _, tok = models
    url, _ = live
    good = {"input_ids": [[1, 2, 3, 4]], "attention_mask": [[1, 1, 1, 1]], "response_mask": [[0, 0, 1, 1]], "k": 2}
    for field, value in (("input_ids", [[1, 2.0, 3, 4]]), ("requested_ids", [[1.0], [2]]), ("k", 2.0)):
        r = httpx.post(url + "/v1/score", json={**good, field: value})
        assert r.status_code in (400, 422) and r.json()["detail"].startswith(f"{field}: expected"), r.text
    # the client: ids that travel as floats (a binary answer's topk_ids as float32) are refused, naming the field
    surl, state, svc = stand_in
    _fresh(state, svc)
    _score_answers(state, svc, lambda r, h: (h, [(n, a.astype("<f4") if n == "topk_ids" else a) for n, a in _lp(r)]))
    with RemoteTeacher(surl) as client:
        client.check_student(tok, k=4)
        with pytest.raises(TeacherServiceError) as e:
            client.score(_rows(), ScoreRequest(k=4, sampled=True, what="step 1"))
    msg = str(e.value)
    _one_line(msg)
    assert msg.startswith(f"teacher.url={surl}: POST /v1/score (step 1) answered a malformed payload (array "
                          f"'topk_ids': dtype '<f4'"), msg


@pytest.mark.parametrize("field, value", [("temperature", "1.0"), ("num_positions", 3.5), ("k", "4"),
                                          ("model", 7), ("teacher", ["x"])])
def test_answer_header_fields_of_the_wrong_type_are_refused(models, stand_in, field, value):
    _, _, tok = models
    surl, state, svc = stand_in
    _fresh(state, svc)
    _score_answers(state, svc, lambda r, h: ({**h, field: value}, _lp(r)))
    with RemoteTeacher(surl) as client:
        client.check_student(tok, k=4)
        with pytest.raises(TeacherServiceError) as e:
            client.score(_rows(), ScoreRequest(k=4, sampled=True, what="step 1"))
    _one_line(str(e.value))
    assert f"answered a malformed payload ({field}: expected" in str(e.value), str(e.value)


@pytest.mark.parametrize("field, value", [("max_k", "64"), ("max_request_tokens", "1000"), ("max_k", 2.5),
                                          ("teacher_vocab_size", True), ("fixed_temperature", "1")])
def test_info_limits_that_are_not_numbers_are_refused(models, stand_in, field, value):
    _, _, tok = models
    surl, state, svc = stand_in
    _fresh(state, svc, **{field: value})
    with RemoteTeacher(surl) as client:
        with pytest.raises(TeacherServiceError) as e:
            client.check_student(tok, k=4)
    _one_line(str(e.value))
    assert str(e.value).startswith(f"teacher.url={surl}: GET /info answered an invalid field: {field}: expected")


def test_an_answer_of_the_wrong_k_says_k(models, stand_in):
    _, _, tok = models
    surl, state, svc = stand_in
    _fresh(state, svc)

    def three(r, h):
        return {**h, "k": 3}, [("next_logprobs", r.next_logprobs[:, None].astype("<f4")),
                               ("topk_ids", r.topk_ids[:, :3].astype("<u2")),
                               ("topk_logprobs", r.topk_logprobs[:, :3].astype("<f4"))]
    _score_answers(state, svc, three)
    with RemoteTeacher(surl) as client:
        client.check_student(tok, k=4)
        with pytest.raises(TeacherServiceError) as e:
            client.score(_rows(), ScoreRequest(k=4, sampled=True, what="step 1"))
    assert str(e.value) == (f"teacher.url={surl}: POST /v1/score (step 1) answered K=3 top-k ids per position "
                            f"(field topk_ids), asked K=4")


# -- 4. hidden states and heads validated against /info ----------------------------------------------------------------
def _hidden_answer(state, svc, hidden_array, label="fp32"):
    def change(r, h):
        return {**h, "hidden_dtype": label, "hidden_size": int(hidden_array(r).shape[1])}, \
            _lp(r) + [("hidden", hidden_array(r))]
    _score_answers(state, svc, change)


@pytest.mark.parametrize("case", ["u2 labelled fp32", "fp16 labelled fp32", "bf16 when fp32 asked", "wrong width"])
def test_hidden_states_that_break_info_are_refused(models, stand_in, case):
    from opdistill.teachers.wire import _bf16_bits

    _, _, tok = models
    surl, state, svc = stand_in
    _fresh(state, svc)
    arrays = {"u2 labelled fp32": (lambda r: _bf16_bits(r.hidden), "fp32"),
              "fp16 labelled fp32": (lambda r: r.hidden.astype("<f2"), "fp32"),
              "bf16 when fp32 asked": (lambda r: _bf16_bits(r.hidden), "bf16"),
              "wrong width": (lambda r: np.concatenate([r.hidden, r.hidden[:, :1]], 1).astype("<f4"), "fp32")}[case]
    _hidden_answer(state, svc, *arrays)
    rows = _rows()
    with RemoteTeacher(surl, hidden_payload="fp32") as client:
        client.check_student(tok, k=4, hidden=True)
        with pytest.raises(TeacherServiceError) as e:
            client.score_positions(rows.input_ids, rows.attention_mask, rows.response_mask, k=4, what="step 1",
                                   hidden="fp32")
    msg = str(e.value)
    _one_line(msg)
    assert msg.startswith(f"teacher.url={surl}: POST /v1/score (step 1) answered "), msg
    want = {"u2 labelled fp32": "array 'hidden': dtype '<u2'", "fp16 labelled fp32": "array 'hidden': dtype '<f2'",
            "bf16 when fp32 asked": "answered hidden states as bf16 (field hidden_dtype), asked fp32",
            "wrong width": f"hidden states of width {svc.info['hidden_size'] + 1} (field hidden), its /info states "
                           f"hidden_size {svc.info['hidden_size']}"}[case]
    assert want in msg, msg
    # the right answer passes
    _hidden_answer(state, svc, lambda r: r.hidden.astype("<f4"))
    with RemoteTeacher(surl) as client:
        client.check_student(tok, k=4, hidden=True)
        client.score_positions(rows.input_ids, rows.attention_mask, rows.response_mask, k=4, hidden="fp32")


@pytest.mark.parametrize("case", ["fp16 head", "bf16 head", "fp64 head", "NaN head", "logit_scale 0",
                                  "logit_scale inf", "wrong width"])
def test_a_head_that_breaks_info_is_refused(models, stand_in, case):
    from opdistill.fused import LMHead
    from opdistill.teachers.wire import head_sha256

    _, _, tok = models
    surl, state, svc = stand_in
    w, scale = svc.head.weight.detach().clone(), 1.0
    if case.endswith(" head") and case != "NaN head":
        w = w.to({"fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}[case.split()[0]])
    elif case == "NaN head":
        w[3, 2] = float("nan")
    elif case == "wrong width":
        w = torch.cat([w, w[:, :1]], 1)
    else:
        scale = float(case.split()[1])
    _fresh(state, svc, lm_head_sha256=head_sha256(w, None))
    state["head"] = encode_head(LMHead(w, None, scale, None, "t"))
    with RemoteTeacher(surl) as client:
        client.check_student(tok, k=4, hidden=True)
        with pytest.raises(TeacherServiceError) as e:
            client.head  # noqa: B018
    msg = str(e.value)
    _one_line(msg)
    assert msg.startswith(f"teacher.url={surl}: GET /v1/lm_head answered "), msg
    want = {"fp16 head": "its weight is float16, the teacher's dtype (teacher_dtype) is float32",
            "bf16 head": "its weight is bfloat16", "fp64 head": "its weight is float64",
            "NaN head": "its weight holds NaN or inf", "logit_scale 0": "logit_scale is 0.0",
            "logit_scale inf": "logit_scale is inf", "wrong width": "its weight has shape"}[case]
    assert want in msg, msg


# -- 5. tokenizer files from a server ----------------------------------------------------------------------------------
def _tokenizer_files(tok):
    from opdistill.serve.app import tokenizer_payload

    return tokenizer_payload(tok)


@pytest.mark.parametrize("case", ["empty name", "NUL", "300-char name", "a list", "no model", "1,000,000 tokens"])
def test_served_tokenizer_files_are_bounded(models, stand_in, case):
    _, _, tok = models
    surl, state, svc = stand_in
    _fresh(state, svc)
    files = _tokenizer_files(tok)
    big = None
    if case == "1,000,000 tokens":
        big = json.loads(files["tokenizer.json"])
        big["model"] = {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(1_000_000)}, "unk_token": "t0"}
    state["tokenizer"] = {"empty name": {**files, "": "{}"}, "NUL": {**files, "a\x00b.json": "{}"},
                          "300-char name": {**files, "x" * 300: "{}"}, "a list": {**files, "tokenizer.json": "[]"},
                          "no model": {**files, "tokenizer.json": '{"model": 3}'},
                          "1,000,000 tokens": {**files, "tokenizer.json": json.dumps(big) if big else ""}}[case]
    with RemoteTeacher(surl) as client:
        with pytest.raises(TeacherServiceError) as e:
            client.fetch_tokenizer()
    msg = str(e.value)
    _one_line(msg)
    assert msg.startswith(f"teacher.url={surl}: GET /v1/tokenizer answered "), msg
    want = {"empty name": "a file named ''", "NUL": "a file named 'a\\x00b.json'", "300-char name": "a file named 'xxx",
            "a list": "tokenizer.json that is not a JSON object", "no model": "tokenizer.json without the shape",
            "1,000,000 tokens": f"token ids up to 999999, above the teacher's output width "
                                f"{svc.info['teacher_vocab_size']}"}[case]
    assert want in msg, msg
    state["tokenizer"] = files  # the real files pass
    with RemoteTeacher(surl) as client:
        assert client.fetch_tokenizer().get_vocab() == tok.get_vocab()
