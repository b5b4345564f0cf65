"""The teacher cache (format v2): provenance and checksum written by ``save_cache`` / ``opdistill score``, and every
refusal of ``load_cache`` -- another tokenizer or teacher, a flipped byte, an invalid value, a v1 cache -- with the
exact exception type and message. The checksum and the weights hash are recomputed here from their definitions
(docs/trainer.md, "Teacher cache"), not with the code under test."""
import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

import opdistill
from opdistill.cli import main
from opdistill.data import CARRY_ADD_CHARS
from opdistill.models import build_tiny_llama, char_tokenizer
from opdistill.teachers.cache import CACHE_FORMAT, TeacherCacheError, load_cache, save_cache
from opdistill.teachers.local import score_teacher
from opdistill.teachers.fingerprint import tokenizer_fingerprint
from tests.trainer_helpers import make_model_dir, tiny_config_dict

SWAPPED_CHARS = "1023456789+=,>"  # CARRY_ADD_CHARS with '0' and '1' swapped: same size, other ids
RESCORE = "re-score the cache with `opdistill score`"


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def _hash_tensor(h, name, t):
    h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
    h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def reference_checksum(tensors: dict, prov: dict) -> str:
    h = hashlib.sha256(_canonical({k: v for k, v in prov.items() if k != "checksum_sha256"}))
    for name in sorted(tensors):
        _hash_tensor(h, name, tensors[name])
    return h.hexdigest()


def reference_weights_sha256(model) -> str:
    h = hashlib.sha256()
    sd = model.state_dict()
    for name in sorted(sd):
        _hash_tensor(h, name, sd[name])
    return h.hexdigest()


def read_raw(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def rewrite(path, mutate):
    """Apply ``mutate(tensors)`` and write the file back with a correct checksum: only the value checks can object."""
    tensors, meta = read_raw(path)
    mutate(tensors)
    prov = json.loads(meta["provenance"])
    prov["checksum_sha256"] = reference_checksum(tensors, prov)
    save_file(tensors, str(path), metadata={"format": meta["format"], "provenance": json.dumps(prov)})


@pytest.fixture(scope="module")
def models():
    tok = char_tokenizer(CARRY_ADD_CHARS)
    teacher = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2, seed=1)
    return tok, teacher


@pytest.fixture(scope="module")
def scored(models):
    tok, teacher = models
    g = torch.Generator().manual_seed(0)
    B, S, V = 4, 9, len(tok)
    ids = torch.randint(4, V, (B, S), generator=g)
    attn = torch.ones(B, S, dtype=torch.long)
    attn[1, :2] = 0  # left padding
    ids[1, :2] = tok.pad_token_id
    resp = torch.zeros(B, S, dtype=torch.long)
    resp[:, 5:] = 1
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    scores = score_teacher(teacher, ids, attn, k=3, sampled_ids=targets)
    return dict(input_ids=ids, attention_mask=attn, response_mask=resp, scores=scores)


@pytest.fixture
def cache(tmp_path, models, scored):
    tok, teacher = models
    return save_cache(tmp_path / "c.safetensors", **scored, teacher=teacher, tokenizer=tok,
                      logprob_dtype=torch.float32)


