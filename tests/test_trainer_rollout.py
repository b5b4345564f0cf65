"""Rollouts (sampler log-probs, layout, warnings) and teacher scoring (chunked == full, cache round trip)."""
import random
import warnings

import pytest
import torch

from opdistill import shift_for_next_token, token_logprobs
from opdistill.data import CARRY_ADD_CHARS, CarryAdditionTask, render_prompt
from opdistill.models import build_tiny_llama, char_tokenizer
from opdistill.engines.rollout import generate_rollouts
from opdistill.teachers import load_cache, save_cache, score_teacher


@pytest.fixture(scope="module")
def setup():
    tok = char_tokenizer(CARRY_ADD_CHARS)
    model = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2, seed=0)
    task = CarryAdditionTask(1, 4)
    rng = random.Random(1)
    prompts = [render_prompt(tok, task.sample(rng).prompt) for _ in range(4)]  # ragged lengths
    return tok, model, prompts


def test_layout_and_sampler_logprobs(setup):
    tok, model, prompts = setup
    torch.manual_seed(0)
    ro = generate_rollouts(model, tok, prompts, n=3, temperature=0.8, max_new_tokens=10)
    assert ro.num_rows == 12 and ro.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for r in range(12):
        p = prompts[ro.prompt_index[r]]
        n = int(ro.attention_mask[r].sum())
        assert ro.input_ids[r, : len(p)].tolist() == p  # prompt first, unpadded, right padding after
        assert ro.response_mask[r, : len(p)].sum() == 0 and ro.response_mask[r, len(p):n].all()
        resp = ro.input_ids[r, len(p):n].tolist()
        assert tok.eos_token_id not in resp[:-1] and len(resp) <= 10  # cut after the first EOS
    # recorded sampler log-probs == log_softmax(logits / T) of a fresh forward pass at the sampled tokens
    targets, mask = shift_for_next_token(ro.input_ids, ro.response_mask)
    with torch.no_grad():
        logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits
    ref = token_logprobs(logits, targets, temperature=0.8)
    torch.testing.assert_close(ro.sampler_logprobs * mask, ref * mask, atol=1e-5, rtol=0)


def test_seeded_and_greedy_are_deterministic(setup):
    tok, model, prompts = setup
    torch.manual_seed(5)
    a = generate_rollouts(model, tok, prompts, n=2, max_new_tokens=8)
    torch.manual_seed(5)
    b = generate_rollouts(model, tok, prompts, n=2, max_new_tokens=8)
    assert torch.equal(a.input_ids, b.input_ids)
    g = generate_rollouts(model, tok, prompts, greedy=True, max_new_tokens=8)
    with torch.no_grad():
        logits = model(input_ids=g.input_ids, attention_mask=g.attention_mask).logits
    targets, mask = shift_for_next_token(g.input_ids, g.response_mask)
    assert torch.equal(logits.argmax(-1)[mask.bool()], targets[mask.bool()])


