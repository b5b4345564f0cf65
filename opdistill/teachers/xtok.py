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

An episode (SPEC 6.8) is mapped turn by turn: the teacher's row is its own prompt (the tools listed), then each
student turn in its tokens, and between two turns the same tool results written by the teacher's chat template
(``Rows.tool_results``, :class:`~opdistill.env.ToolMessages`), as the teacher would read them in its own format. Each
turn is mapped as a response of its own (its context: everything before it in the teacher's row), so only the
student's turns are mapped and counted; the environment's positions carry no signal.

The same tokenizer on both sides gives the same-tokenizer losses (tested, episodes too); the wrapper is built only
when ``xtok.mode`` asks for it, so a teacher with another tokenizer is still refused without it.
"""
from __future__ import annotations

import copy

import torch

from opdistill.data import render_prompts
from opdistill.env.environment import ToolMessages
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
    where the rest is unknown); ``use_chat_template``: render prompts through the teacher's chat template;
    ``tools``: an episode's tool schemas (SPEC 6.8), which the teacher's prompts list; its template must then write
    tool messages (checked here, one ConfigError)."""

    def __init__(self, inner: Teacher, student_tok, teacher_tok, *, mode: str = "bpm", teacher_topk: int = 256,
                 use_chat_template: bool = True, teacher_width: int | None = None, key: str | None = None,
                 tools: list | None = None):
        if mode not in ("bpm", "sampled"):
            raise ValueError(f"xtok.mode: expected bpm or sampled, got {mode!r}")
        super().__init__(inner)
        self.mode = mode
        self.key = key or inner.key
        self.background = False  # it maps in the caller's thread: its mask decides the step's rows
        self.sum_names, self.masks = SUM_NAMES, True
        self.student_tok, self.teacher_tok = student_tok, teacher_tok
        self.use_chat_template = use_chat_template
        self.tools = tools
        self.messages = None if tools is None else ToolMessages(
            teacher_tok, f"{self.key}'s tokenizer", key="xtok.mode")  # how the teacher writes the tool results
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

    def teacher_rows(self, rows: Rows) -> tuple[Rows, list[RowText], list[tuple[int, int, int]]]:
        """The rows in the teacher's tokens, each student turn's two tokenizations (one turn per row for a single
        response), and per turn (its row, where it starts on the student's side, on the teacher's)."""
        if rows.prompts is None:
            raise TeacherError(f"{self.key}: a cross-tokenizer teacher renders each prompt through its own chat "
                               "template, and these rows carry no prompts (a teacher cache or a hand-built Rows: "
                               "give Rows(prompts=...))")
        per_row = self._turns(rows)
        texts = iter(self._texts([ids for runs in per_row for _, ids in runs]))
        prompts = render_prompts(self.teacher_tok, rows.prompts, use_chat_template=self.use_chat_template,
                                 tools=self.tools)
        seqs, spans, all_texts = [], [], []
        for b, (prompt, runs) in enumerate(zip(prompts, per_row)):
            seq = list(prompt)
            for j, (start, _) in enumerate(runs):
                if j:  # the tool results between turn j - 1 and turn j, as the teacher's template writes them
                    seq += self.messages.ids(rows.tool_results[b][j - 1])
                rt = next(texts)
                spans.append((b, start, len(seq)))
                all_texts.append(rt)
                seq += rt.teacher_ids
            seqs.append(seq)
        texts = all_texts
        width = max(map(len, seqs))
        pad = self.teacher_tok.pad_token_id if self.teacher_tok.pad_token_id is not None else 0
        ids = torch.full((rows.num_rows, width), pad, dtype=torch.long)
        am = torch.zeros(rows.num_rows, width, dtype=torch.long)
        rm = torch.zeros(rows.num_rows, width, dtype=torch.long)
        for b, seq in enumerate(seqs):
            ids[b, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            am[b, :len(seq)] = 1
        for (b, _, t0), rt in zip(spans, texts):
            rm[b, t0:t0 + len(rt.teacher_ids)] = 1
        return Rows(ids, am, rm, rows.tags, rows.prompts), texts, spans

    def _turns(self, rows: Rows) -> list[list[tuple[int, list]]]:
        """Per row, its student turns as (start position, ids): the runs of its response mask (one for a single
        response; an episode's, with the environment's tokens between them, need ``rows.tool_results``)."""
        out = []
        lengths = rows.attention_mask.sum(-1).tolist()
        for b in range(rows.num_rows):
            mask = rows.response_mask[b, :lengths[b]].tolist()
            runs, t = [], 0
            while t < len(mask):
                if mask[t]:
                    e = t
                    while e < len(mask) and mask[e]:
                        e += 1
                    runs.append((t, rows.input_ids[b, t:e].tolist()))
                    t = e
                else:
                    t += 1
            if not runs:
                runs = [(lengths[b], [])]  # nothing to score: an empty turn at the row's end
            if len(runs) > 1:
                results = None if rows.tool_results is None else rows.tool_results[b]
                if self.messages is None or results is None or len(results) != len(runs) - 1:
                    raise TeacherError(
                        f"{self.key}: row {b} is an episode of {len(runs)} student turns, and a cross-tokenizer "
                        f"teacher writes the tool results between them through its own chat template: it needs "
                        + ("the run's tools (CrossTokenizerTeacher(tools=...))" if self.messages is None else
                           f"{len(runs) - 1} tool results in Rows.tool_results, got "
                           f"{'none' if results is None else len(results)}"))
            out.append(runs)
        return out

    def _texts(self, turns: list[list]) -> list[RowText]:
        """Each student turn's two tokenizations (module notes), the teacher's in its ids."""
        if self.same:  # one tokenizer: the student's own tokens, the identity (SPEC 6.6)
            return [RowText(s_ids, s_ids) for s_ids in turns]
        if self.mode == "sampled":  # the fallback reads the teacher's own pieces from the boundary at c: no back-off
            return [RowText(s_ids, full) for s_ids, full in zip(turns, self._retokenize(turns))]
        fulls = self._retokenize(turns)
        windows = [self._windows(s_ids, full) for s_ids, full in zip(turns, fulls)]
        pieces = self._retokenize([s_ids[i_w:i] for s_ids, win in zip(turns, windows)
                                   for i, (i_w, _) in enumerate(win)])
        texts, at = [], 0
        for s_ids, full, win in zip(turns, fulls, windows):
            texts.append(RowText(s_ids, full, self._starts(full, win, pieces[at:at + len(win)])))
            at += len(win)
        return texts

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
    def candidates(got: TeacherScores, texts: list[RowText], spans: list[tuple[int, int, int]]) -> tuple[list, list,
                                                                                                        list]:
        """Each turn's teacher answer over it (from the position before it): the top-K_T ids, their log-probs, and
        the log-probs of the teacher's own tokens, as :func:`map_rows` takes them."""
        cand_ids, cand_lp, path_lp = [], [], []
        for (b, _, t0), rt in zip(spans, texts):
            lo, hi = t0 - 1, t0 - 1 + len(rt.teacher_ids)
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
        t_rows, texts, spans = self.teacher_rows(rows)
        got = self.inner.submit(t_rows, ScoreRequest(k=self.teacher_topk, sampled=True,
                                                     temperature=request.temperature, what=request.what)).result()
        out = map_rows(self.vmap, texts, *self.candidates(got, texts, spans), k=request.k, mode=self.mode)
        B, W = rows.input_ids.shape
        dtype = got.sampled_logprobs.dtype
        row = torch.tensor([b for b, _, _ in spans], dtype=torch.long)[out.row]  # each turn's row
        pos = torch.tensor([s for _, s, _ in spans], dtype=torch.long)[out.row] + out.index - 1  # next-token row t
        mask = torch.ones(B, W, dtype=torch.bool)
        mask[row, pos] = out.mask
        topk = None
        if request.k is not None:
            ids = torch.zeros(B, W, request.k, dtype=torch.long)
            lp = torch.full((B, W, request.k), float("-inf"), dtype=dtype)
            ok = out.mask
            ids[row[ok], pos[ok]] = out.topk_ids[ok]
            lp[row[ok], pos[ok]] = out.topk_logprobs[ok].to(dtype)
            topk = TeacherTopK(ids, lp, validated=True)
        sampled = None
        if request.sampled:
            sampled = torch.zeros(B, W, dtype=dtype)
            sampled[row[out.mask], pos[out.mask]] = out.sampled[out.mask].to(dtype)
        stats = {"positions": float(out.row.numel()), "exact": float(out.exact.sum()),
                 "masked": float((~out.mask).sum()), "residual": float(out.residual.sum())}
        return TeacherScores(topk, sampled, mask=mask, sums=stats)
