"""Tiny models and configs for the trainer tests (random init, built from a config; no download)."""
from __future__ import annotations

from pathlib import Path

from opdistill.data import CARRY_ADD_CHARS
from opdistill.models import build_tiny_gemma3, build_tiny_llama, char_tokenizer


def make_model_dir(path: Path, *, hidden=32, layers=1, seed=0, chars=CARRY_ADD_CHARS, chat_template=None,
                   arch: str = "llama") -> str:
    """A tiny random model on the character tokenizer in folder ``path``: ``arch`` llama, or gemma3 (Gemma 3's
    architecture: scaled tied embeddings, q/k norms, a sliding window of 8 positions on every other layer)."""
    tok = char_tokenizer(chars, chat_template=chat_template)
    if arch == "gemma3":
        model = build_tiny_gemma3(tok, hidden_size=hidden, num_layers=max(layers, 2), seed=seed)
    else:
        model = build_tiny_llama(tok, hidden_size=hidden, num_layers=layers, num_heads=2, seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


def make_bpe_model_dir(path: Path, *, vocab_size=290, hidden=32, layers=2, seed=4) -> str:
    """A tiny Llama on a byte-level BPE tokenizer trained on carry_add text (1-2 digits): a teacher whose tokenizer
    differs from the character-level student's (cross-tokenizer tests, SPEC 6.6)."""
    import random

    from opdistill.data import CarryAdditionTask
    from opdistill.models import bpe_tokenizer

    if not path.exists():
        rng = random.Random(0)
        task = CarryAdditionTask(min_digits=1, max_digits=2)
        corpus = [x for _ in range(300) for p in [task.sample(rng)] for x in (p.prompt, p.solution)]
        tok = bpe_tokenizer(corpus, vocab_size=vocab_size)
        model = build_tiny_llama(tok, hidden_size=hidden, num_layers=layers, num_heads=2, seed=seed)
        model.save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
    return str(path)


def tiny_config_dict(tmp: Path, *, method="on_policy", steps=3, **sections) -> dict:
    teacher = make_model_dir(tmp / "teacher", hidden=32, layers=2, seed=1) if not (tmp / "teacher").exists() else str(tmp / "teacher")
    student = make_model_dir(tmp / "student", hidden=16, layers=1, seed=2) if not (tmp / "student").exists() else str(tmp / "student")
    cfg = {
        "run_dir": str(tmp / "run"),
        "model": {"student": student, "teacher": teacher},
        "data": {"task": "carry_add", "task_args": {"min_digits": 1, "max_digits": 2}, "prompts_per_step": 3},
        "rollout": {"n": 2, "max_new_tokens": 12},
        "loss": {"loss_mode": "topk", "support": "tail", "divergence": "forward", "topk": 4},
        "optim": {"lr": 1e-2, "warmup_steps": 1},
        "train": {"method": method, "steps": steps, "seed": 0, "threads": 1, "micro_batch_tokens": 40},
        "eval": {"every": 0, "num_prompts": 4, "batch_size": 4},
        "checkpoint": {"every": 1, "keep_last": 2},
        "log": {"tensorboard": False, "progress": False},
    }
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    return cfg
