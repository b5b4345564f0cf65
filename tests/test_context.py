"""Privileged-context teachers (SPEC 6.7, ``teacher.context``): the teacher's own prompt per row, and the teacher that
scores the student's response under it.

- ``TeacherPrompt``: the identity, worked examples as chat turns or as text, the template's {answer} / {hint}, the
  spare example for a row whose own question was drawn, never a held-out question (drawn or from a file);
- ``ContextTeacher`` against a reference built by hand: the teacher's prompt written out token by token, the
  teacher's forward run by hand on ``x' + y`` in float64, every request kind (top-k, sampled, requested ids, hidden
  states) and the loss of two families; with x' = x its answers are the wrapped teacher's bit for bit;
- bad input: unknown or missing placeholders, a hint missing in a row, an examples file with a held-out problem,
  a teacher row longer than the teacher's positions.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from opdistill import DistillationConfig, DistillationLoss, GlobalBatch, TeacherTopK
from opdistill.data import CARRY_ADD_CHARS, CarryAdditionTask, Problem, TeacherPrompt, make_task
from opdistill.errors import ConfigError, DataError
from opdistill.models import build_tiny_llama, char_tokenizer
from opdistill.teachers import LocalTeacher, Rows, ScoreRequest, TeacherError
from opdistill.teachers.context import ContextTeacher
from tests import reference as ref


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer(CARRY_ADD_CHARS)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, seed=3).requires_grad_(False)


# -- the teacher's prompt ---------------------------------------------------------------------------------------------
def test_identity_context_is_the_rows_own_prompt():
    task = CarryAdditionTask(1, 2)
    tp = TeacherPrompt(task)
    p = task.sample(random.Random(0))
    assert tp(p) == [{"role": "user", "content": p.prompt}]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+3="}]
    assert tp(Problem(chat, "15")) == chat
    assert TeacherPrompt(task, chat=False)(p) == p.prompt


def test_examples_are_chat_turns_before_the_question_with_the_system_prompt_replaced():
    task = CarryAdditionTask(1, 2)
    tp = TeacherPrompt(task, examples=2, examples_seed=5, system="add carefully", template="{prompt}")
    rng = random.Random("context/5")  # the documented draw: Task.sample with a generator keyed by examples_seed
    drawn = [task.sample(rng) for _ in range(2)]
    row = Problem([{"role": "system", "content": "old"}, {"role": "user", "content": "9+9="}], "18")
    assert tp(row) == [{"role": "system", "content": "add carefully"},
                       {"role": "user", "content": drawn[0].prompt}, {"role": "assistant", "content": drawn[0].solution},
                       {"role": "user", "content": drawn[1].prompt}, {"role": "assistant", "content": drawn[1].solution},
                       {"role": "user", "content": "9+9="}]
    text = TeacherPrompt(task, examples=2, examples_seed=5, chat=False)(Problem("9+9=", "18"))
    assert text == f"{drawn[0].prompt}{drawn[0].solution}\n\n{drawn[1].prompt}{drawn[1].solution}\n\n9+9="


def test_the_template_reads_the_answer_and_the_hint_once():
    task = CarryAdditionTask(1, 2)
    tp = TeacherPrompt(task, template="{prompt} (answer: {answer}; hint: {hint})", hint_field="h")
    row = Problem("1+2=", "{answer}", hint="{prompt}")  # values holding placeholders are not filled again
    assert tp(row)[-1]["content"] == "1+2= (answer: {answer}; hint: {prompt})"
    assert tp.reads_rows and not TeacherPrompt(task).reads_rows
    with pytest.raises(DataError, match=r"^teacher.context.hint_field: a row of task carry_add carries no hint "):
        tp(Problem("1+2=", "3"))


def test_a_row_whose_question_was_drawn_gets_the_spare_example():
    task = CarryAdditionTask(1, 1)
    tp = TeacherPrompt(task, examples=3, examples_seed=1)
    own = tp.examples[1][0]
    msgs = tp(Problem(own, "x"))
    shown = [m["content"] for m in msgs[:-1] if m["role"] == "user"]
    assert own not in shown and shown == [tp.examples[0][0], tp.spare[0], tp.examples[2][0]]


def test_examples_never_show_a_held_out_question():
    task = CarryAdditionTask(1, 1)  # 81 problems: the draws repeat, and the banned ones come up
    rng = random.Random("context/0")
    first = [task.sample(rng) for _ in range(6)]
    tp = TeacherPrompt(task, examples=5, held_out=first[:3])
    shown = {q for q, _ in tp.examples} | {tp.spare[0]}
    assert not shown & {p.prompt for p in first[:3]} and len(shown) == 6
    with pytest.raises(ConfigError, match=r"^teacher.context.examples: task carry_add gave 81 distinct training "):
        TeacherPrompt(task, examples=90)


def test_reasoning_gym_examples_come_from_the_training_split(tmp_path):
    task = make_task("reasoning_gym", name="chain_sum", size=40, eval_size=20, min_terms=2, max_terms=2,
                     max_digits=2)
    tp = TeacherPrompt(task, examples=5, held_out=task.held_out_all())
    train = {task.data[i]["question"] for i in range(task.size)}
    held = {task.eval_data[i]["question"] for i in task.eval_index}
    assert all(q in train and q not in held for q, _ in tp.examples)
    assert all(r["role"] == "assistant" and r["content"].startswith("<answer>") and r["content"].endswith("</answer>")
               for _, (r,) in tp.examples)
    # a file of examples naming a held-out problem is refused, with its line
    q = task.eval_data[task.eval_index[0]]["question"]
    path = tmp_path / "shots.jsonl"
    path.write_text(json.dumps({"prompt": "1 + 1 =", "response": "<answer>2</answer>"}) + "\n"
                    + json.dumps({"prompt": q, "response": "<answer>0</answer>"}) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:2: this example's prompt is a held-out problem "):
        TeacherPrompt(task, examples_path=str(path), held_out=task.held_out_all())
    path.write_text(json.dumps({"prompt": "1 + 1 ="}) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:1: expected non-empty string fields 'prompt' and 'response', or "
                                          r"'messages' \(a worked example for teacher.context\), got "):
        TeacherPrompt(task, examples_path=str(path))
    path.write_text('[' * 100_000 + "\n")  # nested past the parser's recursion: one line, not a traceback
    with pytest.raises(DataError, match=rf"^{path}:1: not valid JSON"):
        TeacherPrompt(task, examples_path=str(path))


def test_an_example_from_a_file_that_is_the_rows_own_question_is_left_out(tmp_path):
    path = tmp_path / "shots.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "response": r}) + "\n"
                            for q, r in (("1+1=", "2"), ("2+2=", "4"), ("3+3=", "6"))))
    tp = TeacherPrompt(CarryAdditionTask(1, 1), examples_path=str(path))
    shown = [m["content"] for m in tp(Problem("2+2=", "4"))]
    assert shown == ["1+1=", "2", "3+3=", "6", "2+2="]  # no "2+2=" / "4" turn before the question
    assert len(tp(Problem("5+5=", "10"))) == 7


EPISODE = [{"role": "user", "content": "f(5)+1="}, {"role": "assistant", "content": "<tool_call>f 5</tool_call>"},
           {"role": "tool", "content": "7"}, {"role": "assistant", "content": "8"}]


def test_a_worked_episode_from_a_file_is_shown_whole(tmp_path):
    """An examples_path row ``{messages}`` is a worked episode (SPEC 6.8): its tool messages and turns come before
    the row's question as they are; a plain ``{prompt, response}`` row beside it is one assistant turn."""
    path = tmp_path / "shots.jsonl"
    path.write_text(json.dumps({"messages": EPISODE}) + "\n" + json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    tp = TeacherPrompt(CarryAdditionTask(1, 1), examples_path=str(path), system="use f")
    assert tp(Problem("f(2)+3=", "9")) == [{"role": "system", "content": "use f"}, *EPISODE,
                                           {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                                           {"role": "user", "content": "f(2)+3="}]
    assert tp(Problem("f(5)+1=", "8")) == [{"role": "system", "content": "use f"},  # its own question: left out
                                           {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                                           {"role": "user", "content": "f(5)+1="}]
    with pytest.raises(ConfigError, match=r"holds worked episodes \(rows with messages\), which need the chat "):
        TeacherPrompt(CarryAdditionTask(1, 1), examples_path=str(path), chat=False)
    with pytest.raises(DataError, match=r":1: this example's prompt is a held-out problem \('f\(5\)\+1='\)"):
        TeacherPrompt(CarryAdditionTask(1, 1), examples_path=str(path), held_out=[Problem("f(5)+1=", "8")])


@pytest.mark.parametrize("messages, what", [
    ("hi", "must be a list of at least 2 messages, got \"hi\""),
    (EPISODE[:1], "must be a list of at least 2 messages"),
    ([EPISODE[0], {"role": "assistant"}], "entry 1 must be {\"role\", \"content\"} with non-empty string content"),
    ([EPISODE[0], {"role": "assistant", "content": " "}], "entry 1 must be {\"role\", \"content\"}"),
    ([EPISODE[1], EPISODE[3]], "entry 0 has role 'assistant', expected 'user'"),
    ([EPISODE[0], {"role": "system", "content": "x"}, EPISODE[3]], "entry 1 has role 'system', expected 'assistant' or "
                                                                   "'tool'"),
    (EPISODE[:3], "ends on a 'tool' message"),
])
def test_a_bad_worked_episode_is_one_data_error_naming_its_line(tmp_path, messages, what):
    path = tmp_path / "shots.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(DataError) as e:
        TeacherPrompt(CarryAdditionTask(1, 1), examples_path=str(path))
    assert str(e.value).startswith(f"{path}:2: 'messages' {what}")
    assert str(e.value).endswith("(a worked episode: a user message, then assistant turns and tool messages, ending on "
                                 "an assistant turn)")


@pytest.mark.parametrize("template, hint, message", [
    ("{question}", None, r"^teacher.context.template: unknown placeholder \{question\} "),
    ("{answer}", None, r"^teacher.context.template: expected the row's question as \{prompt\} "),
    ("{prompt}{hint}", None, r"^teacher.context.hint_field: expected the field \{hint\} reads "),
    ("{prompt}", "steps", r"^teacher.context.hint_field: set, but teacher.context.template has no \{hint\} "),
])
def test_template_errors(template, hint, message):
    with pytest.raises(ConfigError, match=message):
        TeacherPrompt(CarryAdditionTask(), template=template, hint_field=hint)


# -- the teacher under its own prompt, against a hand-built reference --------------------------------------------------
def _ids(tok, text: str) -> list[int]:
    return tok.convert_tokens_to_ids(list(text))


def _rows(tok, prompts: list[str], responses: list[str]) -> Rows:
    """Right-padded student rows: <s> prompt, then the response (a string of the task's characters, '' = none)."""
    seqs = [([tok.bos_token_id] + _ids(tok, p), _ids(tok, r)) for p, r in zip(prompts, responses)]
    W = max(len(p) + len(r) for p, r in seqs)
    ids = torch.zeros(len(seqs), W, dtype=torch.long)
    am, rm = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (p, r) in enumerate(seqs):
        ids[b, :len(p) + len(r)] = torch.tensor(p + r)
        am[b, :len(p) + len(r)] = 1
        rm[b, len(p):len(p) + len(r)] = 1
    return Rows(ids, am, rm)


PROMPTS = ["12+3=", "4+5=", "77+81="]
RESPONSES = ["2+3+0=5,1+0+0=1>15", "4+5+0=9>9", ""]
# the teacher's prompts, written out: a worked example before two of the rows, another question for the third
SHOTS = ["1+1=1+1+0=2>2", "", "5+5=5+5+0=10>10"]


def _hand_teacher_rows(tok, b: int) -> tuple[list[int], list[int]]:
    """(x' ids, response ids) of row b: the char tokenizer's template is <s> and the contents one after another."""
    return [tok.bos_token_id] + _ids(tok, SHOTS[b] + PROMPTS[b]), _ids(tok, RESPONSES[b])


def _teacher_prompts():
    out = []
    for b in range(3):
        turns = [{"role": "user", "content": PROMPTS[b]}]
        if SHOTS[b]:
            q, a = SHOTS[b].split("=", 1)
            turns = [{"role": "user", "content": q + "="}, {"role": "assistant", "content": a}] + turns
        out.append(turns)
    return tuple(out)


def _hand_scores(model, tok, b: int):
    """float64 log-probs [n, V] and final hidden states [n, H] of the teacher at the positions that score row b's
    response tokens, from one forward of x' + y run by hand."""
    x, y = _hand_teacher_rows(tok, b)
    ids = torch.tensor([x + y])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    at = slice(len(x) - 1, len(x) - 1 + len(y))
    return F.log_softmax(out.logits[0, at].double(), -1), out.hidden_states[-1][0, at]


def test_context_teacher_equals_the_teacher_forward_by_hand(model, tok):
    rows = _rows(tok, PROMPTS, RESPONSES)
    rows = Rows(rows.input_ids, rows.attention_mask, rows.response_mask, teacher_prompts=_teacher_prompts())
    B, S = rows.input_ids.shape
    V, K = len(tok), 5
    req_ids = torch.randint(0, V, (B, S, 3), generator=torch.Generator().manual_seed(0))
    teacher = ContextTeacher(LocalTeacher(model), tok)
    got = teacher.score(rows, ScoreRequest(k=K, sampled=True, requested_ids=req_ids, hidden=True))
    scored = rows.scored()
    for b in range(B):
        lp, hidden = _hand_scores(model, tok, b)
        at = scored[b].nonzero().flatten()  # the student's positions that score its response
        assert at.numel() == lp.shape[0] == len(RESPONSES[b])
        if not at.numel():
            continue
        y = torch.tensor(_ids(tok, RESPONSES[b]))
        top_lp, top_ids = lp.topk(K, dim=-1)
        torch.testing.assert_close(got.topk.logprobs[b, at].double(), top_lp, rtol=0, atol=1e-6)
        assert torch.equal(got.topk.ids[b, at].sort(-1).values, top_ids.sort(-1).values)
        torch.testing.assert_close(got.sampled_logprobs[b, at].double(), lp.gather(-1, y[:, None])[:, 0],
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(got.requested_logprobs[b, at].double(), lp.gather(-1, req_ids[b, at]),
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(got.hidden[b, at], hidden, rtol=0, atol=1e-6)
    # positions that score no response token hold what every teacher leaves there
    off = ~scored
    assert (got.topk.logprobs[off] == float("-inf")).all() and (got.topk.ids[off] == 0).all()
    assert (got.sampled_logprobs[off] == 0).all() and (got.requested_logprobs[off] == float("-inf")).all()
    assert (got.hidden[off] == 0).all()


@pytest.mark.parametrize("support, divergence", [("tail", "reverse"), ("renormalized", "forward")])
def test_the_loss_under_the_context_equals_the_float64_reference(model, tok, support, divergence):
    """The loss of the student's logits against the context-teacher's top-k (the teacher's forward by hand, float64
    reference of SPEC 3.1 and 4): values and gradients to 1e-6."""
    rows = _rows(tok, PROMPTS, RESPONSES)
    rows = Rows(rows.input_ids, rows.attention_mask, rows.response_mask, teacher_prompts=_teacher_prompts())
    K = 6
    scores = ContextTeacher(LocalTeacher(model), tok).score(rows, ScoreRequest(k=K))
    B, S = rows.input_ids.shape
    mask = rows.scored()
    # the reference's teacher signal: the hand forward's top-K at the same positions
    ids = torch.zeros(B, S, K, dtype=torch.long)
    lps = torch.full((B, S, K), float("-inf"), dtype=torch.float64)
    for b in range(B):
        at = mask[b].nonzero().flatten()
        if at.numel():
            lp, _ = _hand_scores(model, tok, b)
            v, i = lp.topk(K, dim=-1)
            ids[b, at], lps[b, at] = i, v
    z = torch.randn(B, S, len(tok), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cfg = DistillationConfig(loss_mode="topk", support=support, divergence=divergence, topk=K)
    z1 = z.clone().float().requires_grad_(True)
    loss, _ = DistillationLoss(cfg)(z1, scores.topk, mask, GlobalBatch.from_masks([mask]))
    loss.backward()
    z2 = z.clone().requires_grad_(True)
    want = ref.aggregate_reference(ref.topk_reference(z2, ids, lps, support, divergence), mask, "token-mean")
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(z1.grad.double(), z2.grad, rtol=1e-5, atol=1e-7)


def test_with_the_rows_own_prompts_the_answers_are_the_teachers_bit_for_bit(model, tok):
    rows = _rows(tok, PROMPTS, RESPONSES)
    x = tuple([{"role": "user", "content": p}] for p in PROMPTS)  # the identity context's x' = x
    B, S = rows.input_ids.shape
    req = ScoreRequest(k=4, sampled=True, hidden=True,
                       requested_ids=torch.randint(0, len(tok), (B, S, 2), generator=torch.Generator().manual_seed(2)))
    plain = LocalTeacher(model).score(rows, req)
    ctx = ContextTeacher(LocalTeacher(model), tok).score(
        Rows(rows.input_ids, rows.attention_mask, rows.response_mask, teacher_prompts=x), req)
    for a, b in ((plain.topk.ids, ctx.topk.ids), (plain.topk.logprobs, ctx.topk.logprobs),
                 (plain.sampled_logprobs, ctx.sampled_logprobs), (plain.requested_logprobs, ctx.requested_logprobs),
                 (plain.hidden, ctx.hidden)):
        assert torch.equal(a, b)


def test_rows_without_teacher_prompts_and_rows_past_the_positions_are_refused(model, tok):
    rows = _rows(tok, PROMPTS, RESPONSES)
    teacher = ContextTeacher(LocalTeacher(model), tok)
    with pytest.raises(TeacherError, match=r"^model.teacher: teacher.context scores each response under the row's "):
        teacher.score(rows, ScoreRequest(k=2))
    short = ContextTeacher(LocalTeacher(model), tok, max_positions=20)
    rows = Rows(rows.input_ids, rows.attention_mask, rows.response_mask, teacher_prompts=_teacher_prompts())
    with pytest.raises(TeacherError, match=r"^model.teacher: a teacher row of 37 tokens \(19 of teacher.context "
                                           r"prompt \+ 18 of response\) exceeds the teacher's 20 positions; "):
        short.score(rows, ScoreRequest(k=2))
