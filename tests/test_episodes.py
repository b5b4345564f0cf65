"""Episodes (SPEC 6.8, issue 36): tools called by name, observations for every bad call, episodes through the keyed
sampler with the student's tokens alone in the mask, the teacher scoring them in the whole episode, the loss
independent of how the step is split, and the trainer running it end to end.

The expectations come from the episodes' definition: ``scripted_episode`` lays out prompt, turns and the template's
tool messages by hand; the teacher's log-probs are a float64 forward of the whole episode."""
import copy
import dataclasses
import json
import threading

import pytest
import torch

from opdistill import DistillationLoss, GlobalBatch, TeacherSampled, shift_for_next_token
from opdistill.engines.episodes import EPISODE_SUMS, run_episodes
from opdistill.engines.rollout import generate_rollouts
from opdistill.env import CallFormat, Environment, Tools
from opdistill.errors import ConfigError, DataError
from opdistill.teachers import LocalTeacher, Rows, ScoreRequest
from opdistill.train.run.config import load_config
from opdistill.train.steps.step import StepData, train_step
from tests.episode_helpers import CHARS, add, call, echo, memorize, scripted_episode, tiny_model, tool_tokenizer

SCRIPTS = [("2+3", [call("add", a=2, b=3), "5"]), ("4+1", [call("add", a=4, b=1), "5"]), ("hi", ["hi"])]


@pytest.fixture(scope="module")
def tok():
    return tool_tokenizer()


@pytest.fixture(scope="module")
def env(tok):
    return Environment(Tools([add, echo]), tok, max_turns=3, max_episode_tokens=120)


@pytest.fixture(scope="module")
def caller(tok, env):
    """A tiny model that writes the scripted episodes greedily: a tool call, then the answer after the result."""
    model = tiny_model(tok, seed=0)
    memorize(model, tok, [scripted_episode(env, tok, p, t) for p, t in SCRIPTS], steps=400)
    return model


