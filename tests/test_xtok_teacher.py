"""The cross-tokenizer teacher (opdistill/teachers/xtok.py) in the losses and the trainer: with one tokenizer on both
sides it gives the same-tokenizer losses and gradients (fp32 1e-6, fp64 1e-10) for every loss family it supports;
the demo pair trains and reports xtok/*; what it cannot do is refused in one line."""
import random

import pytest
import torch

from opdistill.data import CarryAdditionTask, render_prompt
from opdistill.errors import ConfigError, IncompatibleModelsError
from opdistill.models import (bpe_tokenizer, build_tiny_llama, char_tokenizer, check_compatible, load_model,
                              load_tokenizer, resolve_model_path)
from opdistill.ops import sampled_token_kl, token_logprobs, topk_divergence
from opdistill.teachers import LocalTeacher, Rows, ScoreRequest
from opdistill.teachers.base import TeacherError
from opdistill.teachers.xtok import CrossTokenizerTeacher
from opdistill.xtok import check_chat_templates

FAMILIES = [("tail", "forward"), ("tail", "reverse"), ("tail", "jsd"), ("renormalized", "forward"),
            ("renormalized", "reverse"), ("truncated", "forward"), ("sampled", "k3"), ("sampled", "k1")]


def _rows(tok, texts, prompts, eos=True):
    seqs, starts = [], []
    for prompt, text in zip(prompts, texts):
        p = render_prompt(tok, prompt)
        r = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
        seqs.append(p + r)
        starts.append(len(p))
    W = max(map(len, seqs))
    ids = torch.full((len(seqs), W), tok.pad_token_id)
    am, rm = torch.zeros(len(seqs), W, dtype=torch.long), torch.zeros(len(seqs), W, dtype=torch.long)
    for b, (s, p) in enumerate(zip(seqs, starts)):
        ids[b, :len(s)] = torch.tensor(s)
        am[b, :len(s)] = 1
        rm[b, p:len(s)] = 1
    return Rows(ids, am, rm, prompts=tuple(prompts))


def _problems(n, seed=0):
    rng = random.Random(seed)
    ps = [CarryAdditionTask().sample(rng) for _ in range(n)]
    # complete, truncated and wrong responses (the student's are often wrong)
    texts = [p.solution if i % 3 == 0 else p.solution[: len(p.solution) // 2] if i % 3 == 1 else
             p.solution.replace("1", "7") for i, p in enumerate(ps)]
    return [p.prompt for p in ps], texts


def _losses(family, scores, rows, logits):
    support, div = family
    scored = rows.scored()
    if support == "sampled":
        lp = token_logprobs(logits, rows.targets())
        per = sampled_token_kl(lp, torch.where(scored, scores.sampled_logprobs.to(lp.dtype), 0.0), div,
                               validate=False)
    else:
        res = topk_divergence(logits, scores.topk.ids, scores.topk.logprobs.to(logits.dtype), support=support,
                              divergence=div)
        per = res.loss
    return torch.where(scored, per, 0.0).sum() / scored.sum()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-10)])
@pytest.mark.parametrize("which", ["char", "bpe"])
def test_same_tokenizer_gives_the_same_losses_and_gradients(which, dtype, tol):
    prompts, texts = _problems(6)
    if which == "char":
        tok = char_tokenizer("0123456789+=,>")
    else:
        task = CarryAdditionTask()
        rng = random.Random(1)
        corpus = [x for _ in range(400) for p in [task.sample(rng)] for x in (p.prompt, p.solution)]
        tok = bpe_tokenizer(corpus, vocab_size=300)
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, seed=3)
    local = LocalTeacher(model)
    rows = _rows(tok, texts, prompts, eos=True)
    K = 6
    cross = CrossTokenizerTeacher(local, tok, tok, teacher_topk=K, teacher_width=len(tok))
    for family in FAMILIES:
        sampled = family[0] == "sampled"
        req = ScoreRequest(k=None if sampled else K, sampled=sampled)
        same, mapped = local.score(rows, req), cross.score(rows, req)
        assert bool(mapped.mask.all()) and mapped.sums["exact"] == mapped.sums["positions"]
        g = torch.Generator().manual_seed(5)
        base = torch.randn(*rows.input_ids.shape, len(tok), generator=g, dtype=dtype)
        out = []
        for scores in (same, mapped):
            logits = base.clone().requires_grad_(True)
            loss = _losses(family, scores, rows, logits)
            loss.backward()
            out.append((loss.detach(), logits.grad))
        assert torch.allclose(out[0][0], out[1][0], rtol=tol, atol=tol), family
        assert torch.allclose(out[0][1], out[1][1], rtol=tol, atol=tol), family


