"""A teacher whose tokenizer differs from the student's (SPEC 6.6): :class:`CrossTokenizerTeacher`.

It wraps any teacher that scores rows in the teacher's own tokens (the model in this process, a sharded one, our
teacher server, a member of a routed set) and answers in the student's tokens:

1. each row's response (the student's ids) -> its bytes -> its text; the prompt as the data gave it
   (``Rows.prompts``) through the teacher's chat template; the text through the teacher's tokenizer (special tokens,
   the end-of-sequence token among them, as the teacher's with the same content); with one tokenizer on both sides
   the student's own ids;
2. where each student position's teacher context stops (:meth:`CrossTokenizerTeacher._starts`: before a teacher
   boundary that the student's next bytes decided, which would leak them to the teacher);
3. the wrapped teacher scores those rows: its top-K_T (``xtok.teacher_topk``) and its log-prob of its own next token
   at every response position;
4. :func:`opdistill.xtok.map_rows` maps them onto the student's positions: the student top-K plus a residual bucket
   (``xtok.mode: bpm``), or the log-prob of the student's sampled token where both tokenizations have a boundary at
   its start and end (``xtok.mode: sampled``, the cheap fallback);
5. the scores carry ``mask`` (positions without a signal: the trainer drops them from the step and counts them) and
   the sums behind ``xtok/exact_frac``, ``xtok/residual_mass`` and ``xtok/masked_frac``.

The same tokenizer on both sides gives the same-tokenizer losses (tested); the wrapper is built only when
``xtok.mode`` asks for it, so a teacher with another tokenizer is still refused without it.
"""
from __future__ import annotations

import copy

import torch

from opdistill.data import render_prompts
from opdistill.loss import TeacherScores, TeacherTopK
from opdistill.teachers.base import Rows, ScoreRequest, Teacher, TeacherError, WrappedTeacher
from opdistill.xtok import RowText, VocabMap, map_rows, token_bytes

__all__ = ["CrossTokenizerTeacher", "WINDOW"]

#: how far back (in the teacher's longest token lengths) a prefix is re-tokenized to find where its context stops
WINDOW = 4
#: the sums each answer carries (opdistill/xtok/bpm.py), summed over a step's rows on every rank
SUM_NAMES = ("positions", "exact", "masked", "residual")


