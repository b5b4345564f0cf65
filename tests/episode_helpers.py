"""A character-level tokenizer whose chat template lists tools and writes tool messages, a tiny model over it, and
tools: what the episode tests (SPEC 6.8) run on."""
from __future__ import annotations

import string

from opdistill.models import build_tiny_llama, char_tokenizer

# user turn "U:", assistant turn "A:" closed by EOS, tool message "T:", the tools listed with the call format
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}. Call as "
    "<tool_call>{\"name\": N, \"arguments\": {...}}</tool_call>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}U:{{ m.content }}\n"
    "{% elif m.role == 'assistant' %}A:{{ m.content }}{{ eos_token }}\n"
    "{% elif m.role == 'tool' %}T:{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}")

CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")


def tool_tokenizer(template: str = TOOL_TEMPLATE):
    return char_tokenizer(CHARS, chat_template=template)


def tiny_model(tok, seed: int = 0, **kw):
    return build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=512, seed=seed,
                            **kw)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def echo(text: str) -> str:
    """Say it back."""
    return text


def call(name: str, **arguments) -> str:
    """The text of a call in the default format."""
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def scripted_episode(env, tok, prompt: str, turns: list[str]) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, episode ids after the prompt, owners) of an episode whose student turns are ``turns`` (each closed
    by EOS), the environment answering every turn but the last, laid out exactly as the runner lays it out."""
    p = env.prompt(prompt)
    ids, owners = [], []
    for k, text in enumerate(turns):
        t = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids += t
        owners += [1] * len(t)
        if k + 1 < len(turns):
            answer = env.respond(text)
            ids += answer.ids
            owners += [0] * len(answer.ids)
    return p, ids, owners


def memorize(model, tok, episodes, *, steps: int = 300, lr: float = 1e-2, seed: int = 0):
    """Train ``model`` on ``episodes`` ((prompt, ids, owners) triples) by cross-entropy on the student's tokens until
    it writes them greedily (a model that calls tools, for the tests)."""
    import torch

    torch.manual_seed(seed)
    S = max(len(p) + len(i) for p, i, _ in episodes)
    x = torch.full((len(episodes), S), tok.pad_token_id)
    m = torch.zeros(len(episodes), S)
    for b, (p, i, o) in enumerate(episodes):
        x[b, :len(p) + len(i)] = torch.tensor(p + i)
        m[b, len(p):len(p) + len(i)] = torch.tensor(o, dtype=torch.float)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        logits = model(x, attention_mask=(m > 0) | (x != tok.pad_token_id)).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        loss = (loss * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def sharded_episodes(rank: int, world: int, out_dir: str) -> None:
    """(tests/parallel_launch.py) The tool-calling student saved in ``out_dir/student``, FSDP2-sharded over the ranks,
    runs one greedy episode per rank: rank 0's calls a tool (two turns), rank 1's answers at once (one turn), so rank
    1 must take part in rank 0's second turn with an empty one. Each rank writes its row."""
    import json
    from pathlib import Path

    from torch.distributed.fsdp import fully_shard

    from opdistill.engines.episodes import run_episodes
    from opdistill.env import Environment, Tools
    from opdistill.models import load_model

    tok = tool_tokenizer()
    model = load_model(str(Path(out_dir) / "student"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    env = Environment(Tools([add, echo]), tok, max_turns=3, max_episode_tokens=120)
    prompt = ["2+3", "hi"][rank]
    ro = run_episodes(model, tok, [env.prompt(prompt)], env, greedy=True, max_new_tokens=80)
    n = int(ro.attention_mask[0].sum())
    (Path(out_dir) / f"episode_rank{rank}.json").write_text(json.dumps(
        {"ids": ro.input_ids[0, :n].tolist(), "mask": ro.response_mask[0, :n].tolist(),
         "sums": ro.episode_sums[0].tolist()}))
