"""Issue 15 data: true held-out sets (eval file / split / fraction), chat-format prompts, hub datasets offline,
reasoning-gym tasks by name, and the math-aware answer check."""
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opdistill.data import DatasetTask, PromptSource, ReasoningGymTask, extract_answer, make_task, match_answer
from opdistill.data.answers import ANSWER_MATCH
from opdistill.data.prompts import render_prompt, split_held_out
from opdistill.errors import ConfigError, DataError
from opdistill.models import char_tokenizer
from opdistill.train.run.config import load_config


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_eval_fraction_split_has_no_overlap_and_is_deterministic(tmp_path):
    rows = [{"prompt": f"q{i % 37}", "answer": str(i)} for i in range(100)]  # duplicates: q0..q36 repeat
    path = _write(tmp_path / "d.jsonl", rows)
    t = DatasetTask(path, answer_field="answer", eval_fraction=0.25)
    train = {p.prompt for p in t.rows}
    held = {p.prompt for p in t.eval_rows}
    assert train and held and not train & held  # a duplicated prompt is never on both sides
    assert train | held == {f"q{i}" for i in range(37)}
    assert len(held) == 10  # ceil(0.25 * 37) distinct prompts
    assert len(t.rows) + len(t.eval_rows) == 100
    # the same split whatever the row order
    random.Random(3).shuffle(rows)
    t2 = DatasetTask(_write(tmp_path / "e.jsonl", rows), answer_field="answer", eval_fraction=0.25)
    assert {p.prompt for p in t2.eval_rows} == held
    # training draws never meet the held-out set; evaluation is the held-out rows, none repeated
    src = PromptSource(t, seed=0)
    drawn = {p.prompt for s in range(1, 200) for p in src.batch(s, 8)}
    assert not drawn & held
    ev = src.held_out(1000)
    assert len(ev) == len(t.eval_rows) and {p.prompt for p in ev} == held
    assert src.held_out(5) == PromptSource(t, seed=9).held_out(5)  # keyed by eval_seed only
    assert len(src.held_out(5)) == 5


def test_split_needs_two_distinct_prompts(tmp_path):
    with pytest.raises(DataError, match=r"^data\.eval_fraction: the dataset has 1 distinct prompt\(s\); a split"):
        split_held_out(["a", "a"], 0.5)
    assert split_held_out(["a", "b"], 0.99) in ({"a"}, {"b"})  # one is always left for training


def test_eval_file_is_the_held_out_set(tmp_path):
    train = _write(tmp_path / "train.jsonl", [{"prompt": f"t{i}", "answer": "1"} for i in range(20)])
    ev = _write(tmp_path / "eval.jsonl", [{"prompt": f"e{i}", "answer": "2"} for i in range(6)])
    t = DatasetTask(train, answer_field="answer", eval_path=ev)
    src = PromptSource(t, seed=0)
    assert sorted(p.prompt for p in src.held_out(100)) == sorted(f"e{i}" for i in range(6))
    assert all(p.prompt.startswith("t") for s in range(1, 50) for p in src.batch(s, 4))
    # an eval file sharing prompts with training is flagged
    ev2 = _write(tmp_path / "eval2.jsonl", [{"prompt": "t3", "answer": "1"}, {"prompt": "e", "answer": "1"}])
    with pytest.warns(UserWarning, match=r"1 of the 2 held-out prompts of .*eval2\.jsonl also appear in the training"):
        DatasetTask(train, answer_field="answer", eval_path=ev2)
    # a bad eval file names its key and line
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        DatasetTask(train, answer_field="answer", eval_path=str(tmp_path / "bad.jsonl"))
    with pytest.raises(DataError, match=r"^data\.eval_path: no such file"):
        DatasetTask(train, eval_path=str(tmp_path / "none.jsonl"))
    # without a held-out source, evaluation falls back to draws from the training rows
    assert PromptSource(DatasetTask(train), 0).held_out(3)[0].prompt.startswith("t")


