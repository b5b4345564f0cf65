"""The keyed decode loop (opdistill.engines.sampler): distribution, exact log-probs, key invariance, greedy == HF,
min_new_tokens, finished rows dropped, truncation == transformers' warpers, bad inputs.

Expectations come from float64 forwards of the model itself (no cache, one unpadded row at a time), from an
independent per-row reference loop written here, or from transformers' own ``generate`` / logits warpers.
"""
import copy
import math
import random
import re
from pathlib import Path

import pytest
import torch

from opdistill.data import CarryAdditionTask, render_prompt
from opdistill.engines.sampler import row_key, sample, truncate_logits
from opdistill.models import build_tiny_llama, char_tokenizer, load_model, load_tokenizer
from opdistill.engines.rollout import generate_rollouts

DEMO_ASSETS = Path(__file__).resolve().parent.parent / "opdistill" / "assets" / "demo"


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit of ``counts`` to ``probs`` (float64); cells with expected count < 5 are pooled."""
    N = counts.sum().double()
    exp = probs.double() * N
    small = exp < 5
    obs_c = torch.cat([counts.double()[~small], counts.double()[small].sum()[None]])
    exp_c = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    dof = obs_c.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def tiny():
    """A small-vocabulary random model with spread-out logits (so the chi-square test has power)."""
    tok = char_tokenizer("abcdef")  # V = 10 with the 4 specials
    model = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # tied to the embedding: both scaled; logits spread over ~2.5 nats
    model64 = copy.deepcopy(model).double()
    return tok, model, model64


@pytest.fixture(scope="module")
def demo():
    tok = load_tokenizer(DEMO_ASSETS / "student")
    student = load_model(DEMO_ASSETS / "student")
    teacher = load_model(DEMO_ASSETS / "teacher")
    task = CarryAdditionTask(1, 4)
    rng = random.Random(7)
    prompts = [render_prompt(tok, task.sample(rng).prompt) for _ in range(10)]  # ragged lengths
    assert len({len(p) for p in prompts}) > 1
    return tok, student, teacher, prompts


def _forward64(model64, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model64(input_ids=torch.tensor([ids])).logits[0].double()  # [L, V]


@pytest.mark.parametrize("temperature", [0.8, 1.3])
def test_first_two_tokens_follow_the_model_distribution(tiny, temperature):
    tok, model, model64 = tiny
    prompt = tok("<s>abca")["input_ids"]
    V, eos = model.config.vocab_size, tok.eos_token_id
    # reference: P(y1) P(y2 | y1) from plain float64 forwards; y1 = EOS ends the response (one cell)
    p1 = torch.softmax(_forward64(model64, prompt)[-1] / temperature, -1)
    cells = {(eos,): float(p1[eos])}
    for a in range(V):
        if a != eos:
            p2 = torch.softmax(_forward64(model64, prompt + [a])[-1] / temperature, -1)
            for b in range(V):
                cells[(a, b)] = float(p1[a] * p2[b])
    assert abs(sum(cells.values()) - 1) < 1e-9 and max(cells.values()) < 0.5  # not a degenerate distribution
    from opdistill.engines.sampler import _lean_decoder

    assert _lean_decoder(model) is not None  # the second token comes from the lean decode step
    N = 12000
    out = sample(model, [prompt], eos_id=eos, pad_id=tok.pad_token_id, n=N, temperature=temperature,
                 max_new_tokens=2, seed=11, step=2)
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells))
    for t in out.tokens:
        counts[index[tuple(t)]] += 1
    probs = torch.tensor(list(cells.values()), dtype=torch.float64)
    assert _chi2_pvalue(counts, probs) > 1e-3
    # the test has power: the same counts reject the distribution at a 20% different temperature
    wrong = torch.softmax(_forward64(model64, prompt)[-1] / (temperature * 1.2), -1)
    first = torch.zeros(V)
    for t in out.tokens:
        first[t[0]] += 1
    assert _chi2_pvalue(first, wrong) < 1e-3
    assert _chi2_pvalue(first, p1) > 1e-3


def test_truncated_first_token_distribution(tiny):
    tok, model, model64 = tiny
    prompt = tok("<s>fed")["input_ids"]
    T, k, p = 1.1, 5, 0.8
    scaled = _forward64(model64, prompt)[-1:] / T
    ref = torch.softmax(truncate_logits(scaled, k, p), -1)[0]
    assert 1 < int((ref > 0).sum()) < 5  # top-p really cut inside the top-k
    out = sample(model, [prompt], eos_id=None, pad_id=0, n=8000, temperature=T, top_k=k, top_p=p, max_new_tokens=1,
                 seed=5)
    counts = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=ref.numel()).double()
    assert counts[ref == 0].sum() == 0
    assert _chi2_pvalue(counts[ref > 0], ref[ref > 0]) > 1e-3


def test_truncate_logits_equals_transformers_warpers():
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 50, generator=g) * 3
    scores[:8, :10] = 1.5  # ties at the top-k boundary
    scores[8:16] = torch.round(scores[8:16])  # many ties everywhere
    for k in (0, 1, 7, 50, 80):
        for p in (1.0, 0.95, 0.5, 0.01):
            ref = scores
            if k:
                ref = TopKLogitsWarper(k)(None, ref)
            if p < 1:
                ref = TopPLogitsWarper(p)(None, ref)
            assert torch.equal(truncate_logits(scores, k, p), ref), (k, p)


def test_sampler_logprobs_are_exact(tiny):
    tok, model, model64 = tiny
    prompts = [tok(s)["input_ids"] for s in ("<s>a", "<s>fedcba", "<s>bb", "<s>cafe")]
    T = 0.7
    out = sample(model, prompts, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, n=3, temperature=T,
                 max_new_tokens=9, min_new_tokens=2, seed=1, want_logprobs=True)
    checked = 0
    for r, toks in enumerate(out.tokens):
        p = prompts[out.prompt_index[r]]
        lp = torch.log_softmax(_forward64(model64, p + toks)[len(p) - 1 : -1] / T, -1)  # full distribution
        ref = lp.gather(-1, torch.tensor(toks)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs[r], dtype=torch.float64), ref, atol=1e-5, rtol=0)
        checked += len(toks)
    assert checked > 30
    assert sample(model, prompts, eos_id=2, pad_id=0, max_new_tokens=3).logprobs is None  # only when asked


def _by_key(out, keys):
    return {(keys[out.prompt_index[r]], out.sample_index[r]): tuple(t) for r, t in enumerate(out.tokens)}


def test_same_samples_at_any_batch_size_order_and_chunking(demo):
    tok, student, _, prompts = demo
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, n=3, max_new_tokens=16, seed=4, step=9)
    keys = list(range(100, 100 + len(prompts)))
    ref = _by_key(sample(student, prompts, prompt_keys=keys, **kw), keys)
    assert len(set(ref.values())) > len(prompts)  # the samples of one prompt differ: this is really sampling
    for bs in (1, 3, 4):
        assert _by_key(sample(student, prompts, prompt_keys=keys, batch_size=bs, **kw), keys) == ref, bs
    perm = random.Random(0).sample(range(len(prompts)), len(prompts))
    pk = [keys[i] for i in perm]
    out = sample(student, [prompts[i] for i in perm], prompt_keys=pk, batch_size=4, **kw)
    assert _by_key(out, pk) == ref
    # a rank's share: prompts[4:] at prompt_offset 4 draws the rows of the whole call
    full = generate_rollouts(student, tok, prompts, n=2, max_new_tokens=12, seed=3, step=5)
    part = generate_rollouts(student, tok, prompts[4:], n=2, max_new_tokens=12, seed=3, step=5, prompt_offset=4,
                             batch_size=2)
    L = part.input_ids.shape[1]
    assert torch.equal(full.input_ids[8:, :L], part.input_ids) and not full.input_ids[8:, L:].any()
    # other keys draw other samples
    other = sample(student, prompts, prompt_keys=keys, **{**kw, "step": 10})
    assert _by_key(other, keys) != ref


@pytest.mark.parametrize("which", ["student", "teacher"])
def test_greedy_equals_hf_generate(demo, which):
    from transformers import GenerationConfig

    tok, student, teacher, prompts = demo
    model = student if which == "student" else teacher
    out = sample(model, prompts, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, greedy=True, max_new_tokens=20)
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts])
    attn = (torch.arange(P)[None] >= torch.tensor([P - len(p) for p in prompts])[:, None]).long()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=20, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id)
    with torch.no_grad():
        hf = model.generate(input_ids=ids, attention_mask=attn, generation_config=cfg)[:, P:].tolist()
    for r, row in enumerate(hf):
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        assert out.tokens[r] == row, r
    assert any(t[-1] == tok.eos_token_id for t in out.tokens) and any(len(t) < 20 for t in out.tokens)


def _reference_row(model, prompt, eos, T, max_new, min_new, key):
    """One row alone, no cache, no batching, no dropping: full forward per token, the row's keyed noise."""
    g = torch.Generator().manual_seed(key)
    seq, out = list(prompt), []
    for t in range(max_new):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float() / T
        u = torch.empty_like(logits).uniform_(generator=g)
        if t < min_new:
            logits[eos] = -math.inf
        y = int((logits - torch.log(-torch.log(u))).argmax())
        out.append(y)
        seq.append(y)
        if y == eos:
            break
    return out


