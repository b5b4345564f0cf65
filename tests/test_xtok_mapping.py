"""Byte-prefix marginalisation (SPEC 6.6, opdistill/xtok) against references written from the definition: a
brute-force walk over every teacher token (no tables, no tensors), chain-rule products computed by hand, and the
identity with the same tokenizer on both sides."""
import math
import random

import pytest
import torch

from opdistill.models import bpe_tokenizer, char_tokenizer
from opdistill.xtok import RowText, TokenBytes, TokenizerBytesError, VocabMap, map_rows, token_bytes
from opdistill.xtok.tokens import EOS_SENTINEL


def _longest(table, data: bytes) -> int:
    """The longest student token that is a prefix of ``data``, by scanning the whole vocabulary (lowest id on ties)."""
    best, best_len = -1, 0
    for i, b in enumerate(table):
        if b and len(b) > best_len and data.startswith(b):
            best, best_len = i, len(b)
    return best


def reference(S: TokenBytes, T: TokenBytes, row: RowText, q: torch.Tensor):
    """nu per student position from the definition, with the teacher's full distributions ``q`` [m, V_T] (probs,
    float64): (dict student id -> prob, residual, exact). Special tokens are their sentinel bytes. The teacher's
    context for student token i stops before teacher token ``row.starts[i]`` (default: the one covering its first
    byte); p is the bytes from there to the token's start."""
    text = b"".join(S.table[i] for i in row.student_ids)
    t_text = [T.table[i] for i in row.teacher_ids]
    assert b"".join(t_text) == text
    t_off = [sum(len(x) for x in t_text[:d]) for d in range(len(t_text) + 1)]
    out = []
    c = 0
    for i, y in enumerate(row.student_ids):
        e = c + len(S.table[y])
        j = max(d for d in range(len(t_text)) if t_off[d] <= c)
        j0 = j if row.starts is None else row.starts[i]
        p = text[t_off[j0]:c]
        nu, residual, z = {}, 0.0, 0.0

        def branch(d, written, weight):
            """Every teacher token at depth d after the bytes ``written`` (from t_off[j0]) along the response."""
            nonlocal residual, z
            for tau in range(q.shape[1]):
                mass = weight * float(q[d, tau])
                B = written + T.table[tau]
                if tau == row.teacher_ids[d] and t_off[d + 1] < e:  # the teacher's own token, ending inside y
                    branch(d + 1, B, mass)
                elif len(B) > len(p) and B.startswith(p):  # writes p and goes on past c
                    z += mass
                    s = _longest(S.table, B[len(p):])
                    if s >= 0:
                        nu[s] = nu.get(s, 0.0) + mass
                    else:
                        residual += mass
                # else: not p, or ends at c / inside p off the response (what follows is unknown): left out

        branch(j0, b"", 1.0)
        if not p:
            z = 1.0
        out.append(({s: v / z for s, v in nu.items()}, residual / z, c in t_off and e in t_off))
        c = e
    return out


def _run(S, T, row, q, k):
    lq = q.log()
    m = len(row.teacher_ids)
    ids = torch.arange(q.shape[1]).expand(m, -1)
    path = lq[torch.arange(m), torch.tensor(row.teacher_ids)]
    return map_rows(VocabMap(S, T), [row], [ids], [lq], [path], k=k)


def _check_against_reference(S, T, row, q, k=6):
    got = _run(S, T, row, q, k)
    ref = reference(S, T, row, q)
    assert got.mask.all()
    for n, (nu, residual, exact) in enumerate(ref):
        top = sorted(nu.items(), key=lambda kv: -kv[1])[:k]
        gi, gl = got.topk_ids[n].tolist(), got.topk_logprobs[n]
        got_top = {i: math.exp(v) for i, v in zip(gi, gl.tolist()) if v > float("-inf")}
        assert set(got_top) == {i for i, v in top if v > 0}, n
        for i, v in top:
            assert got_top[i] == pytest.approx(v, rel=1e-12, abs=1e-300)
        assert float(got.residual[n]) == pytest.approx(residual, abs=1e-12)
        assert bool(got.exact[n]) == exact
        y = row.student_ids[n]
        want = math.log(nu[y]) if nu.get(y, 0) > 0 else float("-inf")
        assert float(got.sampled[n]) == pytest.approx(want, rel=1e-12)
        assert sum(nu.values()) + residual == pytest.approx(1.0, abs=1e-12)  # nothing lost, nothing made
    return got