def test_round_trip_records_provenance(tmp_path, models, scored):
    tok, teacher = models
    for dtype, tol in ((torch.float32, 0.0), (torch.float16, 1e-2)):
        path = save_cache(tmp_path / f"c-{dtype}.safetensors", **scored, teacher=teacher, tokenizer=tok,
                          logprob_dtype=dtype)
        back = load_cache(path, teacher=teacher, tokenizer=tok, expect_k=3)
        for key in ("input_ids", "attention_mask", "response_mask"):
            assert torch.equal(back[key], scored[key]) and back[key].dtype == torch.int64
        assert torch.equal(back["scores"].topk.ids, scored["scores"].topk.ids)
        torch.testing.assert_close(back["scores"].topk.logprobs, scored["scores"].topk.logprobs, atol=tol, rtol=tol)
        torch.testing.assert_close(back["scores"].sampled_logprobs, scored["scores"].sampled_logprobs,
                                   atol=tol, rtol=tol)
        tensors, meta = read_raw(path)
        assert meta["format"] == CACHE_FORMAT == "opdistill-teacher-cache-v2"
        prov = json.loads(meta["provenance"])
        assert prov == back["provenance"]
        assert prov["checksum_sha256"] == reference_checksum(tensors, prov)
        assert prov["teacher_weights_sha256"] == reference_weights_sha256(teacher)
        assert (prov["k"], prov["logprob_dtype"], prov["teacher_dtype"]) == (3, str(dtype)[6:], "float32")
        assert (prov["teacher_vocab_size"], prov["tokenizer_vocab_size"]) == (len(tok), len(tok))
        assert prov["opdistill_version"] == opdistill.__version__
        assert len(prov["teacher_config_sha256"]) == 64 and len(prov["tokenizer_sha256"]) == 64
        assert tensors["topk_ids"].dtype == torch.int32 and tensors["topk_logprobs"].dtype == dtype
    # the teacher's config hash ignores where it was loaded from and which transformers wrote it
    moved = copy.deepcopy(teacher)
    moved.config._name_or_path = "/elsewhere/teacher"
    moved.config.transformers_version = "0.0.1"
    load_cache(path, teacher=moved, tokenizer=tok)
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary file left behind


def _mismatch(path, *diffs):
    return (f"{path}: the cache was scored with other models than the current ones: {'; '.join(diffs)} (expected = "
            f"current models, found = the cache); re-score it with `opdistill score` using the current teacher and "
            f"tokenizer")


def test_other_tokenizer_of_the_same_size_is_refused_with_a_diff(cache, models):
    tok, teacher = models
    swapped = char_tokenizer(SWAPPED_CHARS)
    assert len(swapped) == len(tok)
    new = tokenizer_fingerprint(swapped)["tokenizer_sha256"]
    old = json.loads(read_raw(cache)[1]["provenance"])["tokenizer_sha256"]
    assert new != old
    with pytest.raises(TeacherCacheError) as e:
        load_cache(cache, teacher=teacher, tokenizer=swapped)
    assert str(e.value) == _mismatch(cache, f"tokenizer_sha256: expected {new[:12]!r}, found {old[:12]!r}")
    # the chat template is part of the fingerprint too
    templated = char_tokenizer(CARRY_ADD_CHARS, chat_template="{{ messages[0]['content'] }}")
    with pytest.raises(TeacherCacheError, match="tokenizer_sha256: expected"):
        load_cache(cache, tokenizer=templated)


def test_other_teacher_is_refused_with_every_differing_field(cache, models):
    tok, teacher = models
    old = json.loads(read_raw(cache)[1]["provenance"])
    perturbed = copy.deepcopy(teacher)
    with torch.no_grad():
        next(perturbed.parameters()).view(-1)[0] += 1e-3
    with pytest.raises(TeacherCacheError) as e:
        load_cache(cache, teacher=perturbed, tokenizer=tok)
    new_w = reference_weights_sha256(perturbed)
    assert str(e.value) == _mismatch(
        cache, f"teacher_weights_sha256: expected {new_w[:12]!r}, found {old['teacher_weights_sha256'][:12]!r}")
    # another architecture, the same teacher in another dtype, another K and another tokenizer: all listed at once
    bigger = build_tiny_llama(tok, hidden_size=16, num_layers=2, num_heads=2, seed=1)
    with pytest.raises(TeacherCacheError) as e:
        load_cache(cache, teacher=bigger, tokenizer=char_tokenizer(SWAPPED_CHARS), expect_k=5)
    msg = str(e.value)
    fields = [d.split(":")[0] for d in msg.split("current ones: ")[1].split(" (expected")[0].split("; ")]
    assert fields == ["teacher_config_sha256", "teacher_weights_sha256", "tokenizer_sha256", "k"]
    assert "k: expected 5, found 3" in msg
    with pytest.raises(TeacherCacheError, match=r"teacher_dtype: expected 'bfloat16', found 'float32'"):
        load_cache(cache, teacher=copy.deepcopy(teacher).to(torch.bfloat16))