def test_min_new_tokens_and_finished_rows_dropped(demo):
    tok, student, _, prompts = demo
    eos = tok.eos_token_id
    sizes = []
    kw = dict(eos_id=eos, pad_id=tok.pad_token_id, n=2, max_new_tokens=14, seed=8, step=1)
    free = sample(student, prompts, **kw, forward_hook=sizes.append)
    assert min(len(t) for t in free.tokens) < 8 and all(t[-1] == eos or len(t) == 14 for t in free.tokens)
    # forward batch sizes: prompts for the prefill, then the unfinished rows only, shrinking as rows finish
    rows = len(free.tokens)
    assert sizes[0] == len(prompts) and sizes[1] == rows
    assert all(a >= b for a, b in zip(sizes[1:], sizes[2:])) and sizes[-1] < rows
    for t in range(1, len(sizes)):  # before the forward of token t+1, exactly the rows without EOS in tokens[:t]
        assert sizes[t] == sum(len(x) > t - 1 and eos not in x[:t] for x in free.tokens), t
    # identical to the reference loop that never drops, batches or caches
    for r in range(rows):
        key = row_key(8, 1, free.prompt_index[r], free.sample_index[r])
        assert free.tokens[r] == _reference_row(student, prompts[free.prompt_index[r]], eos, 1.0, 14, 0, key), r
    # min_new_tokens = a length at which free rows stopped: exactly their EOS (index m-1) must now be masked
    stops = [len(t) for t in free.tokens if t[-1] == eos]
    m = max(set(stops), key=stops.count)
    assert 1 < m < 14 and stops.count(m) >= 2
    forced = sample(student, prompts, **kw, min_new_tokens=m)
    assert all(len(t) >= m + 1 and eos not in t[:m] for t in forced.tokens)
    for r in range(rows):
        key = row_key(8, 1, forced.prompt_index[r], forced.sample_index[r])
        assert forced.tokens[r] == _reference_row(student, prompts[forced.prompt_index[r]], eos, 1.0, 14, m, key), r
    greedy = sample(student, prompts, eos_id=eos, pad_id=0, greedy=True, max_new_tokens=14, min_new_tokens=14)
    assert all(len(t) == 14 and eos not in t for t in greedy.tokens)