def _dists(m, V, seed, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(m, V, generator=g, dtype=torch.float64) * sharp, -1)


def _row(stok, ttok, text, eos=True):
    s = stok(text, add_special_tokens=False)["input_ids"] + ([stok.eos_token_id] if eos else [])
    t = ttok(text, add_special_tokens=False)["input_ids"] + ([ttok.eos_token_id] if eos else [])
    return RowText(s, t)


ARITH = ["0+3+0=3,9+6+0=15,8+6+1=15>9553", "12+30=42", "7+8+1=16,4+3+1=8>8617"]


def test_chain_rule_two_teacher_tokens_per_student_token():
    """Every student token is exactly two teacher tokens: nu(student xy) at each position is the teacher's
    q_j(x) q_{j+1}(y) when x is the teacher's own next token (known only along the response), 0 otherwise."""
    letters = "abc"
    T = TokenBytes("teacher", [EOS_SENTINEL] + [c.encode() for c in letters], {"</s>": 0}, 0, "plain")
    pairs = [x + y for x in letters for y in letters]
    S = TokenBytes("student", [EOS_SENTINEL] + [p.encode() for p in pairs], {"</s>": 0}, 0, "plain")
    text = "abcabba"[:6]  # ab ca bb
    s_ids = [1 + pairs.index(text[i:i + 2]) for i in range(0, 6, 2)] + [0]
    t_ids = [1 + letters.index(ch) for ch in text] + [0]
    q = _dists(len(t_ids), 4, seed=1)
    got = _run(S, T, RowText(s_ids, t_ids), q, k=9)
    for n in range(3):
        j = 2 * n
        x = t_ids[j]  # the teacher's own first piece
        for s, pair in enumerate(pairs, start=1):
            px, py = 1 + letters.index(pair[0]), 1 + letters.index(pair[1])
            want = float(q[j, x] * q[j + 1, py]) if px == x else 0.0  # chain rule, by hand
            got_p = {i: math.exp(v) for i, v in zip(got.topk_ids[n].tolist(), got.topk_logprobs[n].tolist())
                     if v > float("-inf")}.get(s, 0.0)
            assert got_p == pytest.approx(want, rel=1e-12, abs=1e-300), (n, pair)
        # the sampled token is the product of its two pieces, and the position is exact
        assert float(got.sampled[n]) == pytest.approx(math.log(q[j, t_ids[j]] * q[j + 1, t_ids[j + 1]]), rel=1e-12)
        assert bool(got.exact[n])
        # the residual: the first piece's other letters (no 1-letter student token) and, after the first piece,
        # the end (the text would end inside a student token); the end at the start goes to the student's end
        want_res = 1 - float(q[j, x]) - float(q[j, 0]) + float(q[j, x] * q[j + 1, 0])
        assert math.exp(float(got.topk_logprobs[n][got.topk_ids[n] == 0][0])) == pytest.approx(float(q[j, 0]))
        assert float(got.residual[n]) == pytest.approx(want_res, rel=1e-12)
    # the end: the teacher's end-of-sequence probability, to the student's
    assert float(got.sampled[3]) == pytest.approx(math.log(q[6, 0]), rel=1e-12)


