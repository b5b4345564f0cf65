"""Byte-prefix marginalisation (SPEC 6.6): the teacher's next-token distributions along a response in its own
tokenization -> at each student position, a distribution over the student's next token: top-K plus a residual.

Notation for one row. ``text`` is the response's bytes; the student wrote it as tokens y_0..y_{n-1} (y_i at bytes
[c_i, e_i)), the teacher's tokenizer writes it as tau_0..tau_{m-1} (tau_d at [a_d, b_d)). q_d is the teacher's
distribution over its next token before tau_d (what it returned: its top-K_T, and the exact log-prob of tau_d).
A tokenizer that puts spaces before a text (SentencePiece's "▁" prefix) gives ``lead`` extra bytes: offsets are in
the teacher's bytes ``lead * b" " + text``.

At student position i (it predicts y_i, at bytes [c, e)), the teacher's context stops before some teacher token
tau_{j0} with a_{j0} <= c (``RowText.starts``; by default the token that covers byte c; opdistill/teachers/xtok.py
backs off further where the teacher's boundary depends on the bytes that follow), and p = bytes [a_{j0}, c) is what
the teacher must write before the student's token (empty: the position is *aligned*).

1. **Match p.** The branches from q_{j0}: a teacher token that writes the rest of p and goes on past c is a *leaf*;
   the teacher's own token tau_d is *followed* (weight q_d(tau_d), then the branches of q_{d+1}) while it ends
   before e, inside p or inside y_i; any other token that ends at c or inside p would need the teacher's
   distribution after it, which is not known: it is left out (BPM's rule), like tokens that do not write p. The
   leaves' mass Z (plus the teacher's mass outside its top-K_T, not known to be left out) normalises the rest;
   Z = 1 where p is empty (nothing is left out).
2. **Map each leaf to a student token**: the bytes it writes after c, r, go to the student token whose bytes are the
   longest prefix of r (the student token the continuation starts with); none (r starts with part of a character
   the student cannot write alone, say): the residual. Special tokens are sentinel bytes (opdistill/xtok/tokens.py),
   so a special teacher token goes to the student's with the same content (end-of-sequence to end-of-sequence).
3. **The chain rule along the response.** Following the teacher's own tokens past c inside y_i (the teacher writes
   the student's token in several pieces), the bytes written so far go in front of every candidate: y_i gets the
   product q_j(tau_j) q_{j+1}(tau_{j+1}) ... of the pieces that write it, and every other branch its own product.
   Off the response the teacher's next distributions are not known: such a branch's token is mapped as it is (2).
4. The mass no student token took (unmapped, the teacher's tail outside its top-K_T) is the residual bucket; the
   student's top-K of the rest are the teacher's top-K, so a ``tail`` loss sees the residual in its "rest" bucket,
   a ``renormalized`` loss drops it, a sampled-token loss reads nu(y_i).

With the same tokenizer on both sides (and the student's own tokens as the teacher's) every position is aligned,
every token maps to itself and nothing is followed: the student's distribution is the teacher's, exactly (tested
against the same-tokenizer losses).

A position is **exact** (``xtok/exact_frac``) when c and e are both teacher boundaries: the teacher's own pieces
write y_i exactly (mode ``sampled`` reads their product). A position is **masked** (``xtok/masked_frac``) when the
mapping has nothing to give: the teacher's bytes differ from the student's there (a character the teacher's
tokenizer cannot write: its <unk>; everything after it), Z = 0, or (mode ``sampled``, or a sampled-token loss)
nu(y_i) = 0 or is not an exact product.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from opdistill.xtok.tokens import TokenBytes

__all__ = ["VocabMap", "RowText", "MappedRows", "align", "map_rows"]

_NEG = float("-inf")


class VocabMap:
    """What the mapping reads of a (student, teacher) pair of tokenizers, built once: for every teacher token tau and
    every cut k of its bytes, ``prefix[tau, k]`` (an id of bytes [0, k), -1 past its length) and ``target[tau, k]``
    (the student token whose bytes are the longest prefix of bytes [k:] of tau; -1: none; -2: k is its length, it
    ends there, unresolved). A special token's bytes are its sentinel (opdistill/xtok/tokens.py): it maps to the
    student's special token with its content, end-of-sequence to end-of-sequence."""

    def __init__(self, student: TokenBytes, teacher: TokenBytes, teacher_width: int | None = None):
        self.student, self.teacher = student, teacher
        V = max(len(teacher.table), teacher_width or 0)  # a head wider than the tokenizer: its extra ids map nowhere
        L = max((len(b) for b in teacher.table if b), default=1)
        self.max_len = L
        self.prefix_ids: dict[bytes, int] = {b"": 0}
        prefix = torch.full((V, L + 1), -1, dtype=torch.long)
        target = torch.full((V, L + 1), -1, dtype=torch.long)
        for tau, b in enumerate(teacher.table):
            if b is None:
                continue
            for k in range(len(b) + 1):
                prefix[tau, k] = self.prefix_ids.setdefault(b[:k], len(self.prefix_ids))
                target[tau, k] = student.longest_prefix(b[k:]) if k < len(b) else -2
        self.prefix, self.target = prefix, target
        # extendable[tau]: some longer teacher token starts with tau's bytes (a boundary after tau may be there only
        # because the bytes that follow do not merge with it: opdistill/teachers/xtok.py backs off from it)
        proper = {b[:k] for b in teacher.table if b for k in range(1, len(b))}
        self.extendable = [bool(b) and b in proper for b in teacher.table]

    def leaf_target(self, data: bytes, tau: int) -> int:
        """The student token the bytes ``data`` + those of teacher token ``tau`` start with (-1: none)."""
        b = self.teacher.table[tau] if 0 <= tau < len(self.teacher.table) else None
        return -1 if b is None else self.student.longest_prefix(data + b)