def test_generate_rollouts_layout_and_warnings(demo):
    tok, student, _, prompts = demo
    ro = generate_rollouts(student, tok, prompts[:3], n=2, max_new_tokens=6, seed=0, want_logprobs=False,
                           want_texts=False)
    assert ro.texts is None and not ro.sampler_logprobs.any() and ro.prompt_index == [0, 0, 1, 1, 2, 2]
    with pytest.warns(UserWarning, match=re.escape("min_new_tokens=2 tokens")):
        generate_rollouts(student, tok, prompts[:2], max_new_tokens=4, min_new_tokens=2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(n=0), "n: expected an int >= 1 samples per prompt, got 0"),
    (dict(temperature=0.0), "temperature: expected a finite number > 0 for sampling, got 0.0"),
    (dict(temperature=-1), "temperature: expected a finite number > 0 for sampling, got -1"),
    (dict(temperature=float("nan")), "temperature: expected a finite number > 0 for sampling, got nan"),
    (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens: expected an int in [0, max_new_tokens=4], got 5"),
    (dict(min_new_tokens=-1), "min_new_tokens: expected an int in [0, max_new_tokens=64], got -1"),
    (dict(max_new_tokens=0), "max_new_tokens: expected an int >= 1, got 0"),
    (dict(top_k=-2), "top_k: expected an int >= 0 (0 = off), got -2"),
    (dict(top_p=0.0), "top_p: expected a number in (0, 1], got 0.0"),
    (dict(prompt_keys=[1]), "prompt_keys: expected one key per prompt (2), got 1"),
    (dict(batch_size=0), "batch_size: expected an int >= 1 prompts decoded together (or None = all), got 0"),
])
def test_bad_inputs(tiny, kwargs, message):
    tok, model, _ = tiny
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        sample(model, [[1, 4], [1, 5, 6]], eos_id=2, pad_id=0, **kwargs)
    with pytest.raises(ValueError, match="^" + re.escape("prompts: every prompt needs at least one token; prompt 1 "
                                                         "is empty") + "$"):
        sample(model, [[1, 4], []], eos_id=2, pad_id=0)
    assert sample(model, [], eos_id=2, pad_id=0).tokens == []
    # greedy ignores the temperature
    assert sample(model, [[1, 4]], eos_id=2, pad_id=0, greedy=True, temperature=0.0, max_new_tokens=2).tokens