@pytest.mark.parametrize("text", ARITH)
def test_char_student_bpe_teacher_matches_reference(text):
    """Digits and operators merged across each other (the demo pair): the student writes one character at a time,
    so most positions sit inside a teacher token and are conditioned on its bytes so far."""
    stok = char_tokenizer("0123456789+=,>")
    ttok = bpe_tokenizer(ARITH * 50, vocab_size=290)
    S, T = token_bytes(stok), token_bytes(ttok)
    row = _row(stok, ttok, text)
    assert len(row.teacher_ids) < len(row.student_ids)  # the teacher's tokens are longer
    got = _check_against_reference(S, T, row, _dists(len(row.teacher_ids), len(T.table), seed=2))
    assert not got.exact.all() and got.exact.any()


UNICODE = ["café au lait 12 345 €", "naïve 😀 über 1,000,000", "日本語 テスト 42"]


def _sentencepiece_byte_fallback(texts, vocab_size=120):
    """A SentencePiece-style BPE with byte fallback (``<0xNN>`` tokens for what its vocabulary lacks), no prefix."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import json

    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.Replace(" ", "▁")
    tk.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size + 3, special_tokens=["<pad>", "<s>", "</s>"],
                                  show_progress=False, limit_alphabet=40)
    tk.train_from_iterator(texts, trainer)
    model = json.loads(tk.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):  # the byte tokens are ordinary vocabulary (not special), so they write their byte
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    sp = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    sp.normalizer = tk.normalizer
    sp.pre_tokenizer = tk.pre_tokenizer
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    return tok


@pytest.mark.parametrize("text", UNICODE)
def test_byte_level_vs_byte_fallback_unicode_matches_reference(text):
    """A byte-level BPE merging across spaces and digits against a SentencePiece-style tokenizer that writes what it
    lacks byte by byte (``<0xE2><0x82><0xAC>`` for the euro sign): both directions, unicode text."""
    corpus = [u * 3 for u in UNICODE] + ARITH
    blevel = bpe_tokenizer(corpus * 20, vocab_size=330)
    sp = _sentencepiece_byte_fallback(["café au lait naïve über 12 345"] * 20)
    Sb, Ssp = token_bytes(blevel), token_bytes(sp)
    assert Ssp.kind == "sentencepiece" and Sb.kind == "byte-level"
    ids = sp(text, add_special_tokens=False)["input_ids"]
    assert any(sp.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte fallback is exercised
    assert b"".join(Ssp.table[i] for i in ids) == text.encode()
    assert b"".join(Sb.table[i] for i in blevel(text, add_special_tokens=False)["input_ids"]) == text.encode()
    for stok, ttok, S, T in ((blevel, sp, Sb, Ssp), (sp, blevel, Ssp, Sb)):
        row = _row(stok, ttok, text)
        _check_against_reference(S, T, row, _dists(len(row.teacher_ids), len(T.table), seed=3, sharp=2.0))


def test_merges_across_spaces_and_digits():
    """A byte-level BPE trained without pre-splitting merges across spaces and digits ("5 + 1", "0 0"); against the
    character-level student every position maps, and the probabilities sum to one with the residual."""
    texts = ["15 + 27 = 42", "100 + 200 = 300", "9 9 9 + 1 = 1000"]
    ttok = bpe_tokenizer(texts * 40, vocab_size=300)
    toks = [ttok.convert_ids_to_tokens(i) for i in ttok("15 + 27 = 42", add_special_tokens=False)["input_ids"]]
    assert any("Ġ" in t and len(t) > 1 and t != "Ġ" for t in toks)  # a merge across a space
    stok = char_tokenizer("0123456789+= ")
    for text in texts:
        row = _row(stok, ttok, text)
        _check_against_reference(token_bytes(stok), token_bytes(ttok), row,
                                 _dists(len(row.teacher_ids), len(ttok), seed=4))


def test_identity_maps_every_token_to_itself():
    """Same tokenizer on both sides: every position aligned and exact, the student's top-K the teacher's, the
    residual only the teacher's own tail (none over the whole vocabulary)."""
    tok = bpe_tokenizer(ARITH * 50, vocab_size=290)
    S = token_bytes(tok)
    row = _row(tok, tok, ARITH[0])
    q = _dists(len(row.teacher_ids), len(S.table), seed=5)
    got = _run(S, S, row, q, k=5)
    assert got.exact.all() and got.mask.all()
    top = q.topk(5, dim=-1)
    assert torch.equal(got.topk_ids, top.indices)
    assert torch.allclose(got.topk_logprobs, top.values.log(), rtol=0, atol=1e-14)
    assert torch.allclose(got.residual, torch.zeros_like(got.residual), atol=1e-13)