# -- tools: every call's outcome is an observation ---------------------------------------------------------------------
def test_a_call_runs_the_tool_and_its_result_becomes_text():
    def info(key: str) -> dict:
        """Look something up."""
        return {"key": key, "n": 2}

    def nothing() -> None:
        return None

    tools = Tools([add, info, nothing])
    assert tools.call(json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})).text == "5"
    o = tools.call(json.dumps({"name": "info", "arguments": {"key": "x"}}))
    assert (o.kind, json.loads(o.text)) == ("ok", {"key": "x", "n": 2})
    assert tools.call('{"name": "nothing"}').text == "null"  # no arguments: an empty object
    schema = tools.schemas[0]["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers."
    assert schema["parameters"]["required"] == ["a", "b"]
    assert schema["parameters"]["properties"]["a"] == {"type": "integer"}


@pytest.mark.parametrize("body, text", [
    ("add(2, 3)", "error: the tool call is not JSON (Expecting value: line 1 column 1 (char 0))"),
    ("[1, 2]", 'error: a tool call is a JSON object {"name": ..., "arguments": {...}}'),
    ('{"arguments": {}}', 'error: a tool call is a JSON object {"name": ..., "arguments": {...}}'),
    ('{"name": "nope", "arguments": {}}', 'error: unknown tool "nope" (tools: add, echo)'),
    ('{"name": "add", "arguments": {"a": 1}}', "error: add: missing argument(s) ['b']"),
    ('{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}',
     "error: add: unknown argument(s) ['c'] (it takes ['a', 'b'])"),
    ('{"name": "add", "arguments": {"a": "1", "b": 2}}',
     'error: add: argument \'a\': Input should be a valid integer (got "1")'),
    ('{"name": "add", "arguments": {"a": 1.5, "b": 2}}',
     "error: add: argument 'a': Input should be a valid integer (got 1.5)"),
    ('{"name": "add", "arguments": [1, 2]}', 'error: add: a call has "name" and "arguments" (a JSON object) only'),
    ('{"name": "add", "arguments": {}, "run": "x"}', 'error: add: a call has "name" and "arguments" (a JSON object) '
                                                     'only'),
    (None, "error: the tool call was not closed"),
])
def test_a_bad_call_is_an_observation_the_student_reads(body, text):
    o = Tools([add, echo]).call(body)
    assert (o.kind, o.text) == ("bad_call", text)


def test_a_tool_that_raises_hangs_or_returns_no_text_is_an_error_observation():
    release = threading.Event()

    def boom(x: int) -> str:
        raise RuntimeError(f"no {x}\nsecond line")

    def hang() -> str:
        release.wait()
        return "late"

    def raw() -> bytes:
        return b"\x00"

    def odd():
        return object()

    def nan() -> float:
        return float("nan")

    tools = Tools([boom, hang, raw, odd, nan], timeout_s=0.2)
    try:
        assert tools.call('{"name": "boom", "arguments": {"x": 1}}').text == "error: boom raised RuntimeError: no 1"
        o = tools.call('{"name": "hang"}')
        assert (o.kind, o.text) == ("error", "error: hang did not answer within 0.2 s")
    finally:
        release.set()
    assert tools.call('{"name": "raw"}').text == ("error: raw returned bytes, not text (a str, a number, a bool, None, "
                                                  "or JSON lists/dicts)")
    assert tools.call('{"name": "odd"}').text.startswith("error: odd returned object, not text")
    assert tools.call('{"name": "nan"}').text.startswith("error: nan returned float, not text")
    assert {tools.call(f'{{"name": "{n}"}}').kind for n in ("raw", "odd", "nan")} == {"error"}


def test_a_huge_result_is_cut_to_the_limit():
    def big() -> str:
        return "x" * 5000

    o = Tools([big], max_result_chars=100).call('{"name": "big"}')
    assert (o.kind, o.text, o.cut) == ("ok", "x" * 100 + " [cut]", True)


def test_model_text_is_never_executed(tmp_path):
    """A call is JSON naming a listed function: what the model writes is data, never code."""
    marker = tmp_path / "ran"
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    tools = Tools([echo])
    for body in (code, json.dumps({"name": code}), json.dumps({"name": "__import__", "arguments": {"name": "os"}}),
                 json.dumps({"name": "echo", "arguments": {"text": code}})):
        tools.call(body)
    assert tools.call(json.dumps({"name": "echo", "arguments": {"text": code}})).text == code
    assert not marker.exists()


def test_calls_are_found_between_the_markers():
    f = CallFormat()
    assert f.calls("no call here") == []
    assert f.calls("a <tool_call>1</tool_call> b <tool_call>2</tool_call>") == ["1", "2"]
    assert f.calls("<tool_call>1</tool_call><tool_call>open") == ["1", None]
    assert CallFormat("[", "]").calls("x[a][b") == ["a", None]
    with pytest.raises(ConfigError, match=r"^env.call_open: expected a non-empty marker string, got ' '$"):
        CallFormat(" ", "]")


def test_tools_are_refused_at_load_in_one_line(tmp_path):
    def star(*xs: int) -> int:
        return 0

    def untyped_kw(**kw) -> int:
        return 0

    cases = [
        (lambda: Tools([]), "env.tools: an environment needs at least one tool"),
        (lambda: Tools([lambda x: x]), "env.tools: a tool's name must be an identifier, got '<lambda>' (name a lambda "
                                       "with a dict {name: function})"),
        (lambda: Tools([add, copy.copy(add)]), "env.tools: two tools are named 'add'"),
        (lambda: Tools({"x": 3}), "env.tools: 'x' is not callable (int)"),
        (lambda: Tools([star]), "env.tools: star's parameter 'xs' cannot be given by name; a tool is called with the "
                                "JSON object's arguments as keywords"),
        (lambda: Tools([untyped_kw]), "env.tools: untyped_kw takes **kw; a tool names every argument it accepts, so "
                                      "a call's arguments can be checked"),
        (lambda: Tools([add], timeout_s=0), "env.tool_timeout_s: expected a finite number > 0, got 0"),
        (lambda: Tools([add], max_result_chars=0), "env.max_result_chars: expected an int >= 1, got 0"),
        (lambda: Tools.from_specs(["no_such_module_x:f"]), "env.tools.0: cannot import 'no_such_module_x'"),
        (lambda: Tools.from_specs(["os.path:join", "posixpath:join"]),
         "env.tools.1: a second tool named 'join' (env.tools.0 is the first); the model calls a tool by its function's "
         "name"),
    ]
    for make, message in cases:
        with pytest.raises(ConfigError) as e:
            make()
        assert str(e.value).startswith(message), str(e.value)
        assert "\n" not in str(e.value)
    f = tmp_path / "my_tools.py"
    f.write_text("def twice(x: int) -> int:\n    return 2 * x\n")
    assert Tools.from_specs([f"{f}:twice"]).call('{"name": "twice", "arguments": {"x": 4}}').text == "8"


def test_a_template_that_cannot_carry_an_episode_is_refused(tok):
    from opdistill.models import char_tokenizer

    plain = char_tokenizer(CHARS)  # concatenates the messages: no call format
    with pytest.raises(ConfigError, match=r"^env.tools: the chat template of .* has no tool-call format \('<tool_call>"
                                          r"' appears nowhere in it\); set env.call_open/env.call_close"):
        Environment(Tools([add]), plain)
    Environment(Tools([add]), plain, calls_in_prompt=True)  # the prompts teach it; the template writes tool text
    drops = tool_tokenizer(template="{{ bos_token }}{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}"
                                    "{% endif %}{% endfor %}<tool_call>")
    with pytest.raises(ConfigError, match=r"writes no tool messages \(a tool result disappears from its text\)"):
        Environment(Tools([add]), drops)
    with pytest.raises(ConfigError, match="^env.tools: .*data.use_chat_template is false$"):
        Environment(Tools([add]), tok, use_chat_template=False)
    for bad in ({"max_turns": 0}, {"max_episode_tokens": 0}):
        with pytest.raises(ConfigError, match=f"^env.{next(iter(bad))}: expected an int >= 1, got 0$"):
            Environment(Tools([add]), tok, **bad)


# -- episodes through the sampler --------------------------------------------------------------------------------------
def test_an_episode_is_laid_out_with_the_environment_tokens_out_of_the_mask(tok, env, caller):
    prompts = [env.prompt(p) for p, _ in SCRIPTS]
    b = run_episodes(caller, tok, prompts, env, greedy=True, max_new_tokens=80)
    for r, (p, turns) in enumerate(SCRIPTS):
        p_ids, ids, owners = scripted_episode(env, tok, p, turns)
        n = len(p_ids) + len(ids)
        assert b.input_ids[r, :n].tolist() == p_ids + ids
        assert b.attention_mask[r].sum() == n
        assert b.response_mask[r, len(p_ids):n].tolist() == owners  # the student's tokens alone
        assert b.response_mask[r, :len(p_ids)].sum() == 0 and b.response_mask[r, n:].sum() == 0
        assert b.texts[r] == turns[-1]  # the last turn: what the verifier reads
        counts = dict(zip(EPISODE_SUMS, b.episode_sums[r].tolist()))
        assert counts["turns"] == len(turns) and counts["tool_calls"] == len(turns) - 1
        assert counts["used_tool"] == (len(turns) > 1) and counts["env_tokens"] == owners.count(0)
        assert counts["bad_calls"] == counts["truncated"] == 0
    _, _, owners = scripted_episode(env, tok, *SCRIPTS[0])
    assert owners[-1] == 1 and 0 in owners  # a hole: the tool's tokens between the two turns


def test_episode_limits_end_an_episode_truncated(tok, env, caller):
    p_ids, ids, owners = scripted_episode(env, tok, *SCRIPTS[0])
    first = owners.index(0)  # the call turn's length (its EOS included)
    prompts = [env.prompt(SCRIPTS[0][0])]
    one = Environment(env.tools, tok, max_turns=1)
    b = run_episodes(caller, tok, prompts, one, greedy=True, max_new_tokens=80)  # the call is not run
    assert b.input_ids[0, len(p_ids):len(p_ids) + first].tolist() == ids[:first]
    assert b.response_mask[0].sum() == first and b.episode_sums[0].tolist()[:2] == [1.0, 0.0]
    tight = Environment(env.tools, tok, max_episode_tokens=first + 3)  # no room for the result
    b = run_episodes(caller, tok, prompts, tight, greedy=True, max_new_tokens=80)
    c = dict(zip(EPISODE_SUMS, b.episode_sums[0].tolist()))
    assert (c["truncated"], c["env_tokens"], c["tool_calls"]) == (1, 0, 1) and b.response_mask[0].sum() == first
    cut = Environment(env.tools, tok, max_episode_tokens=10)  # the first turn itself is cut
    b = run_episodes(caller, tok, prompts, cut, greedy=True, max_new_tokens=80)
    assert b.response_mask[0].sum() == 10 and b.episode_sums[0, EPISODE_SUMS.index("truncated")] == 1


def test_episodes_are_keyed_by_sample_and_turn(tok, env, caller):
    """Sampling at temperature 1: the same episodes whatever the batch or the rank's share of the prompts, and the
    first turn is the single response those keys draw."""
    prompts = [env.prompt(p) for p, _ in SCRIPTS]
    kw = dict(n=2, temperature=1.0, max_new_tokens=80, seed=5, step=3)
    whole = run_episodes(caller, tok, prompts, env, **kw)
    one_by_one = run_episodes(caller, tok, prompts, env, batch_size=1, **kw)
    rank1 = run_episodes(caller, tok, prompts[1:], env, prompt_offset=1, **kw)
    for other in (one_by_one,):
        assert torch.equal(other.input_ids, whole.input_ids) and torch.equal(other.response_mask, whole.response_mask)
        torch.testing.assert_close(other.sampler_logprobs, whole.sampler_logprobs, rtol=1e-5, atol=1e-5)
    for r in range(rank1.num_rows):
        n = int(rank1.attention_mask[r].sum())
        assert rank1.input_ids[r, :n].tolist() == whole.input_ids[2 + r, :n].tolist()
    single = generate_rollouts(caller, tok, prompts, max_new_tokens=80, seed=5, step=3, n=2)
    for r in range(whole.num_rows):
        first = single.response_mask[r].nonzero().flatten()
        assert torch.equal(whole.input_ids[r, first], single.input_ids[r, first])
    assert whole.episode_sums[:, EPISODE_SUMS.index("turns")].max() > 1  # some episodes went on after a tool


# -- the teacher and the loss on episodes ------------------------------------------------------------------------------
def _episode_batch(tok, env, caller, dtype=torch.float64):
    prompts = [env.prompt(p) for p, _ in SCRIPTS]
    ro = run_episodes(caller, tok, prompts, env, n=2, temperature=1.0, max_new_tokens=80, seed=1, step=1)
    return ro


def test_a_hand_built_two_turn_episode_matches_the_teachers_scores_and_the_loss(tok, env, caller):
    """The teacher's log-prob of each student token, scored in the whole episode (tool result before the second
    turn), and the sampled-token k3 loss, against a float64 forward written out here."""
    p_ids, ids, owners = scripted_episode(env, tok, *SCRIPTS[0])
    seq = torch.tensor([p_ids + ids])
    am = torch.ones_like(seq)
    rm = torch.tensor([[0] * len(p_ids) + owners])
    teacher = tiny_model(tok, seed=7)
    student = copy.deepcopy(caller)
    # the definition: log q(y_t | whole prefix) at each student-owned token, float64
    with torch.no_grad():
        ref_t = torch.log_softmax(copy.deepcopy(teacher).double()(seq).logits[0, :-1], -1)
        ref_s = torch.log_softmax(copy.deepcopy(student).double()(seq).logits[0, :-1], -1)
    nxt = seq[0, 1:]
    student_tok = rm[0, 1:].bool()
    t_lp = ref_t.gather(-1, nxt[:, None])[:, 0]
    s_lp = ref_s.gather(-1, nxt[:, None])[:, 0]
    scores = LocalTeacher(teacher).score(Rows(seq, am, rm), ScoreRequest(k=4, sampled=True))
    got = scores.sampled_logprobs[0, :-1]
    torch.testing.assert_close(got[student_tok].double(), t_lp[student_tok], rtol=0, atol=1e-6)
    assert (got[~student_tok] == 0).all()  # the tool's tokens and the prompt: not scored
    assert student_tok.sum() == sum(owners) and (~student_tok[len(p_ids) - 1:]).sum() == owners.count(0)
    # k3 = (r - 1) - log r, r = q / pi, token-mean over the student's tokens
    log_r = t_lp - s_lp
    ref_loss = (torch.expm1(log_r) - log_r)[student_tok].mean()
    cfg = load_config(base={"model": {"student": "s", "teacher": "t"}, "loss": {"loss_mode": "sampled",
                                                                                 "estimator": "k3"}})
    opt = torch.optim.SGD(student.parameters(), lr=0.0)
    m = train_step(student, opt, StepData(seq, am, rm, scores), loss_fn=DistillationLoss(cfg.loss),
                   micro_batch_tokens=10**6, grad_clip=None)
    assert m["distillation/loss"] == pytest.approx(float(ref_loss), abs=1e-6)
    assert m["train/response_tokens"] == sum(owners)


def test_a_context_teacher_scores_an_episode_under_its_own_prompt_with_the_tools_listed(tok, env, caller):
    """teacher.context with tools (SPEC 6.7 x 6.8): the teacher reads its own prompt, listing the tools as the
    student's does, then the whole episode; its log-prob of each student token against a float64 forward of that
    sequence written out here, the environment's and the prompt's positions unscored."""
    from opdistill.data import render_prompt
    from opdistill.teachers.context import ContextTeacher

    p_ids, ids, owners = scripted_episode(env, tok, *SCRIPTS[0])
    seq = torch.tensor([p_ids + ids])
    rm = torch.tensor([[0] * len(p_ids) + owners])
    x_t = [{"role": "user", "content": "2+3 (use add)"}]
    teacher = tiny_model(tok, seed=7)
    wrapped = ContextTeacher(LocalTeacher(teacher), tok, tools=env.tools.schemas)
    scores = wrapped.score(Rows(seq, torch.ones_like(seq), rm, teacher_prompts=(x_t,)), ScoreRequest(k=4, sampled=True))
    x_ids = list(tok(tok.apply_chat_template(x_t, tools=env.tools.schemas, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)["input_ids"])
    assert "Tools: add echo." in tok.decode(x_ids)
    assert x_ids != render_prompt(tok, x_t)  # the tools make a difference
    t_seq = torch.tensor([x_ids + ids])
    with torch.no_grad():
        ref = torch.log_softmax(copy.deepcopy(teacher).double()(t_seq).logits[0, :-1], -1)
    ref = ref.gather(-1, t_seq[0, 1:, None])[:, 0][len(x_ids) - 1:]  # from the token before the first turn
    got = scores.sampled_logprobs[0, len(p_ids) - 1:-1]
    student_tok = rm[0, len(p_ids):].bool()
    torch.testing.assert_close(got[student_tok].double(), ref[student_tok], rtol=0, atol=1e-6)
    assert (got[~student_tok] == 0).all() and (scores.sampled_logprobs[0, :len(p_ids) - 1] == 0).all()


def test_an_episode_moves_whole_onto_another_prompt(tok, env, caller):
    """Off-policy KD under teacher.context writes episodes after the teacher's prompt and trains on them after the
    student's (RolloutBatch.with_prompts): every turn and tool message moves, the mask, log-probs and counts with it."""
    from opdistill.engines.rollout import make_batch

    b = run_episodes(caller, tok, [env.prompt(p) for p, _ in SCRIPTS], env, greedy=True, max_new_tokens=80)
    other = [env.prompt("Q" + p) for p, _ in SCRIPTS]
    moved = b.with_prompts(other, tok.pad_token_id)
    laid = [scripted_episode(env, tok, p, t) for p, t in SCRIPTS]
    lps = [b.sampler_logprobs[r, len(p) - 1:len(p) + len(ids) - 1].tolist() for r, (p, ids, _) in enumerate(laid)]
    ref = make_batch(other, [ids for _, ids, _ in laid], lps, b.prompt_index, b.texts, tok.pad_token_id,
                     owners=[o for _, _, o in laid])
    for name in ("input_ids", "attention_mask", "response_mask", "sampler_logprobs"):
        assert torch.equal(getattr(moved, name), getattr(ref, name)), name
    assert torch.equal(moved.episode_sums, b.episode_sums) and moved.texts == b.texts


# a teacher tokenizer of the same characters in another order, with another chat template (tools listed another way,
# tool messages as "R[name]=...")
OTHER_TEMPLATE = (
    "{{ bos_token }}{% if tools %}Use:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}Q:{{ m.content }}\n"
    "{% elif m.role == 'assistant' %}B:{{ m.content }}{{ eos_token }}\n"
    "{% elif m.role == 'tool' %}R[{{ m.name }}]={{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}B:{% endif %}")


def _episode_rows(tok, env, caller):
    """Greedy and sampled episodes of the tool-calling student as a teacher reads them, with their tool results."""
    prompts = [p for p, _ in SCRIPTS]
    out = []
    for kw in ({"greedy": True}, {"n": 2, "temperature": 1.0, "seed": 4}):
        ro = run_episodes(caller, tok, [env.prompt(p) for p in prompts], env, max_new_tokens=80, **kw)
        out.append(Rows(ro.input_ids, ro.attention_mask, ro.response_mask,
                        prompts=tuple(prompts[i] for i in ro.prompt_index), tool_results=tuple(ro.episode_results)))
    assert sum(len(r) for r in out[0].tool_results) >= 2  # episodes with tool results between their turns
    return out


def test_a_cross_tokenizer_teacher_with_one_tokenizer_scores_episodes_as_the_teacher_does(tok, env, caller):
    """xtok over episodes (SPEC 6.6 x 6.8), the same tokenizer and template on both sides: the teacher's row is the
    student's (its prompt lists the tools, its template writes the same tool results), so every student token gets
    exactly the plain teacher's scores, and only the student's tokens are counted."""
    from opdistill.teachers.xtok import CrossTokenizerTeacher

    local = LocalTeacher(tiny_model(tok, seed=7))
    cross = CrossTokenizerTeacher(local, tok, tok, teacher_topk=len(tok), teacher_width=len(tok),
                                  tools=env.tools.schemas)
    for rows in _episode_rows(tok, env, caller):
        t_rows = cross.teacher_rows(rows)[0]
        assert torch.equal(t_rows.input_ids, rows.input_ids) and torch.equal(t_rows.response_mask, rows.response_mask)
        req = ScoreRequest(k=4, sampled=True)
        plain, mapped = local.score(rows, req), cross.score(rows, req)
        scored = rows.scored()
        assert mapped.sums["positions"] == float(scored.sum()) == mapped.sums["exact"] and mapped.sums["masked"] == 0
        torch.testing.assert_close(mapped.sampled_logprobs[scored], plain.sampled_logprobs[scored], rtol=0, atol=1e-6)
        torch.testing.assert_close(mapped.topk.logprobs[scored], plain.topk.logprobs[scored], rtol=0, atol=1e-6)
        assert (mapped.sampled_logprobs[~scored] == 0).all()


def test_a_cross_tokenizer_teacher_reads_the_tool_results_in_its_own_template(tok, env, caller):
    """Another tokenizer (the characters in another order) and another template: the teacher's row is the whole
    conversation as its own template writes it (tools listed, tool messages as R[name]=...), built by hand here from
    the messages; each student token's mapped log-prob is the teacher forward's at the same character there."""
    from opdistill.models import char_tokenizer
    from opdistill.teachers.xtok import CrossTokenizerTeacher
    from opdistill.xtok.tokens import render_chat
    from tests.episode_helpers import CHARS

    t_tok = char_tokenizer(CHARS[::-1], chat_template=OTHER_TEMPLATE)
    teacher = tiny_model(t_tok, seed=9)
    cross = CrossTokenizerTeacher(LocalTeacher(teacher), tok, t_tok, teacher_topk=len(t_tok),
                                  teacher_width=len(t_tok), tools=env.tools.schemas)
    for rows in _episode_rows(tok, env, caller):
        t_rows = cross.teacher_rows(rows)[0]
        got = cross.score(rows, ScoreRequest(k=None, sampled=True))
        for b in range(rows.num_rows):
            n = int(rows.attention_mask[b].sum())
            owners = rows.response_mask[b, :n].tolist()
            start = owners.index(1)
            turns, t = [], start  # the student's turns as text (EOS dropped), from the runs of its mask
            while t < n:
                e = t
                while e < n and owners[e]:
                    e += 1
                turns.append((t, e))
                t = e
                while t < n and not owners[t]:
                    t += 1
            msgs = [{"role": "user", "content": rows.prompts[b]}]
            for j, (t0, t1) in enumerate(turns[:-1]):
                msgs.append({"role": "assistant", "content": tok.decode(rows.input_ids[b, t0:t1],
                                                                        skip_special_tokens=True)})
                msgs += [{"role": "tool", "name": name, "content": text} for name, text in rows.tool_results[b][j]]
            head = render_chat(t_tok, msgs, add_generation_prompt=True, tools=env.tools.schemas)
            last = rows.input_ids[b, turns[-1][0]:turns[-1][1]].tolist()
            text = head + tok.decode(last, skip_special_tokens=True)
            ids = t_tok(text, add_special_tokens=False)["input_ids"] + ([t_tok.eos_token_id]
                                                                       if last[-1] == tok.eos_token_id else [])
            assert t_rows.input_ids[b, :len(ids)].tolist() == ids and int(t_rows.attention_mask[b].sum()) == len(ids)
            with torch.no_grad():
                lp = torch.log_softmax(copy.deepcopy(teacher).double()(torch.tensor([ids])).logits[0], -1)
            # student token at position p (owned) <-> teacher token at the same place of the hand-built row: walk
            # both rows turn by turn (every character is one token on both sides)
            firsts = [i for i, m in enumerate(t_rows.response_mask[b].tolist()) if m and
                      (i == 0 or not t_rows.response_mask[b, i - 1])]
            assert len(firsts) == len(turns)
            for (t0, t1), f in zip(turns, firsts):
                for i in range(t1 - t0):
                    s_pos, t_pos = t0 + i, f + i
                    ref = lp[t_pos - 1, ids[t_pos]].item()
                    assert abs(got.sampled_logprobs[b, s_pos - 1].item() - ref) < 1e-5, (b, s_pos)
                    assert cross.vmap.student.table[int(rows.input_ids[b, s_pos])] == \
                        cross.vmap.teacher.table[ids[t_pos]]  # the same character (or EOS) on both sides
        env_pos = ~rows.scored() & (torch.arange(rows.width)[None] >= rows.response_starts()[:, None] - 1)
        assert (got.sampled_logprobs[env_pos] == 0).all()
        assert got.sums["positions"] == float(rows.response_mask.sum()) == got.sums["exact"]


def test_episodes_without_their_tool_results_are_refused_by_a_cross_tokenizer_teacher(tok, env, caller):
    from opdistill.teachers.base import TeacherError
    from opdistill.teachers.xtok import CrossTokenizerTeacher

    rows = _episode_rows(tok, env, caller)[0]
    local = LocalTeacher(tiny_model(tok, seed=7))
    bare = dataclasses.replace(rows, tool_results=None)
    with pytest.raises(TeacherError, match=r"row 0 is an episode of 2 student turns, .* it needs 1 tool results in "
                                           r"Rows.tool_results, got none$"):
        CrossTokenizerTeacher(local, tok, tok, tools=env.tools.schemas).score(bare, ScoreRequest(sampled=True))
    with pytest.raises(TeacherError, match=r"it needs the run's tools \(CrossTokenizerTeacher\(tools=...\)\)$"):
        CrossTokenizerTeacher(local, tok, tok).score(rows, ScoreRequest(sampled=True))
    plain = tool_tokenizer(template="{{ bos_token }}{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}"
                                    "{% endif %}{% endfor %}")
    with pytest.raises(ConfigError, match=r"^xtok.mode: the chat template of .* writes no tool messages"):
        CrossTokenizerTeacher(local, tok, plain, tools=env.tools.schemas)


def _grads(student, data, budget, loss_cfg):
    model = copy.deepcopy(student).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    m = train_step(model, opt, data, loss_fn=DistillationLoss(loss_cfg), micro_batch_tokens=budget, grad_clip=None)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, m


@pytest.mark.parametrize("loss", [{"loss_mode": "topk", "support": "tail", "divergence": "reverse", "topk": 4},
                                  {"loss_mode": "sampled", "estimator": "k3",
                                   "loss_agg_mode": "seq-mean-token-mean"}])
def test_an_episode_step_is_the_same_at_any_split_and_the_environment_adds_nothing(tok, env, caller, loss):
    ro = _episode_batch(tok, env, caller)
    assert (ro.response_mask[:, 1:] < ro.attention_mask[:, 1:]).any()  # holes inside the episodes
    teacher = tiny_model(tok, seed=7).double()
    scores = LocalTeacher(teacher).score(Rows(ro.input_ids, ro.attention_mask, ro.response_mask),
                                         ScoreRequest(k=4, sampled=True))
    cfg = load_config(base={"model": {"student": "s", "teacher": "t"}, "loss": loss})
    data = StepData(ro.input_ids, ro.attention_mask, ro.response_mask, scores)
    big, m_big = _grads(caller, data, 10**6, cfg.loss)
    small, m_small = _grads(caller, data, 150, cfg.loss)
    assert m_small["train/micro_batches"] > 2
    for n in big:
        torch.testing.assert_close(small[n], big[n], rtol=1e-10, atol=1e-12, msg=n)
    assert m_small["distillation/loss"] == pytest.approx(m_big["distillation/loss"], rel=1e-10)
    # the environment's positions carry any scores: the step does not move (prompt, tools and padding are context)
    env_pos = torch.zeros_like(ro.response_mask, dtype=torch.bool)
    env_pos[:, :-1] = (ro.response_mask[:, 1:] == 0)
    noisy = copy.deepcopy(scores)
    g = torch.Generator().manual_seed(0)
    noisy.topk.logprobs[env_pos] = -torch.rand(noisy.topk.logprobs[env_pos].shape, generator=g) * 5
    noisy.topk.ids[env_pos] = torch.randint(0, len(tok), noisy.topk.ids[env_pos].shape, generator=g)
    noisy.sampled_logprobs[env_pos] = -torch.rand(noisy.sampled_logprobs[env_pos].shape, generator=g) * 5
    other, m_other = _grads(caller, StepData(ro.input_ids, ro.attention_mask, ro.response_mask, noisy), 10**6,
                            cfg.loss)
    for n in big:
        assert torch.equal(other[n], big[n]), n
    # and the gradient reaching the logits of an environment position is exactly 0
    logits = torch.randn(*ro.input_ids.shape, len(tok), dtype=torch.float64, requires_grad=True)
    targets, mask = shift_for_next_token(ro.input_ids, ro.response_mask)
    signal = scores.topk if cfg.loss.loss_mode == "topk" else TeacherSampled(scores.sampled_logprobs.double())
    loss_value, _ = DistillationLoss(cfg.loss)(logits, signal, mask, GlobalBatch.from_masks(mask), sampled_ids=targets)
    loss_value.backward()
    assert (logits.grad[~mask.bool()] == 0).all() and logits.grad[mask.bool()].abs().sum() > 0


def test_a_sharded_student_runs_episodes_of_different_lengths_in_step(tok, env, caller, tmp_path):
    """``distributed.decode: sharded`` (FSDP2, two gloo ranks): rank 0's episode has two turns, rank 1's one, and
    rank 1 takes part in rank 0's second turn with an empty one (else rank 0's gathers would wait forever); each
    rank's episode is the one the unsharded student writes."""
    from tests.parallel_launch import launch

    _save(caller, tok, tmp_path / "student")
    launch("tests.episode_helpers:sharded_episodes", 2, str(tmp_path))
    for rank, prompt in enumerate(["2+3", "hi"]):
        got = json.loads((tmp_path / f"episode_rank{rank}.json").read_text())
        ref = run_episodes(caller, tok, [env.prompt(prompt)], env, greedy=True, max_new_tokens=80)
        n = int(ref.attention_mask[0].sum())
        assert got["ids"] == ref.input_ids[0, :n].tolist() and got["mask"] == ref.response_mask[0, :n].tolist()
        assert got["sums"] == ref.episode_sums[0].tolist()
        assert got["sums"][EPISODE_SUMS.index("turns")] == [2, 1][rank]


def test_each_turn_has_its_own_key_and_turn_0_is_the_single_response_key():
    import hashlib

    from opdistill.engines.sampler import row_key

    old = int.from_bytes(hashlib.blake2b(b"opdistill.sampler:1:2:3:4", digest_size=8).digest(), "little")
    assert row_key(1, 2, 3, 4) == row_key(1, 2, 3, 4, turn=0) == old
    assert len({row_key(1, 2, 3, 4, turn=t) for t in range(4)}) == 4


# -- the trainer -------------------------------------------------------------------------------------------------------
def _save(model, tok, path):
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def episode_run(tmp_path_factory, tok, caller):
    """A config that trains the tool-calling student (a copy of it as the teacher) on episodes, tools from a file."""
    tmp = tmp_path_factory.mktemp("episodes")
    (tmp / "tools.py").write_text("def add(a: int, b: int) -> int:\n    \"\"\"Add two integers.\"\"\"\n"
                                  "    return a + b\n\n\ndef echo(text: str) -> str:\n    return text\n")
    rows = [{"prompt": p, "answer": t[-1]} for p, t in SCRIPTS[:2]]
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    student = _save(caller, tok, tmp / "student")
    teacher = _save(tiny_model(tok, seed=7), tok, tmp / "teacher")
    return tmp, {
        "run_dir": str(tmp / "run"), "model": {"student": student, "teacher": teacher},
        "data": {"task": "dataset", "path": str(tmp / "rows.jsonl"), "answer_field": "answer", "eval_path":
                 str(tmp / "rows.jsonl"), "answer_match": "exact", "prompts_per_step": 2},
        "rollout": {"n": 2, "max_new_tokens": 80},
        "loss": {"loss_mode": "topk", "support": "tail", "divergence": "reverse", "topk": 4},
        "optim": {"lr": 1e-4, "warmup_steps": 1},
        "train": {"steps": 2, "seed": 0, "threads": 1},
        "eval": {"every": 2, "num_prompts": 2, "batch_size": 2, "sampled": False},
        "checkpoint": {"every": 2, "keep_last": 1},
        "log": {"tensorboard": False, "progress": False},
        "env": {"tools": [f"{tmp / 'tools.py'}:add", f"{tmp / 'tools.py'}:echo"], "max_turns": 3,
                "max_episode_tokens": 120},
    }


@pytest.mark.parametrize("change", [{}, {"train": {"max_staleness": 1}, "rollout": {"correction": "none"}},
                                    {"env": {"tools": []}}], ids=["sequential", "pipelined", "tools-in-python"])
def test_the_trainer_runs_episodes_and_logs_what_the_environment_did(episode_run, change):
    from opdistill.train import run_training

    tmp, base = episode_run
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for section, values in change.items():
        cfg[section] = {**cfg[section], **values}
    given = {"tools": {"add": add, "echo": echo}} if change.get("env") else {}  # run_training(tools=...)
    summary = run_training(load_config(base=cfg), quiet=True, overwrite=True, **given)
    lines = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "env/turns" in m]
    assert len(steps) == 2
    for m in steps:
        for k in ("env/tool_calls", "env/bad_calls", "env/tool_errors", "env/cut_results", "env/used_tool",
                  "env/truncated", "env/env_tokens"):
            assert k in m, k
        assert m["env/turns"] > 1 and m["env/tool_calls"] > 0  # the student calls the tool, the run answers it
        assert m["env/used_tool"] > 0 and m["env/bad_calls"] < 1
    # the memorised student solves both held-out problems through the tool, greedily, at the start
    assert summary["eval_history"][0]["eval/greedy_acc"] == 1.0
    assert summary["eval_history"][0]["eval/greedy_used_tool"] == 1.0  # both episodes got the tool's answer


@pytest.mark.parametrize("method", ["on_policy", "off_policy"])
def test_an_identity_teacher_context_with_tools_is_the_plain_run(episode_run, tmp_path, method):
    """``teacher.context: {}`` is x' = x (SPEC 6.7): with tools its prompt lists them as the student's does, so the run
    equals the one without it: on-policy the teacher scores under it, off-policy it writes its episodes under it
    (the tool-calling student as the teacher) and they move onto the student's prompt."""
    from opdistill.train import run_training

    tmp, base = episode_run
    seen = []
    for context in (None, {}):
        run = tmp_path / f"run-{context is None}"
        cfg = {**base, "run_dir": str(run), "train": {**base["train"], "method": method}, "eval": {"every": 0},
               "checkpoint": {"every": 0}}
        if method == "off_policy":
            cfg["model"] = {"student": base["model"]["student"], "teacher": base["model"]["student"]}
        if context is not None:
            cfg["teacher"] = {"context": context}
        run_training(load_config(base=cfg), quiet=True)
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        seen.append([(m["distillation/loss"], m["env/tool_calls"], m["train/response_len"]) for m in lines
                     if "env/turns" in m])
    assert len(seen[0]) == 2 and seen[0] == seen[1]
    assert all(calls > 0 for _, calls, _ in seen[0])  # episodes with tool results between the turns


def test_a_cross_tokenizer_teacher_of_one_tokenizer_trains_on_episodes_as_the_plain_run(episode_run, tmp_path):
    """``xtok.mode: bpm`` with tools, the teacher's tokenizer the student's: the tool results reach the wrapper (the
    training step's rows and the evaluation's), the teacher's prompt lists the tools, and the run's losses and
    held-out teacher-KL equal the run without the wrapper."""
    from opdistill.train import run_training

    tmp, base = episode_run
    seen = []
    for xtok in ({}, {"mode": "bpm"}):
        run = tmp_path / f"run-{bool(xtok)}"
        cfg = {**base, "run_dir": str(run), "xtok": xtok, "checkpoint": {"every": 0},
               "eval": {**base["eval"], "sampled": True}}
        summary = run_training(load_config(base=cfg), quiet=True)
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in lines if "env/turns" in m]
        assert len(steps) == 2 and all(m["env/tool_calls"] > 0 for m in steps)
        seen.append(([m["distillation/loss"] for m in steps], summary["eval_history"][-1]["eval/teacher_kl"]))
        if xtok:
            assert all(m["xtok/exact_frac"] == 1.0 and m["xtok/masked_frac"] == 0.0 for m in steps)
    assert seen[1][0] == pytest.approx(seen[0][0], rel=1e-5) and seen[1][1] == pytest.approx(seen[0][1], rel=1e-5)