@pytest.mark.parametrize("method", ["on_policy", "rl"])
def test_trainer_steps_do_not_depend_on_the_rollout_batch_size(tmp_path, method):
    """The trainer keys its rollouts by (train.seed, step, prompt, sample): rollout.batch_size 1 and null train the
    same run (every logged number but the timings and the sampler/trainer mismatch ``rollout/*``, which measures the
    last-bit differences the batch shape makes in the sampler's log-probs), and another train.seed does not."""
    from opdistill.train.run.config import load_config
    from opdistill.runs.files import read_metrics
    from opdistill.train.loop import run_training
    from tests.trainer_helpers import tiny_config_dict

    def run(name, **rollout):
        cfg = tiny_config_dict(tmp_path, method=method, steps=2, eval={"num_prompts": 0},
                               checkpoint={"every": 0, "save_final": False}, rollout={"n": 2, **rollout})
        cfg["run_dir"] = str(tmp_path / name)
        if name == "other_seed":
            cfg["train"]["seed"] = 1
        run_training(load_config(base=cfg), quiet=True)
        rows = read_metrics(tmp_path / name)
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "rollout/"))} for r in rows]

    whole, one = run("whole", batch_size=None), run("one", batch_size=1)
    assert len(whole) == 2 and whole == one
    assert run("other_seed") != whole


def test_trainer_passes_rollout_min_new_tokens(tmp_path):
    """rollout.min_new_tokens reaches the sampler: with min = max every response is exactly max_new_tokens long
    (the random tiny student emits EOS early without it)."""
    import warnings as _w

    from opdistill.train.run.config import load_config
    from opdistill.runs.files import read_metrics
    from opdistill.train.loop import run_training
    from tests.trainer_helpers import tiny_config_dict

    lens = {}
    for name, min_new in (("free", 0), ("forced", 12)):
        cfg = tiny_config_dict(tmp_path, steps=2, eval={"num_prompts": 0}, checkpoint={"every": 0, "save_final": False},
                               rollout={"max_new_tokens": 12, "min_new_tokens": min_new})
        cfg["run_dir"] = str(tmp_path / name)
        with _w.catch_warnings():
            _w.simplefilter("ignore")  # min_new_tokens > 0 warns: slightly off-policy
            run_training(load_config(base=cfg), quiet=True)
        lens[name] = [r["train/response_len"] for r in read_metrics(tmp_path / name) if "train/response_len" in r]
    assert lens["forced"] == [12.0, 12.0]
    assert min(lens["free"]) < 12.0  # the test has power: without the key the responses are shorter


def _tiny_qwen2(tok, **over):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.update(over)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
        with torch.no_grad():
            for p in model.parameters():  # spread-out weights (biases included) so the check has something to see
                p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("arch,fuse", [("llama", True), ("qwen2_gqa", True), ("qwen2_gqa", False)])