def test_mismatched_text_is_masked_and_counted():
    """A character the teacher's tokenizer cannot write (its <unk>): the positions from there on have no signal,
    masked, not silently mapped."""
    stok = char_tokenizer("abc")
    ttok = char_tokenizer("ab")
    text = "abcab"
    s = stok(text, add_special_tokens=False)["input_ids"] + [stok.eos_token_id]
    t = ttok(text, add_special_tokens=False)["input_ids"] + [ttok.eos_token_id]  # 'c' -> <unk>
    S, T = token_bytes(stok), token_bytes(ttok)
    V = len(T.table)
    got = map_rows(VocabMap(S, T), [RowText(s, t)], [torch.arange(V).expand(len(t), V)],
                   [_dists(len(t), V, seed=6).log()], [torch.full((len(t),), -1.0)], k=3)
    assert got.mask.tolist() == [True, True, False, False, False, False]
    assert got.exact.tolist() == [True, True, False, False, False, False]


def test_sampled_mode_only_at_exact_positions():
    """``mode='sampled'``: the teacher's log-prob of the student's token, the product of its pieces, where both
    tokenizations have a boundary at its start and end; masked elsewhere."""
    stok = char_tokenizer("0123456789+=,>")
    ttok = bpe_tokenizer(ARITH * 50, vocab_size=290)
    S, T = token_bytes(stok), token_bytes(ttok)
    row = _row(stok, ttok, ARITH[0])
    q = _dists(len(row.teacher_ids), len(T.table), seed=7)
    lq = q.log()
    m = len(row.teacher_ids)
    path = lq[torch.arange(m), torch.tensor(row.teacher_ids)]
    got = map_rows(VocabMap(S, T), [row], [torch.arange(len(T.table)).expand(m, -1)], [lq], [path], k=None,
                   mode="sampled")
    ref = reference(S, T, row, q)
    assert got.mask.tolist() == [r[2] for r in ref]
    t_text = [T.table[i] for i in row.teacher_ids[:-1]]
    ends = {sum(len(x) for x in t_text[:d + 1]): d for d in range(len(t_text))}
    c = 0
    for n, y in enumerate(row.student_ids[:-1]):
        c += len(S.table[y])
        if got.mask[n]:  # a single-character teacher token: its own log-prob
            assert float(got.sampled[n]) == pytest.approx(float(path[ends[c]]), rel=1e-12)
    assert got.topk_ids is None


def test_token_bytes_reads_each_kind_and_refuses_what_cannot_map():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bl = bpe_tokenizer(["a b"] * 5, vocab_size=262)
    t = token_bytes(bl)
    assert t.table[bl.convert_tokens_to_ids("Ġ")] == b" " and t.table[bl.eos_token_id] == EOS_SENTINEL
    assert t.table[bl.convert_tokens_to_ids("<pad>")] == b"\xff<pad>\xff"
    sp = _sentencepiece_byte_fallback(["ab ab"] * 5, vocab_size=10)
    t = token_bytes(sp)
    assert t.table[sp.convert_tokens_to_ids("<0xE2>")] == b"\xe2"
    assert t.table[sp.convert_tokens_to_ids("▁")] == b" "
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "ab": 1, "##c": 2}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wp.decoder = decoders.WordPiece()
    bad = PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]")
    with pytest.raises(TokenizerBytesError) as e:
        token_bytes(bad, "teachers.0.path's tokenizer")
    assert str(e.value) == ("teachers.0.path's tokenizer: cannot map its tokens to bytes (decoder WordPiece, "
                            "pre-tokenizer Whitespace): cross-tokenizer distillation needs a byte-level, "
                            "SentencePiece-style or character-preserving tokenizer")


