"""Tasks and prompt sources: the demo task's worked solutions and verifier, files via `datasets`, gsm_symbolic."""
import json
import random

import pytest

from opdistill.data import CarryAdditionTask, DatasetTask, GsmSymbolicTask, PromptSource, render_prompt
from opdistill.data.tasks import CARRY_ADD_CHARS
from opdistill.models import char_tokenizer


def test_carry_add_solution_is_a_correct_worked_sum():
    assert CarryAdditionTask.worked_solution(4721, 3896) == "1+6+0=7,2+9+0=11,7+8+1=16,4+3+1=8>8617"
    assert CarryAdditionTask.worked_solution(999, 1) == "9+1+0=10,9+0+1=10,9+0+1=10>1000"
    task = CarryAdditionTask(3, 5)
    rng = random.Random(0)
    for _ in range(200):
        p = task.sample(rng)
        a, b = map(int, p.prompt[:-1].split("+"))
        assert p.answer == str(a + b) and task.score(p, p.solution) == 1.0
        assert set(p.solution) <= set(CARRY_ADD_CHARS)
        # only the final sum is graded
        assert task.score(p, p.solution.rsplit(">", 1)[0] + ">" + str(a + b + 1)) == 0.0
        assert task.score(p, p.solution.replace(">", "")) == 0.0
    with pytest.raises(ValueError, match="min_digits"):
        CarryAdditionTask(4, 3)


def test_prompt_source_is_a_function_of_seed_and_step():
    task = CarryAdditionTask()
    a, b = PromptSource(task, 0), PromptSource(task, 0)
    assert a.batch(7, 5) == b.batch(7, 5) and a.batch(7, 5) != a.batch(8, 5)
    assert PromptSource(task, 1).held_out(10) == a.held_out(10)  # held-out set keyed by eval_seed only
    assert PromptSource(task, 0, eval_seed=1).held_out(10) != a.held_out(10)


def test_chat_template_rendering():
    tok = char_tokenizer(CARRY_ADD_CHARS)
    assert render_prompt(tok, "12+3=") == [tok.bos_token_id] + tok("12+3=", add_special_tokens=False)["input_ids"]


def test_dataset_task_from_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "gold": str(i)}) + "\n" for i in range(5)))
    t = DatasetTask(str(path), prompt_field="question", answer_field="gold")
    p = t.sample(random.Random(0))
    assert p.prompt.startswith("q") and t.score(p, f"so it is {p.answer}") == 1.0
    with pytest.raises(ValueError, match=r"data\.prompt_field: 'prompt' is not a column"):
        DatasetTask(str(path))


def test_gsm_symbolic_task():
    task = GsmSymbolicTask(size=20, seed=0)
    p = task.sample(random.Random(0))
    assert "The answer is" in p.prompt and p.answer
    assert task.score(p, f"... The answer is {p.answer}.") == 1.0
    assert task.score(p, "The answer is 123456789.") == 0.0 or p.answer == "123456789"
    assert task.score(p, "no number") == 0.0
