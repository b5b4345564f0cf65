"""The teacher model in this process: :func:`score_teacher` (no grad, chunked) and :class:`LocalTeacher`.

Design notes
- The teacher runs its backbone once per row chunk; the lm_head is applied chunk by chunk over the scored positions
  and each chunk's logits are reduced to what the request asks (top-k ids + log-probs, the log-prob of the next
  token, log-probs at requested ids) before the next chunk is computed. So no ``[batch, seq, vocab]`` buffer is ever
  kept, only one ``[chunk_tokens, vocab]`` block at a time.
- The logits are the model's own, transform included (``opdistill.fused.read_lm_head``: Cohere/Granite/Falcon-H1
  logit multipliers, Gemma 2 soft-capping); a head the reader does not know is refused. At ``temperature`` != 1 they
  are divided by it before the log-softmax.
- Row t holds the teacher distribution of token t+1, the same next-token layout as the student.
- The teacher server (``opdistill serve-teacher --engine hf``) scores through this same class, so a request scored
  alone gets the in-process numbers bit for bit.
"""
from __future__ import annotations

import torch

from opdistill.fused import backbone_of, no_cache_kwargs, read_lm_head
from opdistill.loss import TeacherScores, TeacherTopK
from opdistill.ops.checks import check_mask
from opdistill.teachers.base import Rows, ScoreRequest, Teacher

__all__ = ["score_teacher", "LocalTeacher"]


@torch.no_grad()
def score_teacher(teacher, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, k: int | None = None,
                  sampled_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                  requested_ids: torch.Tensor | None = None, temperature: float = 1.0, hidden: bool = False,
                  row_chunk: int = 64, token_chunk: int = 2048) -> TeacherScores:
    """Teacher top-k (``k``), sampled-token (``sampled_ids`` [B, S], usually the next-token targets) and/or requested-id
    (``requested_ids`` [B, S, J]) log-probs of a transformers causal LM ``teacher``, at ``temperature``; and/or its
    final hidden states (``hidden``: ``[B, S, H]`` in the model's dtype, 0 where not scored; the head is not run for
    them, so a request for hidden states alone costs the backbone only).

    ``positions`` [B, S] (bool or 0/1; usually the next-token response mask ``shift_for_next_token(...)[1]``): apply
    the lm_head only there. The backbone still runs over every position (attention needs them), but the
    ``[tokens, vocab]`` head GEMM, log-sum-exp and top-k cover only the rows the loss reads, and the results there are
    the full-layout scorer's exactly. Positions outside it are not computed: top-k rows there are empty slots (id 0,
    log-prob -inf: zero mass, what the loss turns masked rows into anyway), sampled log-probs 0, requested -inf.
    Without ``positions`` every position is scored. Results are written into the ``[B, S, ...]`` outputs through
    contiguous views of the flattened layout (or, with ``positions``, one copy of the scored rows), never by per-chunk
    advanced indexing of the whole layout.

    Slot order: for ``k < V`` the slots hold the top-k in descending log-prob order (``topk``). For ``k = V`` (the
    whole vocabulary) slot ``j`` holds token ``j`` (ids ``0..V-1`` in vocabulary order; no ``topk``, which would be a
    full sort of every row): the same (id, log-prob) pairs bit for bit, in another order. Nothing reads the slot
    order (the losses, the overlap diagnostics, the cache and the server treat the K slots as a set)."""
    if k is None and sampled_ids is None and requested_ids is None and not hidden:
        raise ValueError("score_teacher: ask for top-k (k=...), sampled-token scores (sampled_ids=...), requested "
                         "ids (requested_ids=...) or hidden states (hidden=True)")
    B, S = input_ids.shape
    head = read_lm_head(teacher)
    V = head.weight.shape[0]
    if k is not None and not 1 <= k <= V:
        raise ValueError(f"k: expected 1 <= k <= vocab size {V}, got {k}")
    if requested_ids is not None and (requested_ids.dim() != 3 or tuple(requested_ids.shape[:2]) != (B, S)):
        raise ValueError(f"requested_ids: expected shape [{B}, {S}, J], got {list(requested_ids.shape)}")
    sel = None
    if positions is not None:
        if tuple(positions.shape) != (B, S):
            raise ValueError(f"positions: expected shape {(B, S)} (the shape of input_ids), got {tuple(positions.shape)}")
        sel = check_mask(positions, "positions").reshape(-1).cpu()
    backbone = backbone_of(teacher)
    no_cache = no_cache_kwargs(teacher)  # one forward: a KV cache would only be built and thrown away
    dev = teacher.device
    # Rows scored: every position of the flattened layout, or only those of ``positions`` (in layout order).
    n = B * S if sel is None else int(sel.sum())
    whole = k is not None and k == V  # every id: slot j = token j, no top-k (a full sort of each row)
    out_ids = torch.zeros(n, k, dtype=torch.long) if k and not whole else None
    out_lp = torch.zeros(n, k, dtype=torch.float32) if k else None
    out_samp = torch.zeros(n, dtype=torch.float32) if sampled_ids is not None else None
    J = 0 if requested_ids is None else requested_ids.shape[2]
    out_req = torch.zeros(n, J, dtype=torch.float32) if requested_ids is not None else None
    out_hidden = None  # [n, H], allocated at the first chunk (the backbone's width and dtype)
    flat_targets = sampled_ids.reshape(-1) if sampled_ids is not None else None
    flat_req = requested_ids.reshape(B * S, J) if requested_ids is not None else None
    was_training = teacher.training
    # eval() walks every module: skip it (and the restore) when nothing is in training mode (a frozen teacher)
    switch = any(m.training for m in teacher.modules())
    if switch:
        teacher.eval()
    try:
        done = 0  # rows of out_* written so far
        for r0 in range(0, B, row_chunk):
            ids = input_ids[r0 : r0 + row_chunk].to(dev)
            am = attention_mask[r0 : r0 + row_chunk].to(dev)
            b = ids.shape[0]
            lo, hi = r0 * S, (r0 + b) * S  # this row chunk in the flattened layout
            if sel is not None and not bool(sel[lo:hi].any()):
                continue
            states = backbone(input_ids=ids, attention_mask=am, **no_cache).last_hidden_state  # [b, S, H]
            flat = states.reshape(b * S, -1)
            tgt_rows = flat_targets[lo:hi] if flat_targets is not None else None
            req_rows = flat_req[lo:hi] if flat_req is not None else None
            if sel is not None:
                keep = sel[lo:hi]
                flat = flat[keep.to(flat.device)]  # [n_chunk, H]: only the positions scored
                tgt_rows = tgt_rows[keep] if tgt_rows is not None else None
                req_rows = req_rows[keep] if req_rows is not None else None
            if hidden:
                if out_hidden is None:
                    out_hidden = torch.zeros(n, flat.shape[1], dtype=flat.dtype)
                out_hidden[done : done + flat.shape[0]] = flat.cpu()
            if k is None and out_samp is None and out_req is None:  # hidden states alone: no head GEMM
                done += flat.shape[0]
                continue
            for t0 in range(0, flat.shape[0], token_chunk):
                z = head.logits(flat[t0 : t0 + token_chunk])  # [c, V] fp32: the only vocab-wide buffer
                if temperature != 1.0:
                    z = z / temperature
                c = z.shape[0]
                lse = torch.logsumexp(z, dim=-1, keepdim=True)
                at = slice(done + t0, done + t0 + c)
                if whole:
                    out_lp[at] = (z - lse).cpu()
                elif k:
                    v, i = z.topk(k, dim=-1)
                    out_ids[at] = i.cpu()
                    out_lp[at] = (v - lse).cpu()
                if out_samp is not None:
                    tgt = tgt_rows[t0 : t0 + c].to(dev)
                    out_samp[at] = (z.gather(-1, tgt[:, None]) - lse).squeeze(-1).cpu()
                if out_req is not None:
                    out_req[at] = (z.gather(-1, req_rows[t0 : t0 + c].to(dev)) - lse).cpu()
            done += flat.shape[0]
    finally:
        if switch:
            teacher.train(was_training)
    if hidden and out_hidden is None:  # nothing scored: no width seen; the backbone's config says it
        out_hidden = torch.zeros(n, backbone.config.hidden_size, dtype=head.weight.dtype)
    return _layout(B, S, k, V, whole, sel, out_ids, out_lp, out_samp, out_req, out_hidden, head if hidden else None)


