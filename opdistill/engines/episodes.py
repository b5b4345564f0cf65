"""Episodes (SPEC 6.8): the student writes a turn, the environment answers, until it stops; through our keyed sampler
or the vLLM student engine.

Design notes
- Turn by turn over every live episode at once: turn 0 samples ``n`` per prompt as :func:`generate_rollouts` does
  (the same keys: a one-turn episode is the single response), and turn k > 0 continues each episode from its whole
  token prefix, keyed by (seed, step, prompt key, sample index, k) (``opdistill.engines.sampler.row_key``). A sample's
  episode therefore depends on its keys alone, not on the batch, the chunking or the rank that runs it.
- A turn ends at the student's end-of-sequence token, at ``max_new_tokens`` (the rollout's, per turn) or at the
  episode's token budget (``env.max_episode_tokens`` after the prompt). A turn that did not end at EOS ends the
  episode, ``truncated``; so does a turn without a tool call, and the ``max_turns``-th turn.
  An environment answer that would pass the budget ends the episode, truncated, without it.
- A student sharded over the ranks (``distributed.decode: sharded``) decodes in step with the other ranks: every
  rank runs a turn while any rank has a live episode, a rank with none taking part with an empty turn (its
  forwards answer the others' gathers).
- Our sampler prefills each prefix again at every turn (no KV cache is kept between turns: it would hold every live
  episode's cache across the tool calls); the cost is one prefill per turn per episode. The vLLM student engine
  (``engine``) keeps its prefix cache and stays awake from the first turn to the last, so a turn's prefill reuses
  the KV blocks of the prefix it has already seen; its sampler log-probs are vLLM's, keyed by the same keys.
- The result is a :class:`~opdistill.engines.rollout.RolloutBatch` whose ``response_mask`` is 1 on the student's
  tokens only: the environment's tokens sit in the row as context (the teacher scores the student's tokens after
  them) and out of every loss, count and metric. ``texts`` are each episode's last student turn (what the verifier
  and reward functions read); ``episode_sums`` hold the per-row counts the trainer logs as ``env/*``, and
  ``episode_results`` each row's tool results in order (what a teacher with its own chat template writes them from).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opdistill.engines.rollout import RolloutBatch, make_batch, warn_off_policy
from opdistill.engines.sampler import lockstep, sample
from opdistill.env import Environment

__all__ = ["EPISODE_SUMS", "run_episodes"]

#: the per-row counts of ``RolloutBatch.episode_sums``, in this order
EPISODE_SUMS = ("turns", "tool_calls", "bad_calls", "tool_errors", "cut_results", "used_tool", "truncated",
                "env_tokens")


@dataclass
class _Episode:
    prompt: int  # index into the call's prompts
    sample: int  # j
    tokens: list = field(default_factory=list)
    owners: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    topk: list = field(default_factory=list)
    last: list = field(default_factory=list)  # the last student turn's tokens
    results: list = field(default_factory=list)  # per environment answer in the row: its (tool name, text) pairs
    counts: dict = field(default_factory=lambda: dict.fromkeys(EPISODE_SUMS, 0))

    def add(self, ids, owner: int, logprobs=None, topk=None, width: int = 0):
        self.tokens += ids
        self.owners += [owner] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        if width:
            self.topk += topk if topk is not None else [[0] * width for _ in ids]


def run_episodes(model, tokenizer, prompts: list[list[int]], env: Environment, *, n: int = 1,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 64,
                 min_new_tokens: int = 0, greedy: bool = False, batch_size: int | None = None, seed: int | None = None,
                 step: int = 0, prompt_offset: int = 0, want_logprobs: bool = True, want_texts: bool = True,
                 want_topk: int = 0, engine=None) -> RolloutBatch:
    """``n`` episodes per prompt (``greedy``: one) in ``env``, laid out for training; the arguments are
    :func:`~opdistill.engines.rollout.generate_rollouts`' (``max_new_tokens``: per turn), the prompts already rendered
    with the tools listed (:meth:`Environment.prompt`). ``engine``: a vLLM student engine
    (``opdistill.engines.vllm.VllmEngine``) writes the turns in place of our sampler over ``model``. Module notes."""
    warn_off_policy(greedy=greedy, top_p=top_p, top_k=top_k, min_new_tokens=min_new_tokens)  # (per turn)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    eos, budget = tokenizer.eos_token_id, env.max_episode_tokens
    kw = dict(eos_id=eos, temperature=temperature, greedy=greedy, top_k=top_k, top_p=top_p,
              min_new_tokens=min_new_tokens, seed=seed, step=step)
    if engine is None:
        kw.update(pad_id=tokenizer.pad_token_id, batch_size=batch_size, want_logprobs=want_logprobs,
                  want_topk=want_topk)
    elif want_topk:
        raise ValueError("the vLLM rollout engine does not return the student's top-k ids: use rollout.engine hf")

    def draw(rows, n, max_new, keys, turn, indices=None) -> tuple[list, list, list | None]:
        """(tokens, log-probs, top-k ids) of one turn's rows, row-major in (prompt, sample)."""
        if engine is None:
            out = sample(model, rows, n=n, max_new_tokens=max_new, prompt_keys=keys, sample_indices=indices,
                         turn=turn, **kw)
            return out.tokens, out.logprobs, out.topk_ids
        tokens, lps = engine.sample(rows, n=n, max_new_tokens=max_new, prompt_keys=keys, sample_indices=indices,
                                    turn=turn, stay_awake=True, **kw)
        return tokens, lps, None

    lock = lockstep(model) if engine is None else None  # a sharded student: turns in step with the other ranks
    episodes: list[_Episode] = []
    live: list[_Episode] = []
    for turn in range(env.max_turns):
        if turn == 0:
            tokens, lps, tops = draw(prompts, n, min(max_new_tokens, budget),
                                     list(range(prompt_offset, prompt_offset + len(prompts))), 0)
            per = 1 if greedy else n
            episodes = [_Episode(r // per, r % per) for r in range(len(tokens))]  # row-major in (prompt, sample)
            live = list(episodes)
        else:
            tokens, lps, tops = draw([prompts[e.prompt] + e.tokens for e in live], 1,
                                     min(max_new_tokens, max((budget - len(e.tokens) for e in live), default=1)),
                                     [prompt_offset + e.prompt for e in live], turn, [e.sample for e in live])
        going = []
        for r, e in enumerate(live):
            room = budget - len(e.tokens)
            ids = tokens[r][:room]
            e.add(ids, 1, lps[r][:room] if want_logprobs else None, tops[r][:room] if want_topk else None,
                  want_topk)
            e.last = ids
            e.counts["turns"] += 1
            if not ids or ids[-1] != eos:  # cut by max_new_tokens or the budget: the episode ends here, truncated
                e.counts["truncated"] += 1
                continue
            if turn + 1 == env.max_turns:
                continue
            answer = env.respond(tokenizer.decode(ids, skip_special_tokens=True))
            if answer is None:  # no call: the student's answer
                continue
            for o in answer.observations:
                e.counts["tool_calls"] += 1
                e.counts["bad_calls"] += o.kind == "bad_call"
                e.counts["tool_errors"] += o.kind == "error"
                e.counts["cut_results"] += o.cut
                e.counts["used_tool"] = max(e.counts["used_tool"], int(o.kind == "ok"))
            if len(e.tokens) + len(answer.ids) >= budget:  # no room for the answer and a turn after it
                e.counts["truncated"] += 1
                continue
            e.add(answer.ids, 0, width=want_topk)
            e.results.append(tuple((o.name, o.text) for o in answer.observations))
            e.counts["env_tokens"] += len(answer.ids)
            going.append(e)
        live = going
        if not (lock.any(bool(live)) if lock is not None else live):
            break
    if engine is not None:
        engine.sleep()
    texts = [tokenizer.decode(e.last, skip_special_tokens=True) for e in episodes] if want_texts else None
    batch = make_batch([prompts[e.prompt] for e in episodes], [e.tokens for e in episodes],
                       [e.logprobs for e in episodes], [e.prompt for e in episodes], texts, tokenizer.pad_token_id,
                       [e.topk for e in episodes] if want_topk else None, owners=[e.owners for e in episodes])
    batch.episode_results = [tuple(e.results) for e in episodes]
    batch.episode_sums = torch.tensor([[float(e.counts[k]) for k in EPISODE_SUMS] for e in episodes],
                                      dtype=torch.float64).reshape(len(episodes), len(EPISODE_SUMS))
    return batch