@dataclass
class RowText:
    """One row's response in both tokenizations: the student's ids (its sampled tokens, its end-of-sequence token
    included when it wrote one) and the teacher tokenizer's ids of the same text (its end-of-sequence token appended
    when the student's response ended with one)."""

    student_ids: list
    teacher_ids: list
    starts: list | None = None  # per student token: the teacher token its context stops before (None: the one
    #                             that covers its first byte; opdistill/teachers/xtok.py backs off where the teacher's
    #                             boundary there depends on what follows)


@dataclass
class _Aligned:
    n: int  # student tokens with known bytes (all but an id past its tokenizer)
    s_off: list  # start byte of each student token (teacher coordinates)
    s_end: list
    m: int
    t_off: list
    t_end: list
    valid: int  # the teacher's bytes agree with lead + the student's before this byte
    text: bytes  # the teacher's bytes
    lead: int


def _bytes(table, ids) -> list:
    out = []
    for i in ids:
        if i >= len(table) or table[i] is None:
            break
        out.append(table[i])
    return out


def align(vmap: VocabMap, row: RowText) -> _Aligned:
    """Byte offsets of both tokenizations of a row (teacher coordinates: ``lead`` spaces, then the response; special
    tokens write their sentinels)."""
    s_b, t_b = _bytes(vmap.student.table, row.student_ids), _bytes(vmap.teacher.table, row.teacher_ids)
    text, tt = b"".join(s_b), b"".join(t_b)
    lead = 0
    if tt != text and len(tt) > len(text) and tt.endswith(text) and not tt[: len(tt) - len(text)].strip(b" "):
        lead = len(tt) - len(text)
    ref = b" " * lead + text
    valid = 0
    for x, y in zip(tt, ref):
        if x != y:
            break
        valid += 1

    def offsets(parts, start):
        off, end, at = [], [], start
        for b in parts:
            off.append(at)
            at += len(b)
            end.append(at)
        return off, end

    s_off, s_end = offsets(s_b, lead)
    t_off, t_end = offsets(t_b, 0)
    return _Aligned(len(s_b), s_off, s_end, len(t_b), t_off, t_end, valid, tt, lead)


@dataclass
class MappedRows:
    """The teacher's signal on the student's scored positions, flattened: position n is row ``row[n]``, student
    response token ``index[n]`` (0 = the first response token). ``topk_ids`` / ``topk_logprobs`` ``[N, K]`` (student
    ids, descending; empty slots id 0 / -inf), ``sampled`` ``[N]`` (log nu(y_i); -inf: none), ``mask`` (the
    position has a signal), ``exact``, ``residual`` (the residual bucket's mass)."""

    row: torch.Tensor
    index: torch.Tensor
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    sampled: torch.Tensor
    mask: torch.Tensor
    exact: torch.Tensor
    residual: torch.Tensor