def test_lean_decode_equals_the_model_forward(demo, monkeypatch, arch, fuse):
    """The lean decode step (Qwen2 / Llama family) is the model's own forward up to fp32 rounding: log-probs equal a
    float64 full re-forward of prompt + response (ragged left padding, n > 1, rows finishing at different
    lengths) and the samples and log-probs equal those of the model's forward path (lean_decode=False); with the
    fused q/k/v and gate/up GEMMs and without."""
    import opdistill.engines.sampler as sm
    from opdistill.engines.sampler import _lean_decoder

    if not fuse:  # separate q/k/v and gate/up GEMMs (models whose fused weights would exceed _FUSE_BYTES)
        monkeypatch.setattr(sm, "_FUSE_BYTES", 0)
    tok = demo[0]
    prompts = demo[3][:6]
    model = demo[1] if arch == "llama" else _tiny_qwen2(tok)
    lean = _lean_decoder(model)
    assert lean is not None and all((len(x[1]) == 1) == fuse for x in lean.layers)
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, n=3, temperature=0.9, max_new_tokens=12, seed=2,
              step=3, want_logprobs=True)
    out = sample(model, prompts, **kw)
    ref = sample(model, prompts, lean_decode=False, **kw)
    assert out.tokens == ref.tokens
    for a, b in zip(out.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-6, rtol=2e-6)
    lens = [len(t) for t in out.tokens]
    assert min(lens) < 12 and max(lens) == 12  # rows really finished at different lengths
    model64 = copy.deepcopy(model).double()
    for r, toks in enumerate(out.tokens):
        p = prompts[out.prompt_index[r]]
        lp = torch.log_softmax(_forward64(model64, p + toks)[len(p) - 1 : -1] / 0.9, -1)
        want = lp.gather(-1, torch.tensor(toks)[:, None])[:, 0]
        # 3e-5: the model's own fp32 forward is 1.1e-5 from float64 on the demo student (its logits are large)
        torch.testing.assert_close(torch.tensor(out.logprobs[r], dtype=torch.float64), want, atol=3e-5, rtol=0)