def test_flipped_byte_is_a_checksum_error_naming_the_file(cache, models):
    tok, teacher = models
    raw = cache.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    for offset in (len(raw) - 1, header_end + 5, raw.index(b"tokenizer_sha256") + 40):  # payload x2, provenance
        flipped = bytearray(raw)
        flipped[offset] ^= 0x01
        cache.write_bytes(bytes(flipped))
        tensors, meta = read_raw(cache)
        prov = json.loads(meta["provenance"])
        actual = reference_checksum(tensors, prov)
        with pytest.raises(TeacherCacheError) as e:
            load_cache(cache, teacher=teacher, tokenizer=tok)
        assert str(e.value) == (f"{cache}: checksum mismatch (SHA-256 of provenance and tensors is {actual[:12]}, the "
                                f"file records {prov['checksum_sha256'][:12]}): the file is corrupt; re-score it with "
                                f"`opdistill score` or restore an intact copy")
    cache.write_bytes(raw[:3] + b"\xff" + raw[4:])  # the header length: not safetensors any more
    with pytest.raises(TeacherCacheError, match=rf"^{cache}: not a readable safetensors file \(.+\); the file is "
                                                r"corrupt or not a teacher cache: re-score it with `opdistill score`$"):
        load_cache(cache)
    cache.write_bytes(raw)
    load_cache(cache, teacher=teacher, tokenizer=tok)


@pytest.mark.parametrize("name, index, value, rule", [
    ("topk_ids", (1, 2, 0), 18, "token ids must lie in [0, 18) (the teacher's vocabulary)"),
    ("input_ids", (3, 0), -1, "token ids must lie in [0, 18) (the teacher's vocabulary)"),
    ("topk_logprobs", (0, 3, 1), 0.5, "log-probs must be <= 0 (tolerance 0.001)"),
    ("sampled_logprobs", (2, 1), float("nan"), "log-probs must be finite or -inf"),
    ("topk_logprobs", (2, 8, 2), float("inf"), "log-probs must be finite or -inf"),
    ("attention_mask", (0, 4), 2, "masks hold only 0 and 1"),
])
def test_invalid_value_names_tensor_and_first_position(cache, models, name, index, value, rule):
    tok, teacher = models
    assert len(tok) == 18

    def mutate(t):
        t[name][index] = value
        flat_index = sum(i * st for i, st in zip(index, t[name].stride()))
        t[name].view(-1)[flat_index + 1] = value  # a second bad value, next in row-major order: the first is named

    rewrite(cache, mutate)
    shown = "nan" if value != value else value
    with pytest.raises(TeacherCacheError) as e:
        load_cache(cache, teacher=teacher, tokenizer=tok)
    assert str(e.value) == f"{cache}: tensor {name!r} holds {shown} at {list(index)}; {rule}; {RESCORE}"


def test_value_rules_edges(cache, models):
    tok, teacher = models

    def set_(name, index, value):
        return lambda t: t[name].__setitem__(index, value)

    rewrite(cache, set_("topk_logprobs", (0, 0, 0), 5e-4))  # fp16 rounding of a near-certain token: accepted
    rewrite(cache, set_("topk_logprobs", (0, 0, 2), float("-inf")))  # an empty slot: accepted
    back = load_cache(cache, teacher=teacher, tokenizer=tok)
    assert back["scores"].topk.logprobs[0, 0, 2] == float("-inf")
    rewrite(cache, set_("response_mask", (1, 0), 1))  # row 1 is left-padded: position 0 is not attended
    with pytest.raises(TeacherCacheError) as e:
        load_cache(cache)
    assert str(e.value) == (f"{cache}: tensor 'response_mask' holds 1 at [1, 0]; a response token must be attended "
                            f"(attention_mask 1 there); {RESCORE}")
    rewrite(cache, lambda t: t.__setitem__("sampled_logprobs", t["sampled_logprobs"][:, :-1].contiguous()))
    with pytest.raises(TeacherCacheError) as e:
        load_cache(cache)
    assert str(e.value) == (f"{cache}: tensor 'sampled_logprobs' is float32 [4, 8], expected float32 [4, 9]; "
                            f"{RESCORE}")
    rewrite(cache, lambda t: t.pop("topk_logprobs"))
    with pytest.raises(TeacherCacheError) as e:
        load_cache(cache)
    assert str(e.value) == (f"{cache}: tensors 'topk_ids' and 'topk_logprobs' must both be present or both absent; "
                            f"{RESCORE}")


