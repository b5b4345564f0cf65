"""TRL-style conversational rows (``{"messages": [..., {"role": "assistant", ...}]}``): with
``data.final_assistant: answer`` the last assistant turn is the reference answer and everything before it the
prompt; without it such rows are refused with a message that names the setting."""
import json

import pytest
import yaml

from opdistill.cli import main
from opdistill.data import DatasetTask, PromptSource
from opdistill.errors import ConfigError, DataError
from opdistill.runs.files import read_metrics
from opdistill.train import load_config
from tests.test_data_ecosystem import CHAT
from tests.trainer_helpers import make_model_dir

SYSTEM = {"role": "system", "content": "answer after ####"}


def _conversation(i: int) -> dict:
    return {"messages": [SYSTEM, {"role": "user", "content": f"what is {i}"},
                         {"role": "assistant", "content": f"#### {i}"}]}


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_final_assistant_turn_is_the_answer_and_the_rest_the_prompt(tmp_path):
    path = _write(tmp_path / "chat.jsonl", [_conversation(i) for i in range(6)])
    t = DatasetTask(path, "messages", final_assistant="answer", eval_fraction=0.5)
    rows = t.rows + t.eval_rows
    assert sorted(r.answer for r in rows) == [f"#### {i}" for i in range(6)]
    for r in rows:
        i = r.answer.split()[-1]
        assert r.prompt == [SYSTEM, {"role": "user", "content": f"what is {i}"}]  # the answer is not in the prompt
    assert t.has_answers
    assert t.score(rows[0], f"so {rows[0].answer}") == 1.0 and t.score(rows[0], "#### 99") == 0.0
    assert PromptSource(t, 0).held_out(10) == t.held_out(10, 0)  # held out like any other dataset row


def test_rows_that_do_not_fit_the_choice_are_refused_by_file_and_line(tmp_path):
    trl = _write(tmp_path / "trl.jsonl", [_conversation(0), _conversation(1)])
    with pytest.raises(DataError) as e:
        DatasetTask(trl, "messages")
    assert str(e.value) == (
        f"{trl}:1: 'messages' ends with an assistant message; a prompt ends with the turn the model answers (set "
        f"data.final_assistant: answer to take that turn as the reference answer, as in TRL's conversational "
        f"datasets; or drop it, or put it in data.answer_field)")
    with pytest.raises(ConfigError) as e:
        DatasetTask(trl)  # the default prompt_field: the hint names the two settings
    assert str(e.value) == (
        f"data.prompt_field: 'prompt' is not a column of {trl} (columns: ['messages']); chat rows in TRL's "
        f"conversational format: data.prompt_field: messages, and data.final_assistant: answer when they end with "
        f"the assistant's answer")
    open_ended = _write(tmp_path / "open.jsonl", [_conversation(0), {"messages": [SYSTEM, {"role": "user",
                                                                                           "content": "hi"}]}])
    with pytest.raises(DataError) as e:
        DatasetTask(open_ended, "messages", final_assistant="answer")
    assert str(e.value) == (f"{open_ended}:2: 'messages' does not end with an assistant message after the prompt "
                            f"(data.final_assistant: answer takes the reference answer from that last turn)")
    plain = _write(tmp_path / "plain.jsonl", [{"messages": "what is 1"}])
    with pytest.raises(DataError) as e:
        DatasetTask(plain, "messages", final_assistant="answer")
    assert str(e.value) == (f"{plain}:1: 'messages' is a str, expected a list of {{role, content}} messages ending "
                            f"with the assistant's answer (data.final_assistant: answer)")
    base = {"model": {"student": "s", "teacher": "t"}, "loss": {"topk": 4},
            "data": {"task": "dataset", "path": trl, "prompt_field": "messages", "final_assistant": "answer"}}
    assert load_config(base=base).data.final_assistant == "answer"
    with pytest.raises(ConfigError) as e:
        load_config(base=base, overrides=["data.answer_field=answer"])
    assert str(e.value) == ("data.answer_field: expected null with data.final_assistant 'answer' (the answer is the "
                            "final assistant turn of data.prompt_field), got 'answer'")
    rl = load_config(base=base, overrides=["train.method=rl", "model.teacher=null"])  # the verifier reads the turn
    assert rl.train.method == "rl"


def test_a_trl_conversational_file_trains_with_one_setting(tmp_path):
    chars = "abcdefghijklmnopqrstuvwxyz[]0123456789 ?#"
    make_model_dir(tmp_path / "teacher", hidden=32, layers=2, seed=1, chars=chars, chat_template=CHAT)
    make_model_dir(tmp_path / "student", hidden=16, layers=1, seed=2, chars=chars, chat_template=CHAT)
    cfg = {"run_dir": str(tmp_path / "run"),
           "model": {"student": str(tmp_path / "student"), "teacher": str(tmp_path / "teacher")},
           "data": {"task": "dataset", "path": _write(tmp_path / "trl.jsonl", [_conversation(i) for i in range(12)]),
                    "prompt_field": "messages", "final_assistant": "answer", "eval_fraction": 0.25,
                    "prompts_per_step": 3},
           "rollout": {"n": 2, "max_new_tokens": 6}, "loss": {"loss_mode": "topk", "topk": 4},
           "train": {"steps": 2, "threads": 1, "micro_batch_tokens": 200},
           "eval": {"every": 0, "num_prompts": 3, "batch_size": 8}, "log": {"tensorboard": False, "progress": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--json"]) == 0
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "distillation/loss" in r] == [1, 2]
    final = [r for r in rows if "eval/greedy_acc" in r][-1]
    assert final["eval/greedy_acc"] == final["eval/greedy_acc"]  # a number (the verifier has answers), not NaN