def test_lean_decode_falls_back_to_the_model_forward(demo):
    """Hooks, a forward replaced on a module instance, accelerate's hooks, sliding-window layers and other
    architectures run the model's own forward (every decode step goes through it: a hook on a layer sees every
    token)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from opdistill.engines.sampler import _lean_decoder

    tok, student, _, prompts = demo
    kw = dict(eos_id=None, pad_id=tok.pad_token_id, max_new_tokens=5, seed=0)
    calls = []
    h = student.model.layers[1].register_forward_hook(lambda *a: calls.append(1))
    try:
        assert _lean_decoder(student) is None
        hooked = sample(student, prompts[:2], **kw)
    finally:
        h.remove()
    assert len(calls) == 5 and _lean_decoder(student) is not None  # prefill + 4 decode forwards
    assert hooked.tokens == sample(student, prompts[:2], **kw).tokens
    # a forward replaced on the instance (a wrapper, accelerate's device hooks) or an accelerate hook attribute
    layer = student.model.layers[0]
    layer.forward = lambda *a, _f=layer.forward, **k: (calls.append(2), _f(*a, **k))[1]
    try:
        assert _lean_decoder(student) is None
        assert sample(student, prompts[:2], **kw).tokens == hooked.tokens and calls.count(2) == 5
    finally:
        del layer.forward
    student.model.norm._hf_hook = object()
    try:
        assert _lean_decoder(student) is None
    finally:
        del student.model.norm._hf_hook
    assert _lean_decoder(student) is not None
    sliding = _tiny_qwen2(tok, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding_attention" in sliding.config.layer_types and _lean_decoder(sliding) is None
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=64))
    assert _lean_decoder(gpt2) is None
    assert all(len(t) == 5 for t in sample(gpt2, prompts[:2], **kw).tokens)


@pytest.mark.parametrize("elems", [1, 3])
def test_noise_blocks_do_not_change_the_samples(demo, monkeypatch, elems):
    """Each row draws its uniforms for several positions at once (a block of _NOISE_BLOCK_ELEMS // V positions): on
    CPU the same stream as one position at a time, so any block length, refilled as rows finish, draws the same
    samples (and the reference loop, one position at a time, agrees)."""
    import opdistill.engines.sampler as sm

    tok, student, _, prompts = demo
    V = student.config.vocab_size
    assert sm._NOISE_BLOCK_ELEMS // V >= 14  # the default: one block covers these 14 positions
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, n=2, max_new_tokens=14, seed=6, step=4)
    ref = sample(student, prompts, **kw)
    monkeypatch.setattr(sm, "_NOISE_BLOCK_ELEMS", elems * V)  # blocks of 1 and of 3 positions
    out = sample(student, prompts, **kw)
    assert out.tokens == ref.tokens
    assert len({len(t) for t in out.tokens}) > 2  # rows finished inside blocks
    for r in range(0, len(out.tokens), 5):
        key = row_key(6, 4, out.prompt_index[r], out.sample_index[r])
        assert out.tokens[r] == _reference_row(student, prompts[out.prompt_index[r]], tok.eos_token_id, 1.0, 14, 0,
                                               key), r


@pytest.mark.parametrize("arch", ["llama", "qwen2_gqa"])
def test_lean_decode_bf16_equals_the_model_forward(demo, arch):
    """bf16 weights: the lean decode step (its RMSNorm upcasts to fp32 and rounds back as the model's does) draws
    the samples and log-probs of the model's own forward path."""
    from opdistill.engines.sampler import _lean_decoder

    tok, student, _, prompts = demo
    model = copy.deepcopy(student if arch == "llama" else _tiny_qwen2(tok)).to(torch.bfloat16)
    assert _lean_decoder(model) is not None
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, n=3, temperature=0.9, max_new_tokens=12, seed=2,
              step=3, want_logprobs=True)
    out, ref = sample(model, prompts, **kw), sample(model, prompts, lean_decode=False, **kw)
    assert out.tokens == ref.tokens and len({len(t) for t in out.tokens}) > 1
    for a, b in zip(out.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=1e-6)


def test_lean_decode_dynamic_rope_equals_the_model_forward(demo):
    """A rotary embedding that depends on the positions seen so far (dynamic NTK scaling, here active: prompts +
    responses run past max_position_embeddings = 16) is computed per step, as the model's forward does: the same
    samples and log-probs as the model's own forward path."""
    from opdistill.engines.sampler import _lean_decoder

    tok, _, _, prompts = demo
    model = _tiny_qwen2(tok, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
                        max_position_embeddings=16)
    lean = _lean_decoder(model)
    assert lean is not None and not lean.static_rope
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, n=3, temperature=0.9, max_new_tokens=12, seed=2,
              step=3, want_logprobs=True)
    out, ref = sample(model, prompts, **kw), sample(model, prompts, lean_decode=False, **kw)
    assert max(len(p) for p in prompts) + max(len(t) for t in out.tokens) > 16
    assert out.tokens == ref.tokens
    for a, b in zip(out.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2_gqa"])
def test_lean_decode_without_padding_runs_without_a_mask(demo, monkeypatch, arch):
    """Prompts of one length (no padding column): the lean step passes SDPA no mask (every column is attended) and
    draws the samples and log-probs of the model's forward path; with a padded chunk the mask is there (and dropping
    finished rows keeps both cases consistent)."""
    import opdistill.engines.sampler as sm

    tok = demo[0]
    model = demo[1] if arch == "llama" else _tiny_qwen2(tok)
    L = min(len(p) for p in demo[3])
    same = [p[:L] for p in demo[3][:4]]  # one length: no padding column
    assert len({tuple(p) for p in same}) > 1
    masks = []
    real_step = sm._LeanDecoder.step

    def spy(self, tok_, pos, col):
        masks.append(self.mask)
        return real_step(self, tok_, pos, col)

    monkeypatch.setattr(sm._LeanDecoder, "step", spy)
    kw = dict(eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, n=2, temperature=0.9, max_new_tokens=10, seed=4,
              step=1, want_logprobs=True)
    out = sample(model, same, **kw)
    assert masks and all(m is None for m in masks)
    ref = sample(model, same, lean_decode=False, **kw)
    assert out.tokens == ref.tokens
    for a, b in zip(out.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-6, rtol=2e-6)
    masks.clear()
    ragged = same[:2] + [p for p in demo[3] if len(p) > L][:1]
    sample(model, ragged, **kw)
    assert masks and all(m is not None for m in masks)