def map_rows(vmap: VocabMap, rows: list[RowText], cand_ids: list[torch.Tensor], cand_lp: list[torch.Tensor],
             path_lp: list[torch.Tensor], *, k: int | None, mode: str = "bpm") -> MappedRows:
    """The mapping of the module notes for each row. For row b, ``cand_ids[b]`` / ``cand_lp[b]`` ``[m_b, K_T]``: the
    teacher's top-K_T before each of its response tokens (row d: q_d; log-probs, -inf for empty slots), and
    ``path_lp[b]`` ``[m_b]``: its log-prob of its own token d. ``k``: the student top-K to return (None: none, a
    sampled-token loss). ``mode``: "bpm" (the mapping) or "sampled" (the teacher's log-prob of the student's token,
    a chain-rule product of its pieces, only at exact positions; the rest masked)."""
    if mode not in ("bpm", "sampled"):
        raise ValueError(f"map_rows: mode must be bpm or sampled, got {mode!r}")
    S = vmap.student
    V_S = len(S.table)
    whole = bool(cand_ids) and cand_ids[0].shape[-1] >= vmap.prefix.shape[0]  # the teacher's whole vocabulary
    pos_row, pos_idx, pos_ok, pos_exact, pos_conditioned = [], [], [], [], []
    walk = _Walk(vmap, rows, cand_ids, cand_lp, path_lp, whole)
    sampled_exact: dict[int, float] = {}
    for b, row in enumerate(rows):
        al = align(vmap, row)
        walk.aligned.append(al)
        bounds = set(al.t_off) | set(al.t_end)
        for i in range(len(row.student_ids)):
            n = len(pos_row)
            pos_row.append(b)
            pos_idx.append(i)
            if i >= al.n or al.s_end[i] > al.valid:  # the teacher's bytes differ here (or nothing is known)
                pos_ok.append(False)
                pos_exact.append(False)
                pos_conditioned.append(False)
                continue
            c, e = al.s_off[i], al.s_end[i]
            j = bisect.bisect_right(al.t_off, c) - 1  # the teacher token that covers byte c
            j0 = j if row.starts is None else row.starts[i]  # where the teacher's context stops
            if not 0 <= j0 <= j:
                raise ValueError(f"map_rows: row {b} position {i}: start {j0} is not a teacher token at or before "
                                 f"the one covering byte {c} ({j})")
            p = al.text[al.t_off[j0]:c]
            exact = al.t_off[j] == c and e in bounds  # both ends teacher boundaries: nu(y) a product of its pieces
            pos_ok.append(True)
            pos_exact.append(exact)
            pos_conditioned.append(bool(p))
            if exact:
                d_end = j
                while al.t_end[d_end] < e:
                    d_end += 1
                sampled_exact[n] = float(path_lp[b][j:d_end + 1].double().sum())
            if mode == "bpm":  # the fallback reads only the exact positions' products
                walk.start(n, b, j0, p, c, e)
    N = len(pos_row)
    ok = torch.tensor(pos_ok, dtype=torch.bool)
    exact = torch.tensor(pos_exact, dtype=torch.bool)
    z, residual, pos_e, tgt_e, mass_e = walk.run(N, torch.tensor(pos_conditioned, dtype=torch.bool))
    if mode == "bpm":
        ok &= z > 0  # nothing writes p: no signal
    zs = torch.where(z > 0, z, 1.0)
    residual = residual / zs
    ys = torch.tensor([rows[b].student_ids[i] for b, i in zip(pos_row, pos_idx)], dtype=torch.long)
    sampled = torch.full((N,), _NEG, dtype=torch.float64)
    topk_ids = torch.zeros(N, k, dtype=torch.long) if k is not None else None
    topk_lp = torch.full((N, k), _NEG, dtype=torch.float64) if k is not None else None
    if pos_e.numel():
        key = pos_e * V_S + tgt_e
        uniq, inv = torch.unique(key, return_inverse=True)
        summed = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, mass_e)
        u_pos, u_tgt = uniq // V_S, uniq % V_S
        summed = summed / zs[u_pos]
        lsum = summed.log().clamp(max=0.0)
        hit = u_tgt == ys[u_pos]
        sampled[u_pos[hit]] = lsum[hit]
        if k is not None:
            order = torch.argsort(summed, descending=True, stable=True)
            order = order[torch.argsort(u_pos[order], stable=True)]
            sp = u_pos[order]
            rank = torch.arange(sp.numel()) - torch.searchsorted(sp, sp, right=False)
            keep = rank < k
            topk_ids[sp[keep], rank[keep]] = u_tgt[order][keep]
            topk_lp[sp[keep], rank[keep]] = lsum[order][keep]
    if mode == "sampled":
        sampled = torch.full((N,), _NEG, dtype=torch.float64)
        for n, v in sampled_exact.items():
            sampled[n] = v
        ok &= exact
        topk_ids = topk_lp = None
    elif k is None:
        ok &= sampled > _NEG
    return MappedRows(torch.tensor(pos_row, dtype=torch.long), torch.tensor(pos_idx, dtype=torch.long), topk_ids,
                      topk_lp, sampled, ok, exact & ok, torch.where(ok, residual, 0.0))