def test_token_bytes_read_once_per_tokenizer_content_and_again_after_added_tokens(tmp_path):
    from transformers import AutoTokenizer

    tok = bpe_tokenizer(["a b"] * 5, vocab_size=262)
    first = token_bytes(tok, "model.student's tokenizer")
    tok.save_pretrained(tmp_path)
    other = AutoTokenizer.from_pretrained(tmp_path)  # another object of the same content (the teacher's own load)
    again = token_bytes(other, "model.teacher's tokenizer")
    assert again.table is first.table and again.name == "model.teacher's tokenizer"  # one reading, each its name
    assert first.name == "model.student's tokenizer"
    unlike = bpe_tokenizer(["cd ef"] * 5, vocab_size=262)  # other merges, the same length: another reading
    assert len(unlike) == len(tok) and token_bytes(unlike).table != first.table
    tok.add_tokens(["<extra>"], special_tokens=True)
    grown = token_bytes(tok)
    assert grown.table is not first.table and grown.table[tok.convert_tokens_to_ids("<extra>")] == b"\xff<extra>\xff"


def test_random_texts_property_total_mass_is_one():
    """Property: over random arithmetic texts and random teacher distributions, student mass + residual = 1 and the
    sampled token's log-prob is that of its top-K slot when it is there."""
    rng = random.Random(0)
    stok = char_tokenizer("0123456789+=,> ")
    ttok = bpe_tokenizer([" ".join(ARITH)] * 50, vocab_size=300)
    S, T = token_bytes(stok), token_bytes(ttok)
    for trial in range(6):
        text = "".join(rng.choice("0123456789+=,> ") for _ in range(rng.randint(3, 25)))
        row = _row(stok, ttok, text, eos=trial % 2 == 0)
        _check_against_reference(S, T, row, _dists(len(row.teacher_ids), len(T.table), seed=10 + trial))


@pytest.mark.parametrize("seed", range(4))
def test_backed_off_contexts_match_reference(seed):
    """The teacher's context stopping earlier than the token that covers the student's position (``starts``, what
    the teacher backs off to where its own boundary depends on the bytes that follow): the prefix then spans several
    teacher tokens, matched along the teacher's own tokens (chain rule) and conditioned on, in both directions of
    coarseness (character student vs BPE teacher, and the reverse)."""
    rng = random.Random(seed)
    chars = "0123456789+=,>"
    ctok = char_tokenizer(chars)
    btok = bpe_tokenizer(ARITH * 50, vocab_size=290)
    C, B = token_bytes(ctok), token_bytes(btok)
    text = ARITH[seed % len(ARITH)]
    for stok, ttok, S, T in ((ctok, btok, C, B), (btok, ctok, B, C)):
        row = _row(stok, ttok, text)
        t_text = [T.table[i] for i in row.teacher_ids]
        t_off = [sum(len(x) for x in t_text[:d]) for d in range(len(t_text))]
        starts, c = [], 0
        for y in row.student_ids:
            j = max(d for d in range(len(t_text)) if t_off[d] <= c)
            starts.append(rng.randint(max(0, j - 3), j))
            c += len(S.table[y])
        row = RowText(row.student_ids, row.teacher_ids, starts)
        q = _dists(len(row.teacher_ids), len(T.table), seed=20 + seed, sharp=1.5)
        got = _check_against_reference(S, T, row, q)
        assert got.mask.all()