def test_save_refuses_invalid_scores(tmp_path, models, scored):
    tok, teacher = models
    bad = copy.deepcopy(scored)
    bad["scores"].sampled_logprobs[0, 6] = float("nan")
    path = tmp_path / "bad.safetensors"
    with pytest.raises(TeacherCacheError) as e:
        save_cache(path, **bad, teacher=teacher, tokenizer=tok)
    assert str(e.value) == (f"{path}: tensor 'sampled_logprobs' holds nan at [0, 6]; log-probs must be finite or "
                            f"-inf; {RESCORE}")
    assert not path.exists()


def test_v1_and_foreign_files_are_refused(tmp_path, scored):
    v1 = tmp_path / "v1.safetensors"
    save_file({"input_ids": scored["input_ids"].to(torch.int32)}, str(v1),
              metadata={"format": "opdistill-teacher-cache-v1"})
    with pytest.raises(TeacherCacheError) as e:
        load_cache(v1)
    assert str(e.value) == (f"{v1}: a v1 teacher cache, which records no provenance (teacher, tokenizer) and no "
                            f"checksum, so it cannot be checked against the current models; re-score it with "
                            f"`opdistill score` (writes opdistill-teacher-cache-v2)")
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(TeacherCacheError) as e:
        load_cache(plain)
    assert str(e.value) == (f"{plain}: not an opdistill teacher cache (metadata format None); write one with "
                            f"`opdistill score`")
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(TeacherCacheError) as e:
        load_cache(missing)
    assert str(e.value) == f"{missing}: no such teacher cache file (write one with `opdistill score`)"
    assert issubclass(TeacherCacheError, ValueError)


def test_cli_score_then_train_with_another_tokenizer_exits_2(tmp_path, capsys):
    cfg = tiny_config_dict(tmp_path, steps=2, checkpoint={"every": 0}, eval={"num_prompts": 0})
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    cache = tmp_path / "cache.safetensors"
    assert main(["score", "--config", str(cfg_file), "--out", str(cache), "--num-prompts", "2"]) == 0
    capsys.readouterr()
    prov = json.loads(read_raw(cache)[1]["provenance"])
    # the same models with '0' and '1' swapped in both tokenizers: compatible with each other, not with the cache
    teacher2 = make_model_dir(tmp_path / "teacher2", hidden=32, layers=2, seed=1, chars=SWAPPED_CHARS)
    student2 = make_model_dir(tmp_path / "student2", hidden=16, layers=1, seed=2, chars=SWAPPED_CHARS)
    kd = tmp_path / "kd"
    args = ["train", "--config", str(cfg_file), "train.method=off_policy", f"data.teacher_cache={cache}",
            "data.prompts_per_step=2", f"run_dir={kd}"]
    assert main(args + [f"model.teacher={teacher2}", f"model.student={student2}"]) == 2
    err = capsys.readouterr().err
    new = tokenizer_fingerprint(char_tokenizer(SWAPPED_CHARS))["tokenizer_sha256"]
    assert err == "opdistill train: teacher cache error: " + _mismatch(
        cache, f"tokenizer_sha256: expected {new[:12]!r}, found {prov['tokenizer_sha256'][:12]!r}") + "\n"
    assert not (kd / "config.yaml").exists()  # a refused cache leaves no run behind
    # a flipped byte in the cache: exit 2, one line naming the file
    raw = bytearray(cache.read_bytes())
    raw[-1] ^= 0x80
    cache.write_bytes(bytes(raw))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opdistill train: teacher cache error: {cache}: checksum mismatch") and err.count("\n") == 1
    # the intact cache with the run's own models trains
    raw[-1] ^= 0x80
    cache.write_bytes(bytes(raw))
    assert main(args) == 0
    assert Path(kd / "config.yaml").exists()