def _layout(B, S, k, V, whole, sel, out_ids, out_lp, out_samp, out_req, out_hidden=None, head=None) -> TeacherScores:
    """The scored rows in the ``[B, S, ...]`` layout (views when every position was scored)."""
    vocab = torch.arange(V) if whole else None
    J = None if out_req is None else out_req.shape[1]
    hid = None
    if sel is None:  # the flattened layout itself: views, no copy
        top_ids = (vocab.expand(B * S, V).contiguous() if whole else out_ids).view(B, S, k) if k else None
        top_lp = out_lp.view(B, S, k) if k else None
        samp = out_samp.view(B, S) if out_samp is not None else None
        req = out_req.view(B, S, J) if out_req is not None else None
        hid = out_hidden.view(B, S, -1) if out_hidden is not None else None
    else:
        top_ids = top_lp = samp = req = None
        if out_hidden is not None:
            hid = torch.zeros(B * S, out_hidden.shape[1], dtype=out_hidden.dtype)
            hid[sel] = out_hidden
            hid = hid.view(B, S, -1)
        if k:
            top_lp = torch.full((B * S, k), float("-inf"), dtype=torch.float32)
            top_lp[sel] = out_lp
            if whole:  # unscored rows: empty slots with id 0, as for k < V
                top_ids = torch.where(sel[:, None], vocab, 0)
            else:
                top_ids = torch.zeros(B * S, k, dtype=torch.long)
                top_ids[sel] = out_ids
            top_ids, top_lp = top_ids.view(B, S, k), top_lp.view(B, S, k)
        if out_samp is not None:
            samp = torch.zeros(B * S, dtype=torch.float32)
            samp[sel] = out_samp
            samp = samp.view(B, S)
        if out_req is not None:
            req = torch.full((B * S, J), float("-inf"), dtype=torch.float32)
            req[sel] = out_req
            req = req.view(B, S, J)
    topk = TeacherTopK(top_ids, top_lp, validated=True) if k else None  # our own scores
    return TeacherScores(topk, samp, req, hid, head)


class LocalTeacher(Teacher):
    """A transformers causal LM in this process (``model.teacher``, a ``teachers`` entry with a path, the LoRA
    student's base): every request, any temperature, requested ids, on the scored positions only."""

    def __init__(self, model, *, key: str = "model.teacher", row_chunk: int = 64, token_chunk: int = 2048):
        self.model, self.key = model, key
        self.row_chunk, self.token_chunk = row_chunk, token_chunk

    @property
    def head(self):
        """The model's lm_head as ``read_lm_head`` reads it (what turns its hidden states into its logits)."""
        return read_lm_head(self.model)

    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        return score_teacher(self.model, rows.input_ids, rows.attention_mask, k=request.k,
                             sampled_ids=rows.targets() if request.sampled else None, positions=rows.scored(),
                             requested_ids=request.requested_ids, temperature=request.temperature,
                             hidden=request.hidden, row_chunk=self.row_chunk, token_chunk=self.token_chunk)