def test_config_keys_for_held_out(tmp_path):
    base = {"model": {"student": "s", "teacher": "t"}, "loss": {"topk": 4}}
    cfg = load_config(base=base, overrides=["data.task=dataset", "data.path=x.jsonl", "data.eval_fraction=0.1"])
    assert cfg.data.eval_fraction == 0.1 and cfg.data.answer_match == "math"
    with pytest.raises(ConfigError, match=r"^data\.eval_fraction: expected a number in \(0, 1\) or null, got 1\.5$"):
        load_config(base=base, overrides=["data.task=dataset", "data.path=x.jsonl", "data.eval_fraction=1.5"])
    with pytest.raises(ConfigError, match=r"^data\.eval_fraction: expected null when data\.eval_path"):
        load_config(base=base, overrides=["data.task=dataset", "data.path=x", "data.eval_fraction=0.1",
                                          "data.eval_path=y"])
    with pytest.raises(ConfigError, match=r"^data\.eval_path: set only with data\.task dataset"):
        load_config(base=base, overrides=["data.eval_path=y"])
    with pytest.raises(ConfigError, match=r"^data\.answer_match: expected one of math/exact/contains, got 'fuzzy'$"):
        load_config(base=base, overrides=["data.answer_match=fuzzy"])


CHAT = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
       "{% if add_generation_prompt %}[assistant]{% endif %}"


def test_chat_format_prompts_render_with_the_template(tmp_path):
    chars = "abcdefghijklmnopqrstuvwxyz[]0123456789 ?"
    tok = char_tokenizer(chars, chat_template=CHAT)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2"}]
    path = _write(tmp_path / "chat.jsonl", [{"prompt": msgs, "answer": "2"}, {"prompt": "plain", "answer": "3"}])
    t = DatasetTask(path, answer_field="answer")
    assert t.rows[0].prompt == msgs and t.rows[1].prompt == "plain"
    ids = render_prompt(tok, t.rows[0].prompt)
    assert tok.decode(ids) == "<s>[system]be brief[user]what is 2[assistant]"
    assert tok.decode(render_prompt(tok, "plain")) == "<s>[user]plain[assistant]"
    t.fit_prompts(tok, 100)  # rendered lengths checked for chat rows too
    with pytest.raises(DataError, match=r"chat\.jsonl:1: the prompt is 43 tokens, more than the 30"):
        t.fit_prompts(tok, 30)
    with pytest.raises(DataError, match=r"chat\.jsonl:1: the chat prompt is longer than the 30 tokens the model "
                                        r"allows, and data\.overlong=truncate cuts plain-string prompts only"):
        t.fit_prompts(tok, 30, overlong="truncate")
    with pytest.raises(ConfigError, match=r"^data\.use_chat_template: chat-format prompts .* so it must be true$"):
        render_prompt(tok, msgs, use_chat_template=False)


@pytest.mark.parametrize("prompt, msg", [
    ([], r"'prompt' is an empty list of messages"),
    ([{"role": "user"}], r"'prompt' message 0 is not a \{'role': str, 'content': str\} mapping"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], r"'prompt' ends with an assistant"),
])
def test_bad_chat_rows_name_the_line(tmp_path, prompt, msg):
    path = _write(tmp_path / "c.jsonl", [{"prompt": "ok"}, {"prompt": prompt}])
    with pytest.raises(DataError, match=r"c\.jsonl:2: " + msg):
        DatasetTask(path)


def test_hub_dataset_offline_error_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    with pytest.raises(DataError, match=r"^data\.path: cannot load dataset 'nobody/no-such-dataset-xyz' split "
                                        r"'train': offline \(HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set\) and it is "
                                        r"not in the local cache"):
        DatasetTask("nobody/no-such-dataset-xyz")


def test_local_dataset_folder_and_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"q": f"t{i}", "a": str(i)} for i in range(8)]),
        "test": datasets.Dataset.from_list([{"q": f"e{i}", "a": str(i)} for i in range(3)])})
    folder = tmp_path / "ds"
    for name, split in d.items():  # a folder of per-split parquet files: load_dataset(folder, split=...)
        (folder / "data").mkdir(parents=True, exist_ok=True)
        split.to_parquet(str(folder / "data" / f"{name}-00000-of-00001.parquet"))
    t = DatasetTask(str(folder), "q", "a", eval_split="test")
    assert [p.prompt for p in t.rows] == [f"t{i}" for i in range(8)]
    assert sorted(p.prompt for p in t.eval_rows) == ["e0", "e1", "e2"]
    with pytest.raises(DataError, match=r"^data\.eval_split: cannot load dataset '.*ds' split 'validation'"):
        DatasetTask(str(folder), "q", "a", eval_split="validation")
    saved = tmp_path / "saved"  # a save_to_disk folder
    d.save_to_disk(str(saved))
    t = DatasetTask(str(saved), "q", "a", eval_split="test")
    assert len(t.rows) == 8 and sorted(p.prompt for p in t.eval_rows) == ["e0", "e1", "e2"]
    with pytest.raises(DataError, match=r"^data\.eval_split: cannot load dataset '.*saved' split 'dev': .*no split "
                                        r"'dev' \(splits: \['train', 'test'\]\)"):
        DatasetTask(str(saved), "q", "a", eval_split="dev")