def test_demo_pair_scores_every_position_and_counts():
    """The demo pair (character-level student, byte-level BPE teacher): every scored position has a signal, the
    exact ones are those where a teacher token starts and ends with the student's character."""
    s_tok = load_tokenizer(resolve_model_path("builtin:demo-student"))
    t_path = resolve_model_path("builtin:demo-teacher-bpe")
    t_tok = load_tokenizer(t_path)
    assert t_tok.get_vocab() != s_tok.get_vocab()
    teacher = LocalTeacher(load_model(t_path))
    cross = CrossTokenizerTeacher(teacher, s_tok, t_tok, teacher_topk=len(t_tok), teacher_width=len(t_tok))
    prompts, texts = _problems(4, seed=2)
    rows = _rows(s_tok, texts, prompts)
    got = cross.score(rows, ScoreRequest(k=8, sampled=True))
    scored = rows.scored()
    assert got.mask[scored].all()
    assert got.sums["positions"] == float(scored.sum()) and got.sums["masked"] == 0
    assert 0 < got.sums["exact"] < got.sums["positions"]
    mass = got.topk.logprobs.exp().sum(-1)[scored]
    assert (mass <= 1 + 1e-5).all() and got.sums["residual"] / got.sums["positions"] < 0.05
    # the correct solutions: the teacher (0.99 accurate) puts most of its mass on the student's next character
    lp = got.sampled_logprobs[0][scored[0]]
    assert lp.exp().mean() > 0.9


def test_refusals():
    tok = char_tokenizer("0123456789+=,>")
    model = build_tiny_llama(tok, hidden_size=16, num_layers=1)
    cross = CrossTokenizerTeacher(LocalTeacher(model), tok, tok, teacher_topk=4)
    prompts, texts = _problems(2)
    rows = _rows(tok, texts, prompts)
    bare = Rows(rows.input_ids, rows.attention_mask, rows.response_mask)
    with pytest.raises(TeacherError, match=r"^model.teacher: a cross-tokenizer teacher renders each prompt through "
                                           r"its own chat template, and these rows carry no prompts"):
        cross.score(bare, ScoreRequest(k=4))
    with pytest.raises(TeacherError, match=r"hidden states and log-probs at the student's ids"):
        cross.score(rows, ScoreRequest(hidden=True))
    sampled = CrossTokenizerTeacher(LocalTeacher(model), tok, tok, mode="sampled")
    with pytest.raises(TeacherError, match=r"^model.teacher: xtok.mode sampled gives the teacher's log-prob of the "
                                           r"student's token only; a top-k loss needs xtok.mode bpm$"):
        sampled.score(rows, ScoreRequest(k=4))


def test_chat_templates_that_change_the_response_are_refused_with_the_diff():
    s_tok = char_tokenizer("0123456789+=,> abcdefghijklmnopqrstuvwxyzSW?.\n")
    strip = char_tokenizer("0123456789+=,> abcdefghijklmnopqrstuvwxyzSW?.\n",
                           chat_template="{% for m in messages %}{{ m['content'] | trim }}{% endfor %}")
    check_chat_templates(s_tok, s_tok)
    with pytest.raises(IncompatibleModelsError) as e:
        check_chat_templates(s_tok, strip, key="teachers.1.path")
    msg = str(e.value)
    assert msg.startswith("teachers.1.path: the teacher's chat template changes the assistant's response text")
    assert "-  12 + 30 = 42." in msg and "+12 + 30 = 42." in msg
    # the compatibility check runs it with cross_tokenizer on, and the vocabularies may then differ
    bpe = bpe_tokenizer(["12+30=42"] * 10, vocab_size=270)
    check_compatible(s_tok, bpe, cross_tokenizer=True)
    with pytest.raises(IncompatibleModelsError, match=r"xtok.mode bpm, docs/cross_tokenizer.md\)$"):
        check_compatible(s_tok, bpe)


def test_config_refuses_what_a_cross_tokenizer_teacher_cannot_answer():
    from opdistill.train.run.config import load_config

    base = ["model.student=builtin:demo-student", "model.teacher=builtin:demo-teacher-bpe", "xtok.mode=bpm"]
    cases = [
        (["loss.loss_mode=full"], "loss.loss_mode: expected topk or sampled with xtok.mode bpm (a teacher with another "
                                  "tokenizer has no hidden states over the student's vocabulary), got 'full'"),
        (["loss.support=union", "loss.topk=4"], "loss.support: expected tail, truncated or renormalized with xtok.mode "
                                                "bpm (a teacher with another tokenizer cannot score the student's own "
                                                "top-k ids), got 'union'"),
        (["xtok.mode=sampled", "loss.topk=4"], "loss.loss_mode: expected sampled with xtok.mode sampled (a teacher "
                                               "with another tokenizer gives only the log-prob of the student's token "
                                               "in mode sampled), got 'topk'"),
        (["teacher.engine=vllm", "loss.topk=4"], "teacher.engine: expected hf with xtok.mode bpm (a teacher with "
                                                 "another tokenizer is scored through opdistill's own teachers), "
                                                 "got 'vllm'"),
    ]
    for extra, msg in cases:
        with pytest.raises(ConfigError) as e:
            load_config(None, base + extra)
        assert str(e.value) == msg


