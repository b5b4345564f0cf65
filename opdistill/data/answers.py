"""Answer checking for dataset rows: a math-aware extractor (``####``, ``\\boxed{}``, last number) and the match modes
of ``data.answer_match``.

``math`` (the default): the final answer is taken from the text after the last ``####`` (GSM8K's reference format),
else the content of the last ``\\boxed{...}`` (nested braces allowed), else the last number; the same extraction runs
on the reference answer (so a GSM8K ``answer`` column holding the worked solution and ``#### 72`` works as is). Two
answers that both read as numbers (commas, ``$`` and ``%`` dropped) match when they are equal within 1e-6 relative;
otherwise they match when equal after whitespace is collapsed and a trailing period dropped. A completion with no
marker and no number answers with its last line (``Paris`` answers ``Paris``), and a completion written exactly as
the reference (or its extracted answer) is written, up to whitespace and a trailing period, always matches: no mode
scores a reference against itself 0 (tests/test_data_ecosystem.py, a property test over every mode).
``exact``: the completion, stripped, equals the reference, stripped. ``contains``: the reference, stripped, occurs in
the completion (the old substring test: ``1`` is found in ``10``, so it over-counts).
"""
from __future__ import annotations

import re

__all__ = ["ANSWER_MATCH", "extract_answer", "match_answer"]

ANSWER_MATCH = ("math", "exact", "contains")
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no answer


def extract_answer(text: str) -> str | None:
    """The final answer of ``text``: after the last ``####``, else the last ``\\boxed{}``, else the last number;
    None when there is none."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _number(s: str) -> float | None:
    t = s.strip().rstrip(".").replace(",", "").replace("$", "").replace("%", "").strip()
    try:
        return float(t)
    except ValueError:
        return None


def _norm(s: str) -> str:
    return " ".join(s.split()).rstrip(".")


def match_answer(reference: str, completion: str, mode: str = "math") -> float:
    """1.0 when ``completion`` answers ``reference`` under ``mode`` (one of :data:`ANSWER_MATCH`), else 0.0."""
    if mode == "exact":
        return float(completion.strip() == reference.strip())
    if mode == "contains":
        return float(reference.strip() in completion)
    if mode != "math":
        raise ValueError(f"data.answer_match: expected one of {list(ANSWER_MATCH)}, got {mode!r}")
    written = _norm(completion)
    if written == _norm(reference):
        return 1.0  # the answer written as the reference writes it (a bare word, a phrase with a number in it)
    gold = extract_answer(reference) if ("####" in reference or "\\boxed{" in reference) else reference.strip()
    if gold is None:
        return 0.0
    if written == _norm(gold):
        return 1.0
    pred = extract_answer(completion)
    if pred is None:  # no marker and no number: the completion's last line is its answer
        lines = [line for line in completion.splitlines() if line.strip()]
        pred = lines[-1].strip() if lines else None
    if pred is None:
        return 0.0
    a, b = _number(gold), _number(pred)
    if a is not None and b is not None:
        return float(abs(a - b) <= 1e-6 * max(1.0, abs(a)))
    if a is not None:  # a numeric reference and a non-numeric completion answer
        return 0.0
    return float(_norm(gold) == _norm(pred))