class _Walk:
    """The teacher's branches from each position's start, depth by depth (module notes). A *frontier* item
    (position, row, depth d, bytes of the prefix still to match, log-weight) is stepped for all items at once over
    the teacher's candidates at d with :class:`VocabMap`'s tables: a candidate that extends the rest of the prefix
    is a leaf (mapped, or residual), one that ends at c or inside the prefix is unknown (residual), the teacher's
    own token is followed (the chain rule) while it ends before the student's token does. Once past c inside the
    student's token (a student token the teacher writes in pieces) the bytes already written are in front of every
    candidate: those *chain* items are stepped one by one. Sums: Z (the consistent mass, the normaliser where the
    position is conditioned on a prefix), the residual, and the mapped (position, student id, mass) entries."""

    def __init__(self, vmap, rows, cand_ids, cand_lp, path_lp, whole):
        self.vmap, self.rows, self.whole = vmap, rows, whole
        self.path_lp = path_lp
        self.aligned: list = []
        self.frontier: list[tuple] = []  # (n, b, d, p_rem, logw, e_rel)
        # every row's candidates at every depth with the teacher's own token appended (-inf where it is among
        # them already), stacked: row b's depth d is row offset[b] + d
        ids, lps, self.offset = [], [], []
        for b, row in enumerate(rows):
            c_ids, c_lp = cand_ids[b].long(), cand_lp[b].double()
            own = torch.tensor(row.teacher_ids[: c_ids.shape[0]], dtype=torch.long)
            seen = (c_ids == own[:, None]).any(-1)
            self.offset.append(sum(x.shape[0] for x in ids))
            ids.append(torch.cat([c_ids, own[:, None]], 1))
            lps.append(torch.cat([c_lp, torch.where(seen, _NEG, path_lp[b][: c_ids.shape[0]].double())[:, None]], 1))
        self.all_ids = torch.cat(ids) if ids else torch.zeros(0, 1, dtype=torch.long)
        self.all_lp = torch.cat(lps) if lps else torch.zeros(0, 1, dtype=torch.float64)
        self.chain: list[tuple] = []  # (n, b, d, written, logw, e_rel)
        t = vmap.teacher.table
        self.tlen = torch.tensor([len(x) if x else 0 for x in t] + [0] * (vmap.prefix.shape[0] - len(t)))

    def start(self, n, b, j0, p, c, e) -> None:
        # e_rel: the bytes from the start of the prefix to the end of the student's token
        self.frontier.append((n, b, j0, p, 0.0, len(p) + (e - c)))

    def _candidates(self, b, d):
        return self.all_ids[self.offset[b] + d], self.all_lp[self.offset[b] + d]

    def run(self, N, conditioned):
        z = torch.zeros(N, dtype=torch.float64)
        residual = torch.zeros(N, dtype=torch.float64)
        pos, tgt, mass = [], [], []
        while self.frontier:
            items, self.frontier = self.frontier, []
            self._step(items, z, residual, pos, tgt, mass)
        for item in self.chain:
            self._chain(item, z, residual, pos, tgt, mass)
        z = torch.where(conditioned, z, 1.0)  # an aligned start conditions on nothing: Z = 1 exactly
        if pos:
            return z, residual, torch.cat(pos), torch.cat(tgt).long(), torch.cat(mass)
        empty = torch.zeros(0, dtype=torch.long)
        return z, residual, empty, empty, torch.zeros(0, dtype=torch.float64)

    def _step(self, items, z, residual, pos, tgt, mass) -> None:
        vm, L = self.vmap, self.vmap.max_len
        at = torch.tensor([self.offset[b] + d for _, b, d, *_ in items])
        cid, clp = self.all_ids[at], self.all_lp[at]
        n_t = torch.tensor([it[0] for it in items])
        kk = torch.tensor([len(it[3]) for it in items])
        pid = torch.tensor([vm.prefix_ids.get(it[3], -3) if len(it[3]) <= L else -3 for it in items])
        logw = torch.tensor([it[4] for it in items], dtype=torch.float64)
        own = cid[:, -1]
        al = [self.aligned[b] for _, b, *_ in items]
        # the teacher's own token ends before the student's token does: followed, not mapped (e_rel: the bytes from
        # the start of depth d to the end of the student's token)
        follow = torch.tensor([a.t_end[d] - a.t_off[d] < e_rel for a, (_, _, d, _, _, e_rel) in zip(al, items)])
        kc = kk.clamp(max=L)[:, None].expand_as(cid)
        tl = self.tlen[cid]
        ext = (vm.prefix[cid, kc] == pid[:, None]) & (kk[:, None] <= L)  # extends the rest of the prefix (or is it)
        longer = ext & (tl > kk[:, None])  # writes the rest of the prefix and goes on past c: a leaf
        # a candidate that ends at c or inside the prefix (other than the teacher's own token, followed) would need
        # the teacher's next distribution after it, which is not known: left out of the conditioning, as BPM does
        followed = (cid == own[:, None]) & follow[:, None]
        w = (logw[:, None] + clp).exp()
        target = vm.target[cid, kc]
        leaf = longer & ~followed & (w > 0)
        mapped = leaf & (target >= 0)
        unknown = leaf & (target < 0)  # writes bytes no student token starts: the residual
        tail = torch.zeros(len(items), dtype=torch.float64) if self.whole else \
            logw.exp() * (1.0 - clp.exp().sum(-1)).clamp(min=0.0)
        z.index_add_(0, n_t, (w * leaf).sum(-1) + tail)
        residual.index_add_(0, n_t, (w * unknown).sum(-1) + tail)
        r, col = mapped.nonzero(as_tuple=True)
        pos.append(n_t[r])
        tgt.append(target[r, col])
        mass.append(w[r, col])
        for row in follow.nonzero().flatten().tolist():
            n, b, d, p_rem, lw, e_rel = items[row]
            a = al[row]
            tok = a.text[a.t_off[d]:a.t_end[d]]
            lw = lw + float(self.path_lp[b][d])
            if len(tok) <= len(p_rem):  # still inside the prefix: the rest of it is matched from d + 1
                self.frontier.append((n, b, d + 1, p_rem[len(tok):], lw, e_rel - len(tok)))
            else:  # past c, inside the student's token: its bytes so far go in front of every candidate
                self.chain.append((n, b, d + 1, tok[len(p_rem):], lw, e_rel - len(tok)))

    def _chain(self, item, z, residual, pos, tgt, mass) -> None:
        n, b, d, written, lw, e_rel = item
        vm, a = self.vmap, self.aligned[item[1]]
        while True:
            ids, lps = self._candidates(b, d)
            own = self.rows[b].teacher_ids[d]
            own_len = a.t_end[d] - a.t_off[d]
            follow = own_len < e_rel
            total = 0.0
            for tau, lp in zip(ids.tolist(), lps.tolist()):
                if lp == _NEG:
                    continue
                total += math.exp(lp)
                if tau == own and follow:
                    continue
                m = math.exp(lw + lp)
                s = vm.leaf_target(written, tau)
                z[n] += m
                if s >= 0:
                    pos.append(torch.tensor([n]))
                    tgt.append(torch.tensor([s]))
                    mass.append(torch.tensor([m], dtype=torch.float64))
                else:
                    residual[n] += m
            if not self.whole:
                t = math.exp(lw) * max(0.0, 1.0 - total)
                z[n] += t
                residual[n] += t
            if not follow:
                return
            written += a.text[a.t_off[d]:a.t_end[d]]
            lw += float(self.path_lp[b][d])
            e_rel -= own_len
            d += 1