def _demo_pair():
    s_tok = load_tokenizer(resolve_model_path("builtin:demo-student"))
    t_path = resolve_model_path("builtin:demo-teacher-bpe")
    return s_tok, load_tokenizer(t_path), LocalTeacher(load_model(t_path))


def test_the_teacher_context_does_not_leak_the_students_next_character():
    """The BPE teacher writes "+0=" as one token and "+0" alone only when "=" does not follow; its tokenization of
    "0+3+0+0" ends a token right before the student's next "+" because of that "+". A context cut there would tell
    the teacher the answer (a student that wrote "+" would be told "+" is right: the collapse this rule fixed).
    The context backs off to where the prefix alone tokenizes the same: after "0+3+0" the teacher wants "=", whatever
    the student wrote next."""
    s_tok, t_tok, inner = _demo_pair()
    cross = CrossTokenizerTeacher(inner, s_tok, t_tok, teacher_topk=len(t_tok), teacher_width=len(t_tok))
    prompt = "7890+1663="
    for text in ("0+3+0+0+0", "0+3+0=3,9"):
        rows = _rows(s_tok, [text], [prompt], eos=False)
        got = cross.score(rows, ScoreRequest(k=4, sampled=True))
        t = int(rows.response_mask[0].nonzero()[0]) + 5 - 1  # the row that predicts the 6th character
        assert s_tok.convert_ids_to_tokens(int(got.topk.ids[0, t, 0])) == "=", text
        assert float(got.topk.logprobs[0, t, 0].exp()) > 0.9
    full = t_tok("0+3+0+0+0", add_special_tokens=False)["input_ids"]
    assert t_tok.convert_ids_to_tokens(full)[:3] != ["0", "+3", "+0="]  # the whole text's tokens do cut there


def test_windowed_prefix_tokenization_gives_the_whole_prefix_starts(monkeypatch):
    """Each prefix is re-tokenized from a boundary WINDOW longest-token lengths back; the contexts it gives equal
    those of re-tokenizing every whole prefix (WINDOW large)."""
    from opdistill.teachers import xtok as xtok_module

    s_tok, t_tok, inner = _demo_pair()
    prompts, texts = _problems(12, seed=4)
    texts = [t * 3 for t in texts]  # long enough for the window to start inside
    rows = _rows(s_tok, texts, prompts)
    cross = CrossTokenizerTeacher(inner, s_tok, t_tok, teacher_topk=len(t_tok))
    narrow = cross.teacher_rows(rows)[1]
    assert any(w[0] > 0 for w in cross._windows(narrow[0].student_ids, narrow[0].teacher_ids))  # windows start late
    monkeypatch.setattr(xtok_module, "WINDOW", 10_000)
    wide = cross.teacher_rows(rows)[1]
    assert all(w == (0, 0) for w in cross._windows(wide[0].student_ids, wide[0].teacher_ids))
    assert [r.starts for r in narrow] == [r.starts for r in wide]


def test_retokenizing_through_the_fast_tokenizer_equals_the_tokenizer_call():
    """The teacher's ids of a response come from its fast tokenizer's batch encoder: the student's ids -> bytes ->
    text -> ids are what calling the tokenizer on the text gives, for the demo BPE, the character-level tokenizer
    and the SentencePiece-style one with byte fallback, on arithmetic and unicode text."""
    from tests.test_xtok_mapping import ARITH, UNICODE, _sentencepiece_byte_fallback

    s_tok, t_tok, inner = _demo_pair()
    sp = _sentencepiece_byte_fallback(["café au lait naïve über 12 345"] * 20)
    for tok, texts in ((t_tok, ARITH), (s_tok, ARITH), (sp, ARITH + UNICODE + ["  spaces  around "])):
        cross = CrossTokenizerTeacher(inner, tok, tok, teacher_topk=4)
        for text in texts:
            want = tok(text, add_special_tokens=False)["input_ids"]
            assert cross._retokenize([want, want + [tok.eos_token_id]]) == [want, want + [tok.eos_token_id]], text