@pytest.mark.parametrize("text, expected", [
    ("so 3 + 4 = 7\n#### 7", "7"), ("#### 1,234", "1,234"), ("the answer is \\boxed{\\frac{1}{2}} ok", "\\frac{1}{2}"),
    ("a 3 then 12.5 then", "12.5"), ("costs $1,000", "$1,000"), ("none", None), ("\\boxed{unclosed", None),
    ("-4 and -7", "-7"),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_match_answer_modes():
    gsm_ref = "Natalia sold 48/2 = 24 clips.\n#### 72"
    assert match_answer(gsm_ref, "... so 72 clips") == 1.0
    assert match_answer(gsm_ref, "72 clips, then 710") == 0.0  # the last number is the answer
    assert match_answer("10", "I think 1") == 0.0 and match_answer("1", "it is 10") == 0.0
    assert match_answer("1", "it is 10", "contains") == 1.0  # the old substring test over-counts
    assert match_answer("1000", "$1,000.") == 1.0 and match_answer("0.5", "\\boxed{.5}") == 1.0
    assert match_answer("\\boxed{x+1}", "so \\boxed{ x+1 }") == 1.0
    assert match_answer("7", " 7 \n", "exact") == 1.0 and match_answer("7", "7.", "exact") == 0.0
    with pytest.raises(ValueError, match=r"data\.answer_match: expected one of"):
        match_answer("1", "1", "fuzzy")


def test_dataset_scores_with_the_math_extractor(tmp_path):
    path = _write(tmp_path / "g.jsonl", [{"prompt": "q", "answer": "work\n#### 12"}])
    p = DatasetTask(path, answer_field="answer").rows[0]
    assert DatasetTask(path, answer_field="answer").score(p, "so \\boxed{12}") == 1.0
    assert DatasetTask(path, answer_field="answer").score(p, "112") == 0.0
    assert DatasetTask(path, answer_field="answer", answer_match="contains").score(p, "112") == 0.0  # ref has '####'


def test_reasoning_gym_task_by_name():
    task = make_task("reasoning_gym", name="leg_counting", size=30, eval_size=20, seed=3)
    assert isinstance(task, ReasoningGymTask)
    p = task.sample(random.Random(0))
    assert p.prompt[0]["role"] == "system" and "<answer>" in p.prompt[0]["content"]
    assert p.prompt[-1]["role"] == "user"
    assert task.score(p, f"thinking... <answer>{p.answer}</answer>") == 1.0
    assert task.score(p, f"<answer>{int(p.answer) + 1}</answer>") == 0.0
    assert task.score(p, p.answer) == 0.0  # no answer tag: nothing extracted
    held = PromptSource(task, seed=0).held_out(50)
    train_q = {task.data[i]["question"] for i in range(30)}
    assert held and all(h.prompt[-1]["content"] not in train_q for h in held)
    assert len({h.prompt[-1]["content"] for h in held}) == len(held) <= 20
    h = held[0]
    assert task.score(h, f"<answer>{h.answer}</answer>") == 1.0  # held-out rows score against their own entries
    # another task, its own config keys passed through
    t2 = make_task("reasoning_gym", name="basic_arithmetic", size=5, eval_size=2, min_terms=2, max_terms=2)
    q = t2.sample(random.Random(1))
    assert t2.score(q, f"<answer>{q.answer}</answer>") == 1.0


@pytest.mark.parametrize("kwargs, msg", [
    ({}, r"^data\.task_args\.name: expected a reasoning-gym task name"),
    ({"name": "no_such_task"}, r"^data\.task_args: reasoning_gym 'no_such_task': Dataset 'no_such_task' not "
                               r"registered$"),
    ({"name": "leg_counting", "bogus": 1}, r"^data\.task_args: reasoning_gym 'leg_counting' does not take these "
                                           r"arguments \(.*bogus"),
    ({"name": "leg_counting", "system_prompt": "nope"}, r"^data\.task_args\.system_prompt: expected one of"),
])
def test_reasoning_gym_bad_args(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        make_task("reasoning_gym", **kwargs)


def test_trainer_trains_on_chat_rows_and_evaluates_only_held_out(tmp_path, monkeypatch):
    """Acceptance: a jsonl of chat-format prompts and a separate eval file through `opdistill train`."""
    import yaml

    from opdistill.cli import main
    from opdistill.data import prompts as prompts_mod
    from opdistill.runs.files import read_metrics
    from opdistill.train import loop
    from tests.trainer_helpers import make_model_dir

    chars = "abcdefghijklmnopqrstuvwxyz[]0123456789 ?#"
    make_model_dir(tmp_path / "teacher", hidden=32, layers=2, seed=1, chars=chars, chat_template=CHAT)
    make_model_dir(tmp_path / "student", hidden=16, layers=1, seed=2, chars=chars, chat_template=CHAT)
    sys_msg = {"role": "system", "content": "answer after ####"}
    train = _write(tmp_path / "train.jsonl", [{"prompt": [sys_msg, {"role": "user", "content": f"what is {i}"}],
                                               "answer": str(i)} for i in range(12)])
    ev = _write(tmp_path / "eval.jsonl", [{"prompt": [sys_msg, {"role": "user", "content": f"what is {i}"}],
                                           "answer": str(i)} for i in range(50, 55)])
    cfg = {"run_dir": str(tmp_path / "run"),
           "model": {"student": str(tmp_path / "student"), "teacher": str(tmp_path / "teacher")},
           "data": {"task": "dataset", "path": train, "eval_path": ev, "answer_field": "answer",
                    "prompts_per_step": 3},
           "rollout": {"n": 2, "max_new_tokens": 6},
           "loss": {"loss_mode": "topk", "topk": 4}, "optim": {"lr": 1e-2},
           "train": {"steps": 3, "threads": 1, "micro_batch_tokens": 200},
           "eval": {"every": 2, "num_prompts": 100, "batch_size": 8},
           "log": {"tensorboard": False, "progress": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    seen = {"train": [], "eval": []}
    batch, run_eval = prompts_mod.PromptSource.batch, loop.run_eval

    def spy_batch(self, step, n):
        out = batch(self, step, n)
        seen["train"] += [p.prompt[-1]["content"] for p in out]
        return out

    def spy_eval(cfg, tok, student, teacher, task, held_out, *ctx, **kw):
        seen["eval"].append(sorted(p.prompt[-1]["content"] for p in held_out))
        return run_eval(cfg, tok, student, teacher, task, held_out, *ctx, **kw)

    monkeypatch.setattr(prompts_mod.PromptSource, "batch", spy_batch)
    monkeypatch.setattr(loop, "run_eval", spy_eval)
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 0
    held = sorted(f"what is {i}" for i in range(50, 55))
    assert seen["eval"] == [held, held, held]  # before training, at step 2, at the end: the eval file's rows only
    assert len(seen["train"]) == 9 and set(seen["train"]) <= {f"what is {i}" for i in range(12)}
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "eval/greedy_acc" in r] == [0, 2, 3]


_ANSWER_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["Paris", "72", "#### 72", "work\n#### 12", "\\boxed{x+1}", "The answer is 5 apples.", "Paris, 3 million", "####",
     "", " 7 \n", "$1,000.", "\\boxed{", "a\n\nb"])


@settings(max_examples=300, deadline=None)
@given(reference=_ANSWER_TEXT, mode=st.sampled_from(ANSWER_MATCH))
def test_no_mode_scores_a_reference_against_itself_zero(reference, mode):
    # issue 35 item 2: a bare-answer reference (TRL messages data, final_assistant: answer) scored 0 against itself
    assert match_answer(reference, reference, mode) == 1.0


def test_a_bare_word_answer_is_read_off_the_last_line():
    assert match_answer("Paris", "Paris") == 1.0 and match_answer("Paris", "Let me think.\nParis.") == 1.0
    assert match_answer("Paris", "The capital is Paris") == 0.0  # the last line is the answer, not a search
    assert match_answer("Paris", "London") == 0.0 and match_answer("Paris", "") == 0.0
    assert match_answer("72", "no number here") == 0.0  # a numeric reference needs a number


def test_messages_rows_ending_with_a_bare_answer_score_their_own_answer(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": a}]}
            for a in ("Paris", "Rome", "The answer is 5 apples.")]
    task = DatasetTask(_write(tmp_path / "m.jsonl", rows), prompt_field="messages", final_assistant="answer")
    for p in task.rows:
        assert task.score(p, p.answer) == 1.0
    assert task.score(task.rows[0], "Rome") == 0.0