class CrossTokenizerTeacher(WrappedTeacher):
    """``inner`` (a teacher in the teacher tokenizer's ids) answering in the student's tokens (module notes).

    ``student_tok`` / ``teacher_tok``: the two tokenizers; ``mode``: "bpm" or "sampled"; ``teacher_topk``: the
    teacher's top-K_T asked per position (capped at its vocabulary; the whole vocabulary makes the mapping exact
    where the rest is unknown); ``use_chat_template``: render prompts through the teacher's chat template."""

    def __init__(self, inner: Teacher, student_tok, teacher_tok, *, mode: str = "bpm", teacher_topk: int = 256,
                 use_chat_template: bool = True, teacher_width: int | None = None, key: str | None = None):
        if mode not in ("bpm", "sampled"):
            raise ValueError(f"xtok.mode: expected bpm or sampled, got {mode!r}")
        super().__init__(inner)
        self.mode = mode
        self.key = key or inner.key
        self.background = False  # it maps in the caller's thread: its mask decides the step's rows
        self.sum_names, self.masks = SUM_NAMES, True
        self.student_tok, self.teacher_tok = student_tok, teacher_tok
        self.use_chat_template = use_chat_template
        self.vmap = VocabMap(token_bytes(student_tok, "model.student's tokenizer"),
                             token_bytes(teacher_tok, f"{self.key}'s tokenizer"), teacher_width)
        self.teacher_topk = min(int(teacher_topk), self.vmap.prefix.shape[0])
        self.same = student_tok.get_vocab() == teacher_tok.get_vocab() and self.vmap.student.table == \
            self.vmap.teacher.table
        self._content = {i: content for content, i in self.vmap.student.specials.items()}
        self._backend = teacher_tok.backend_tokenizer  # a fast tokenizer (token_bytes refused any other)
        self._closed = [False]  # shared by the copies of with_mode: the teacher they wrap is closed once

    def with_mode(self, mode: str) -> "CrossTokenizerTeacher":
        """The same teacher and tables, mapping in ``mode`` (the evaluation's reads bpm whatever the training's)."""
        if mode not in ("bpm", "sampled"):
            raise ValueError(f"xtok.mode: expected bpm or sampled, got {mode!r}")
        if mode == self.mode:
            return self
        other = copy.copy(self)
        other.mode = mode
        return other

    @property
    def limits(self) -> dict:
        return dict(self.inner.limits, max_requested_ids=0)

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """``xtok/exact_frac`` and ``xtok/masked_frac`` (shares of the scored positions), ``xtok/residual_mass``
        (mean over the positions with a signal), token-weighted over the step (SPEC 6.6)."""
        positions, masked = sums["positions"], sums["masked"]
        n = max(positions, 1.0)
        return {"xtok/exact_frac": sums["exact"] / n, "xtok/masked_frac": masked / n,
                "xtok/residual_mass": sums["residual"] / max(positions - masked, 1.0)}

    def close(self) -> None:
        if not self._closed[0]:
            self._closed[0] = True
            self.inner.close()

    def teacher_rows(self, rows: Rows) -> tuple[Rows, list[RowText], list[int], list[int]]:
        """The rows in the teacher's tokens, each row's two tokenizations, and where each row's response starts on
        the student's side and on the teacher's."""
        if rows.prompts is None:
            raise TeacherError(f"{self.key}: a cross-tokenizer teacher renders each prompt through its own chat "
                               "template, and these rows carry no prompts (a teacher cache or a hand-built Rows: "
                               "give Rows(prompts=...))")
        seqs, texts, p_t, responses = [], [], [], []
        p_s = rows.response_starts().tolist()
        counts = rows.response_mask.sum(-1).tolist()
        for b, (start, n) in enumerate(zip(p_s, counts)):
            responses.append(rows.input_ids[b, start:start + int(n)].tolist())
        if self.same:  # one tokenizer: the student's own tokens, the identity (SPEC 6.6)
            texts = [RowText(s_ids, s_ids) for s_ids in responses]
        elif self.mode == "sampled":  # the fallback reads the teacher's own pieces from the boundary at c: no back-off
            texts = [RowText(s_ids, full) for s_ids, full in zip(responses, self._retokenize(responses))]
        else:
            fulls = self._retokenize(responses)
            windows = [self._windows(s_ids, full) for s_ids, full in zip(responses, fulls)]
            pieces = self._retokenize([s_ids[i_w:i] for s_ids, win in zip(responses, windows)
                                       for i, (i_w, _) in enumerate(win)])
            at = 0
            for s_ids, full, win in zip(responses, fulls, windows):
                texts.append(RowText(s_ids, full, self._starts(full, win, pieces[at:at + len(win)])))
                at += len(win)
        prompts = render_prompts(self.teacher_tok, rows.prompts, use_chat_template=self.use_chat_template)
        for prompt, rt in zip(prompts, texts):
            seqs.append((prompt, rt.teacher_ids))
            p_t.append(len(prompt))
        width = max(len(p) + len(t) for p, t in seqs)
        pad = self.teacher_tok.pad_token_id if self.teacher_tok.pad_token_id is not None else 0
        ids = torch.full((rows.num_rows, width), pad, dtype=torch.long)
        am = torch.zeros(rows.num_rows, width, dtype=torch.long)
        rm = torch.zeros(rows.num_rows, width, dtype=torch.long)
        for b, (prompt, t_ids) in enumerate(seqs):
            n = len(prompt) + len(t_ids)
            ids[b, :n] = torch.tensor(prompt + t_ids, dtype=torch.long)
            am[b, :n] = 1
            rm[b, len(prompt):n] = 1
        return Rows(ids, am, rm, rows.tags, rows.prompts), texts, p_s, p_t

    def _retokenize(self, responses: list[list]) -> list[list]:
        """The teacher's ids of student responses (or their prefixes): each stretch of text through the teacher's
        tokenizer (all of them in one batch call), each special token as the teacher's special with its content
        (end-of-sequence as its end-of-sequence). A response stops at a special token the teacher does not have or
        an id the student's tokenizer does not know: the positions from there on are masked (their bytes differ)."""
        S, T = self.vmap.student, self.vmap.teacher
        plans, stretches = [], []
        for s_ids in responses:
            plan, text = [], bytearray()
            for i in s_ids:
                if i >= len(S.table) or S.table[i] is None:
                    break
                if not S.is_special(i):
                    text += S.table[i]
                    continue
                t = T.eos_id if i == S.eos_id else T.specials.get(self._content.get(i))
                if text:
                    plan.append(len(stretches))
                    stretches.append(text.decode("utf-8", errors="replace"))
                    text = bytearray()
                if t is None:
                    break
                plan.append(-1 - t)  # a special token, as is
            if text:
                plan.append(len(stretches))
                stretches.append(text.decode("utf-8", errors="replace"))
            plans.append(plan)
        # the fast tokenizer's own batch encoder (what ``tokenizer(texts, add_special_tokens=False)`` runs, without
        # building a BatchEncoding per text)
        ids = [e.ids for e in self._backend.encode_batch(stretches, add_special_tokens=False)] if stretches else []
        return [[x for q in plan for x in (ids[q] if q >= 0 else [-1 - q])] for plan in plans]

    def _windows(self, s_ids: list, full: list) -> list[tuple[int, int]]:
        """Per student token i, where the prefix the teacher re-tokenizes for it starts: ``(student token, teacher
        token)`` at the latest byte that is a boundary of both tokenizations at least WINDOW teacher-token lengths
        before token i ((0, 0): the response's start). Merges reach no further than a few tokens, so the prefix's
        tokenization there is the whole prefix's (a difference only backs the context off further) and the cost
        stays linear in the response's length."""
        S, T = self.vmap.student, self.vmap.teacher
        reach = WINDOW * self.vmap.max_len
        t_at, at = {}, 0
        for d, t in enumerate(full):
            t_at.setdefault(at, d)
            at += len(T.table[t] or b"") if t < len(T.table) else 0
        out, both, k, c = [], [(0, 0, 0)], 0, 0  # both: (student token, teacher token, byte) at shared boundaries
        for i, y in enumerate(s_ids):
            if i and c in t_at:
                both.append((i, t_at[c], c))
            while k + 1 < len(both) and both[k + 1][2] <= c - reach:
                k += 1
            out.append(both[k][:2])
            c += len(S.table[y] or b"") if y < len(S.table) else 0
        return out

    def _starts(self, full: list, windows: list[tuple[int, int]], pieces: list[list]) -> list[int]:
        """Per student token i, the teacher token its context stops before. The teacher's tokenization of the whole
        response puts a boundary where its merges end, which depends on the bytes after it: a boundary right before
        the student's token i may be there *because of* what the student wrote next (a BPE teacher splits "+0" from
        "+0=" only when "=" does not follow), and a context ending there would tell the teacher the answer. So the
        context stops where the teacher's tokenization of the prefix alone (the bytes before token i, from its
        window: ``pieces[i]``) agrees with the whole one, less that prefix's last token unless no longer teacher
        token starts with it; the mapping then conditions on the bytes from there (opdistill/xtok/bpm.py)."""
        ext = self.vmap.extendable
        starts = []
        for (_, w), pre in zip(windows, pieces):
            common = 0
            while common < len(pre) and w + common < len(full) and pre[common] == full[w + common]:
                common += 1
            if not pre:
                starts.append(w)
            elif common == len(pre) and not (pre[-1] < len(ext) and ext[pre[-1]]):
                starts.append(w + common)  # the last token cannot grow: its boundary does not depend on what follows
            else:
                starts.append(w + min(common, len(pre) - 1))
        return starts

    @staticmethod
    def candidates(got: TeacherScores, texts: list[RowText], p_t: list[int]) -> tuple[list, list, list]:
        """Each row's teacher answer over its response (from the position before it): the top-K_T ids, their
        log-probs, and the log-probs of the teacher's own tokens, as :func:`map_rows` takes them."""
        cand_ids, cand_lp, path_lp = [], [], []
        for b, rt in enumerate(texts):
            lo, hi = p_t[b] - 1, p_t[b] - 1 + len(rt.teacher_ids)
            cand_ids.append(got.topk.ids[b, lo:hi])
            cand_lp.append(got.topk.logprobs[b, lo:hi])
            path_lp.append(got.sampled_logprobs[b, lo:hi])
        return cand_ids, cand_lp, path_lp

    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        if request.hidden or request.requested_ids is not None:
            raise TeacherError(f"{self.key}: a cross-tokenizer teacher maps top-k and sampled-token scores onto the "
                               "student's tokens; hidden states and log-probs at the student's ids (loss.loss_mode "
                               "full, loss.support union) need the student's vocabulary on the teacher's side")
        if self.mode == "sampled" and request.k is not None:
            raise TeacherError(f"{self.key}: xtok.mode sampled gives the teacher's log-prob of the student's token "
                               "only; a top-k loss needs xtok.mode bpm")
        t_rows, texts, p_s, p_t = self.teacher_rows(rows)
        got = self.inner.submit(t_rows, ScoreRequest(k=self.teacher_topk, sampled=True,
                                                     temperature=request.temperature, what=request.what)).result()
        out = map_rows(self.vmap, texts, *self.candidates(got, texts, p_t), k=request.k, mode=self.mode)
        B, W = rows.input_ids.shape
        dtype = got.sampled_logprobs.dtype
        pos = torch.tensor(p_s, dtype=torch.long)[out.row] + out.index - 1  # the next-token layout's row t
        mask = torch.ones(B, W, dtype=torch.bool)
        mask[out.row, pos] = out.mask
        topk = None
        if request.k is not None:
            ids = torch.zeros(B, W, request.k, dtype=torch.long)
            lp = torch.full((B, W, request.k), float("-inf"), dtype=dtype)
            ok = out.mask
            ids[out.row[ok], pos[ok]] = out.topk_ids[ok]
            lp[out.row[ok], pos[ok]] = out.topk_logprobs[ok].to(dtype)
            topk = TeacherTopK(ids, lp, validated=True)
        sampled = None
        if request.sampled:
            sampled = torch.zeros(B, W, dtype=dtype)
            sampled[out.row[out.mask], pos[out.mask]] = out.sampled[out.mask].to(dtype)
        stats = {"positions": float(out.row.numel()), "exact": float(out.exact.sum()),
                 "masked": float((~out.mask).sum()), "residual": float(out.residual.sum())}
        return TeacherScores(topk, sampled, mask=mask, sums=stats)
