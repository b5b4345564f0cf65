"""A teacher that scores the student's response under its own prompt (SPEC 6.7): :class:`ContextTeacher`.

The student's rows are ``prompt x + response y`` in the student's tokens; the teacher scores the same response
tokens under its own prompt x' (``Rows.teacher_prompts``, built by ``opdistill.data.TeacherPrompt`` from each row:
worked examples, a system prompt, the row's answer or hint). This wrapper lays out the teacher's rows
``x' + y`` (x' through the tokenizer's chat template), asks the teacher it wraps, and moves the answer back onto
the student's positions:

- student row b: its response starts at ``p_s`` (the first response position); everything from there to the row's
  end (``y``, response mask included) is copied after x' (``p_t`` tokens), so token ``p_s + j`` of the student's
  row is token ``p_t + j`` of the teacher's and the next-token scores of position ``t >= p_s - 1`` are the
  teacher's at ``t + p_t - p_s``;
- the requested ids of a union-support loss go the other way; unscored positions hold what every teacher returns
  there (empty top-k slots, sampled log-prob 0, requested log-prob -inf, hidden state 0, mask True).

An episode (SPEC 6.8) is copied whole from its first student token: the environment's tokens between the student's
turns stay context (response mask 0), and x' lists the tools (``tools``) as the student's prompt does.

Any teacher can be wrapped: in process (the frozen student, the LoRA base with its adapters off, another model),
FSDP2-sharded, a vLLM engine, our server or a pool of them (the server receives the teacher-side rows), routed
teachers, a cross-tokenizer teacher (which renders ``prompts`` through its own chat template: it is given x' there,
and maps the student's response tokens as it always does). With x' = x every answer is the wrapped teacher's own.
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from opdistill.data import render_prompts
from opdistill.loss import TeacherScores, TeacherTopK
from opdistill.loss.signals import GroupedScores
from opdistill.teachers.base import Rows, ScoreRequest, Teacher, TeacherError, WrappedTeacher

__all__ = ["ContextTeacher"]


class ContextTeacher(WrappedTeacher):
    """``inner`` scoring each row's response under the row's ``teacher_prompts`` entry (module notes);
    ``tokenizer``: the student's (x' in its tokens; a cross-tokenizer ``inner`` renders x' again in its own);
    ``tools``: the schemas of an episode's tools (SPEC 6.8), which x' lists as the student's prompt does."""

    def __init__(self, inner: Teacher, tokenizer, *, use_chat_template: bool = True, max_positions: int | None = None,
                 tools: list | None = None):
        super().__init__(inner)  # its groups: by the rows' tags, the teacher's rows being the student's row for row
        self.tools = tools
        # its own copy: the pipelined step scores in another thread than the evaluation's rendering, and a fast
        # tokenizer refuses two threads at once
        self.tokenizer, self.use_chat_template = copy.deepcopy(tokenizer), use_chat_template
        self.max_positions = max_positions  # the teacher's positions, when known: a longer row is refused
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def teacher_rows(self, rows: Rows) -> tuple[Rows, torch.Tensor, torch.Tensor]:
        """(the teacher's rows ``x' + y``, each row's response start on the student's side ``p_s`` [B], and the shift
        ``p_t - p_s`` [B])."""
        if rows.teacher_prompts is None or len(rows.teacher_prompts) != rows.num_rows:
            raise TeacherError(f"{self.key}: teacher.context scores each response under the row's own teacher prompt, "
                               "and these rows carry none (Rows.teacher_prompts: one per row)")
        B = rows.num_rows
        lengths = rows.attention_mask.sum(-1)
        p_s = rows.response_starts()  # a row without a response: its end (nothing to score)
        seqs = render_prompts(self.tokenizer, rows.teacher_prompts, use_chat_template=self.use_chat_template,
                              tools=self.tools)
        p_t = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        tail = lengths - p_s  # response and whatever follows it in the row
        width = int((p_t + tail).max()) if B else 1
        if self.max_positions is not None and width > self.max_positions:
            b = int((p_t + tail).argmax())
            raise TeacherError(f"{self.key}: a teacher row of {width} tokens ({int(p_t[b])} of teacher.context prompt "
                               f"+ {int(tail[b])} of response) exceeds the teacher's {self.max_positions} positions; "
                               f"use fewer teacher.context.examples or a lower rollout.max_new_tokens")
        ids = torch.full((B, width), self.pad_id, dtype=torch.long)
        am = torch.zeros(B, width, dtype=torch.long)
        rm = torch.zeros(B, width, dtype=torch.long)
        for b in range(B):
            n, s, t = int(tail[b]), int(p_s[b]), int(p_t[b])
            ids[b, :t] = torch.tensor(seqs[b], dtype=torch.long)
            ids[b, t:t + n] = rows.input_ids[b, s:s + n]
            am[b, :t + n] = 1
            rm[b, t:t + n] = rows.response_mask[b, s:s + n]
        return Rows(ids, am, rm, rows.tags, rows.teacher_prompts, tool_results=rows.tool_results), p_s, p_t - p_s

    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        t_rows, p_s, shift = self.teacher_rows(rows)
        t_request = request
        if request.requested_ids is not None:  # the student's layout -> the teacher's
            t_request = dataclasses.replace(request, requested_ids=_move(
                request.requested_ids, p_s + shift, -shift, t_rows.width, 0))
        got = self.inner.submit(t_rows, t_request).result()
        return _back(got, p_s, shift, rows.width)


def _move(x: torch.Tensor, start: torch.Tensor, shift: torch.Tensor, width: int, fill) -> torch.Tensor:
    """``out[b, t] = x[b, t + shift[b]]`` for ``t >= start[b] - 1`` (the next-token rows from the position before
    the response on), ``fill`` elsewhere: ``x`` [B, W, ...] -> [B, width, ...]."""
    B, W = x.shape[:2]
    t = torch.arange(width)[None, :]  # [1, width]
    src = t + shift[:, None]  # [B, width]
    keep = (t >= (start[:, None] - 1)) & (src >= 0) & (src < W)
    idx = src.clamp(0, max(W - 1, 0))
    idx = idx.view(B, width, *([1] * (x.dim() - 2))).expand(B, width, *x.shape[2:])
    moved = x.gather(1, idx) if W else x.new_zeros(B, width, *x.shape[2:])
    keep = keep.view(B, width, *([1] * (x.dim() - 2)))
    return torch.where(keep, moved, torch.as_tensor(fill, dtype=x.dtype))


def _back(got, p_s: torch.Tensor, shift: torch.Tensor, width: int):
    """The teacher's scores of its rows on the student's positions (module notes)."""
    if isinstance(got, GroupedScores):  # several teachers' hidden states through their own heads: each group apart
        return GroupedScores(tuple((rows, _back(s, p_s[rows], shift[rows], width)) for rows, s in got.parts))

    def move(x, fill):
        return None if x is None else _move(x, p_s, shift, width, fill)

    topk = None if got.topk is None else TeacherTopK(move(got.topk.ids, 0), move(got.topk.logprobs, float("-inf")),
                                                     validated=got.topk.validated)
    return TeacherScores(topk, move(got.sampled_logprobs, 0.0), move(got.requested_logprobs, float("-inf")),
                         move(got.hidden, 0.0), got.head, None, move(got.mask, True), got.sums)