def test_truncated_sampling_warns(setup):
    tok, model, prompts = setup
    with pytest.warns(UserWarning, match="off-policy"):
        generate_rollouts(model, tok, prompts, top_p=0.9, max_new_tokens=4)
    with pytest.warns(UserWarning, match="off-policy"):
        generate_rollouts(model, tok, prompts, top_k=5, max_new_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate_rollouts(model, tok, prompts, max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        generate_rollouts(model, tok, prompts, temperature=0.0)


def test_chunked_teacher_scores_equal_full_logits(setup, tmp_path):
    tok, model, prompts = setup
    torch.manual_seed(0)
    ro = generate_rollouts(model, tok, prompts, n=2, max_new_tokens=10)
    targets, _ = shift_for_next_token(ro.input_ids, ro.response_mask)
    sc = score_teacher(model, ro.input_ids, ro.attention_mask, k=5, sampled_ids=targets, row_chunk=3, token_chunk=7)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits.float(), -1)
    valid = ro.attention_mask.bool()
    ref_v, ref_i = lp.topk(5, -1)
    torch.testing.assert_close(sc.topk.logprobs[valid], ref_v[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.gather(lp, -1, sc.topk.ids)[valid], ref_v[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(sc.sampled_logprobs[valid], lp.gather(-1, targets[..., None])[..., 0][valid],
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="k: expected"):
        score_teacher(model, ro.input_ids, ro.attention_mask, k=0)
    # cache round trip: int32 ids on disk, fp32 exact / fp16 within half precision
    for dtype, tol in ((torch.float32, 0.0), (torch.float16, 1e-2)):
        path = save_cache(tmp_path / f"c-{dtype}.safetensors", input_ids=ro.input_ids,
                          attention_mask=ro.attention_mask, response_mask=ro.response_mask, scores=sc,
                          teacher=model, tokenizer=tok, logprob_dtype=dtype)
        back = load_cache(path)
        assert torch.equal(back["input_ids"], ro.input_ids) and torch.equal(back["scores"].topk.ids, sc.topk.ids)
        torch.testing.assert_close(back["scores"].topk.logprobs, sc.topk.logprobs, atol=tol, rtol=tol)


@pytest.mark.parametrize("row_chunk,token_chunk", [(64, 2048), (3, 7), (1, 5)])
def test_teacher_scores_only_response_positions(setup, monkeypatch, row_chunk, token_chunk):
    """``positions``: the lm_head runs on the response positions only (counted rows), the scores there are the
    full-layout scorer's (bit for bit at the default chunking, the trainer's; with other chunkings the head GEMM
    runs on other row counts, whose rounding differs by an ulp, as it does between two chunkings of the full-layout
    scorer itself), and every other position holds an empty slot (top-k) or 0 (sampled)."""
    import opdistill.teachers.local as teacher_mod

    tok, model, prompts = setup
    ro = generate_rollouts(model, tok, prompts, n=2, max_new_tokens=10, seed=3, step=1)
    targets, mask = shift_for_next_token(ro.input_ids, ro.response_mask)
    full = score_teacher(model, ro.input_ids, ro.attention_mask, k=5, sampled_ids=targets, row_chunk=row_chunk,
                         token_chunk=token_chunk)
    rows = []
    real_read = teacher_mod.read_lm_head

    class CountingHead:
        def __init__(self, head):
            self.head, self.weight = head, head.weight

        def logits(self, hidden):
            rows.append(hidden.shape[0])
            return self.head.logits(hidden)

    monkeypatch.setattr(teacher_mod, "read_lm_head", lambda m: CountingHead(real_read(m)))
    part = score_teacher(model, ro.input_ids, ro.attention_mask, k=5, sampled_ids=targets, positions=mask,
                         row_chunk=row_chunk, token_chunk=token_chunk)
    m = mask.bool()
    assert 0 < sum(rows) == int(m.sum()) < m.numel()  # prompt (and padding) positions never reach the lm_head
    assert torch.equal(part.topk.ids[m], full.topk.ids[m])
    if (row_chunk, token_chunk) == (64, 2048):
        assert torch.equal(part.topk.logprobs[m], full.topk.logprobs[m])
        assert torch.equal(part.sampled_logprobs[m], full.sampled_logprobs[m])
    torch.testing.assert_close(part.topk.logprobs[m], full.topk.logprobs[m], atol=1e-6, rtol=0)
    torch.testing.assert_close(part.sampled_logprobs[m], full.sampled_logprobs[m], atol=1e-6, rtol=0)
    assert torch.equal(part.topk.ids[~m], torch.zeros_like(part.topk.ids[~m]))
    assert bool(torch.isneginf(part.topk.logprobs[~m]).all()) and not bool(part.sampled_logprobs[~m].any())
    # sampled-only and top-k-only requests score the same rows
    only_s = score_teacher(model, ro.input_ids, ro.attention_mask, sampled_ids=targets, positions=mask)
    assert only_s.topk is None and torch.equal(only_s.sampled_logprobs[m], full.sampled_logprobs[m])
    only_k = score_teacher(model, ro.input_ids, ro.attention_mask, k=3, positions=mask.long())
    assert only_k.sampled_logprobs is None and torch.equal(only_k.topk.ids[m], full.topk.ids[m][:, :3])
    with pytest.raises(ValueError, match=r"positions: expected shape \(8, "):
        score_teacher(model, ro.input_ids, ro.attention_mask, k=5, positions=mask[:, :-1])
    # an all-False mask computes nothing at all
    rows.clear()
    none = score_teacher(model, ro.input_ids, ro.attention_mask, k=5, positions=torch.zeros_like(mask))
    assert rows == [] and bool(torch.isneginf(none.topk.logprobs).all())


@pytest.mark.parametrize("positions", [False, True])
def test_whole_vocabulary_scores_in_vocabulary_order(setup, positions):
    """k = V: slot j holds token j (no full sort); the (id, log-prob) pairs are the top-k path's bit for bit (sorted
    back, they equal k = V - 1's top-k plus the last token), the log-probs are the model's log-softmax, and unscored
    positions are empty slots (id 0, -inf) as for k < V."""
    tok, model, prompts = setup
    ro = generate_rollouts(model, tok, prompts, n=2, max_new_tokens=10, seed=5, step=2)
    targets, mask = shift_for_next_token(ro.input_ids, ro.response_mask)
    V = model.config.vocab_size
    kw = dict(positions=mask) if positions else {}
    whole = score_teacher(model, ro.input_ids, ro.attention_mask, k=V, sampled_ids=targets, **kw)
    part = score_teacher(model, ro.input_ids, ro.attention_mask, k=V - 1, sampled_ids=targets, **kw)
    m = mask.bool() if positions else torch.ones_like(mask, dtype=torch.bool)
    assert whole.topk.validated and whole.topk.ids.dtype == torch.long and whole.topk.ids.shape[-1] == V
    assert torch.equal(whole.topk.ids[m], torch.arange(V).expand(int(m.sum()), V))
    srt = whole.topk.logprobs[m].sort(dim=-1, descending=True).values
    assert torch.equal(srt[:, : V - 1], part.topk.logprobs[m])  # same values, bit for bit
    assert torch.equal(whole.sampled_logprobs, part.sampled_logprobs)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits.double(), -1)
    torch.testing.assert_close(whole.topk.logprobs[m].double(), lp[m], atol=1e-5, rtol=0)
    if positions:
        assert torch.equal(whole.topk.ids[~m], torch.zeros_like(whole.topk.ids[~m]))
        assert bool(torch.isneginf(whole.topk.logprobs[~m]).all())
        assert whole.topk.ids.is_contiguous() and whole.topk.logprobs.is_contiguous()