def test_a_teacher_cache_of_episodes_is_scored_and_trained_on(episode_run, tok, env, tmp_path):
    """``opdistill score`` with tools writes episodes (the writer's, with the tool results between its turns, the
    mask on its own tokens) and the teacher's scores of them; off-policy KD trains from that cache."""
    from opdistill.data import PromptSource
    from opdistill.teachers import load_cache
    from opdistill.train import run_training
    from opdistill.train.assemble import build_task
    from opdistill.train.commands import score_cache

    tmp, base = episode_run
    cfg = load_config(base={**base, "run_dir": str(tmp_path / "kd")})
    path, n_rows, tokens = score_cache(cfg, tmp_path / "cache.safetensors", num_prompts=2, writer="student")
    cache = load_cache(path)
    from opdistill.models import load_model

    writer = load_model(base["model"]["student"])
    problems = PromptSource(build_task(cfg), cfg.train.seed).batch(0, 2)
    torch.manual_seed(cfg.train.seed)
    ref = run_episodes(writer, tok, [env.prompt(p.prompt) for p in problems], env, n=2, temperature=1.0,
                       max_new_tokens=80, seed=cfg.train.seed, step=0)
    W = ref.input_ids.shape[1]
    assert n_rows == ref.num_rows == 4 and tokens == int(ref.response_mask.sum())
    for name in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(cache[name][:, :W], getattr(ref, name)), name
    assert ref.episode_sums[:, EPISODE_SUMS.index("used_tool")].sum() > 0  # holes: the tool's tokens, unscored
    assert (cache["scores"].sampled_logprobs[:, :-1][cache["response_mask"][:, 1:] == 0] == 0).all()
    kd = {**base, "run_dir": str(tmp_path / "kd"), "train": {**base["train"], "method": "off_policy"},
          "data": {**base["data"], "teacher_cache": str(path)}, "checkpoint": {"every": 0}}
    run_training(load_config(base=kd), quiet=True)
    lines = [json.loads(x) for x in (tmp_path / "kd" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "distillation/loss" in m] == [1, 2]
    assert all(m["train/response_len"] == tokens / n_rows for m in lines if "distillation/loss" in m)


def test_a_bad_tool_spec_and_tools_named_twice_are_refused_in_one_line(episode_run, tmp_path):
    from opdistill.train import run_training
    from opdistill.train.run.rules import check_config

    tmp, base = episode_run
    with pytest.raises(ConfigError) as e:
        check_config(load_config(base={**base, "env": {**base["env"], "tools": ["add"]}}))
    assert str(e.value) == "env.tools.0: expected 'module:function' or 'file.py:function', got 'add'"

    with pytest.raises(ConfigError, match=r"^tools: 1 given in Python and env.tools=\[.*\] in the config; name the "
                                          r"tools in one place$"):
        run_training(load_config(base={**base, "run_dir": str(tmp_path / "r")}), tools=[add], quiet=True)


def test_opdistill_check_reads_the_tools_and_the_template(episode_run, tmp_path):
    import subprocess
    import sys

    import yaml

    tmp, base = episode_run
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(base))
    r = subprocess.run([sys.executable, "-m", "opdistill.cli", "check", "--config", str(good)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**base, "env": {**base["env"], "tools": [f"{tmp / 'tools.py'}:nope"]}}))
    r = subprocess.run([sys.executable, "-m", "opdistill.cli", "check", "--config", str(bad)], capture_output=True,
                       text=True)
    errors = [x for x in r.stderr.strip().splitlines() if not x.startswith("opdistill: warning: ")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert "env.tools.0: " in r.stderr and "has no attribute 'nope'" in r.stderr


def test_an_episode_longer_than_the_positions_allow_is_refused_at_load(episode_run):
    """An episode takes env.max_episode_tokens after its prompt, and the prompt lists the tools: both are checked
    against the model's 512 positions before any weight loads (the budget of rollout.max_new_tokens is not enough)."""
    import re

    from opdistill.train.assemble import check_run

    tmp, base = episode_run
    with pytest.raises(ConfigError) as e:
        check_run(load_config(base={**base, "env": {**base["env"], "max_episode_tokens": 500}}))
    m = re.fullmatch(r"env.max_episode_tokens: expected at most (\d+) \(the model has 512 positions, (\d+) of them to "
                     r"list the tools, and a prompt needs at least one\), got 500", str(e.value))
    assert m and int(m.group(2)) > 10 and int(m.group(1)) == 511 - int(m.group(2)), str(e.value)
    fits = 512 - int(m.group(2)) - 9  # room for the prompts' own 9 tokens: BOS, "U:2+3", a newline, "A:"
    check_run(load_config(base={**base, "env": {**base["env"], "max_episode_tokens": fits}}))
    with pytest.raises(DataError, match=r"rows.jsonl:1: the prompt is 9 tokens, more than the 8 the model allows "):
        check_run(load_config(base={**base, "env": {**base["env"], "max_episode_tokens": fits + 1}}))


# -- the demo environment (lookup_add) ---------------------------------------------------------------------------------
def test_lookup_add_needs_the_tool_and_its_worked_episode_solves_it():
    import random

    from opdistill.data import LookupAdditionTask, lookup_value, make_task
    from opdistill.env.demo import TOOL_CHARS, TOOL_TEMPLATE, demo_environment, f
    from opdistill.models import char_tokenizer

    values = [lookup_value(k) for k in range(1000)]
    assert min(values) >= 100 and max(values) <= 999 and len(set(values)) > 500  # a table, not a formula of k
    assert lookup_value(137) == 532 and f(137) == 532  # fixed across versions and processes (a hash)
    task = make_task("lookup_add")
    assert isinstance(task, LookupAdditionTask)
    p = task.sample(random.Random(1))
    k, b = int(p.prompt[2:p.prompt.index(")")]), int(p.prompt.split("+")[1][:-1])
    assert p.prompt == f"f({k})+{b}=" and p.answer == str(lookup_value(k) + b)
    assert str(lookup_value(k)) not in p.prompt.split("+")[0]  # the value is in no prompt
    tok = char_tokenizer(TOOL_CHARS, chat_template=TOOL_TEMPLATE)
    env = demo_environment(tok)
    call_turn, answer_turn = task.script(p)
    answer = env.respond(call_turn)
    assert [o.text for o in answer.observations] == [str(lookup_value(k))]
    assert tok.decode(answer.ids) == f"{lookup_value(k)};"
    assert task.score(p, answer_turn) == 1.0 and task.score(p, call_turn) == 0.0
    assert env.respond('[{"name":"f","arguments":{"k":1000}}]').observations[0].text == (
        "error: f raised ValueError: no key 1000: keys are 0 to 999")
    assert env.respond(answer_turn) is None  # the answer calls nothing: the episode ends
    # answer: number (a chat model's last turn): the last number is the sum; worked examples say so
    chat = make_task("lookup_add", min_digits=1, max_digits=1, answer="number")
    q = chat.sample(random.Random(1))
    assert len(q.prompt.split("+")[1]) == 2 and chat.worked(q) == f"The answer is {q.answer}."  # "b=": one digit
    assert chat.score(q, f"f(3) = 9, so the sum is {q.answer}.") == 1.0
    assert chat.score(q, f"{q.answer} is not it: 7") == 0.0 and chat.score(q, q.solution) == 1.0  # its last number
    assert task.score(p, f"The answer is {p.answer}.") == 0.0  # worked (the demo's): the sum after the last '>'
    with pytest.raises(ConfigError, match=r"^data.task_args: lookup_add: expected answer 'worked' or 'number', got "
                                          r"'text'$"):
        make_task("lookup_add", answer="text")


def test_the_shipped_tools_config_matches_the_demo_environment():
    """configs/demo_tools.yaml is the tools demo's on-policy run (opdistill demo --tools builds the same)."""
    from pathlib import Path

    from opdistill.demo import demo_config
    from opdistill.env.demo import ENV_CONFIG

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "demo_tools.yaml")
    demo = load_config(base=demo_config(Path("x"), "on_policy", 0, 60.0, 25, 200, 1, tools=True))
    assert cfg.env.model_dump() == demo.env.model_dump() == {**cfg.env.model_dump(), **ENV_CONFIG}
    assert (cfg.model.student, cfg.model.teacher, cfg.data.task) == (demo.model.student, demo.model.teacher,
                                                                      "lookup_add")
