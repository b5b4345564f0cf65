"""`opdistill demo` end to end at a tiny budget: packaged models load, every method runs, the table is written."""
import json

import pytest

from opdistill.demo import run_demo
from opdistill.models import load_model
from opdistill.models import resolve_model_path
from opdistill.runs.stats import paired_difference


@pytest.mark.parametrize("pair", ["demo-", "demo-tool-"])
def test_packaged_demo_models_are_small_and_load(pair):
    for name in (f"builtin:{pair}teacher", f"builtin:{pair}student"):
        path = resolve_model_path(name)
        model = load_model(path)
        assert sum(p.numel() for p in model.parameters()) < 1_000_000
    t = load_model(resolve_model_path(f"builtin:{pair}teacher"))
    s = load_model(resolve_model_path(f"builtin:{pair}student"))
    assert s.config.num_hidden_layers < t.config.num_hidden_layers


def test_the_tools_demo_runs_episodes_and_reports_tool_use(tmp_path):
    """``opdistill demo --tools``: the packaged tool-using teacher solves lookup_add through its tool, every method
    runs episodes, and the table and figure carry the share of episodes that used the tool and of bad calls."""
    lines = []
    res = run_demo(tmp_path, budget_s=1.0, seeds=(0,), eval_every=2, eval_prompts=8, threads=1, log=lines.append,
                   tools=True)
    assert res["teacher"]["eval/greedy_acc"] >= 0.75  # through the tool: no prompt holds the value
    table = (tmp_path / "demo_table.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| method |"))
    assert header.endswith("| episodes using the tool | bad calls |")
    for method in ("on_policy", "off_policy", "rl"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {method} | 0 |"))
        assert row.count("->") == 5, row  # greedy, sampled, teacher-KL, tool use, bad calls: first -> last
        first = json.loads((tmp_path / f"{method}-seed0" / "metrics.jsonl").read_text().splitlines()[1])
        assert "env/used_tool" in first and "env/bad_calls" in first
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_runs_and_writes_the_table(tmp_path, capfd):
    lines = []
    res = run_demo(tmp_path, budget_s=1.0, seeds=(0,), eval_every=2, eval_prompts=6, threads=1, log=lines.append)
    # what to expect, said before the first silent minute; a progress bar over each run's training seconds
    assert lines[0] == ("opdistill demo: 3 methods x 1 seed(s), 1 s of training each (0.1 min of training), plus an "
                        "evaluation on 6 held-out problems every 2 steps (the README's run with the defaults: 405 s "
                        "in all on 2 CPU cores). A bar shows each run's training seconds.")
    assert lines[1].startswith("Equal time means each method trains 1 s: how many steps fit depends on this "
                               "machine's speed and load")
    assert lines[2] == "evaluating the teacher on 6 held-out problems ..."
    assert [line for line in lines if line.endswith("training for 1 s ...")] == [
        f"[{m} seed 0] training for 1 s ..." for m in ("on_policy", "off_policy", "rl")]
    bars = capfd.readouterr().err
    for m in ("on_policy", "off_policy", "rl"):
        assert f"{m}-seed0: 100%|" in bars and "/1 s of training [" in bars
    assert set(res["machine"]) == {"start", "end"} and res["machine"]["start"]["cpus"] >= 1
    table = (tmp_path / "demo_table.md").read_text()
    assert "| on_policy | 0 |" in table and "| off_policy | mean |" in table and "| rl | 0 |" in table
    seed_row = next(line for line in table.splitlines() if line.startswith("| on_policy | 0 |"))
    assert seed_row.count("[") == 2  # final greedy accuracy and teacher-KL with their 95% intervals
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["teacher"]["eval/greedy_acc"] >= 0.5  # the packaged teacher solves the task (6 problems here)
    saved = json.loads((tmp_path / "demo_results.json").read_text())
    assert saved["equal_steps"] % 2 == 0 and saved["equal_steps"] <= min(
        r["steps"] for rs in saved["runs"].values() for r in rs)
    for method in ("on_policy", "off_policy", "rl"):
        assert (tmp_path / f"{method}-seed0" / "metrics.jsonl").exists()
    # each method minus on-policy, paired over the same held-out problems, from the values every run kept
    assert set(saved["differences"]) == {"off_policy", "rl"}

    def acc(method, step):  # (correct, problems) of one evaluation, read back from the run's values file
        v = json.loads((tmp_path / f"{method}-seed0" / "eval" / f"step_{step:06d}.json").read_text())
        return v["greedy_correct"], v["problems"]

    last = {m: saved["histories"][m]["0"][-1]["step"] for m in saved["methods"]}
    s_eq = saved["equal_steps"]
    for method in ("off_policy", "rl"):
        d = saved["differences"][method]
        for key, a, b in (("acc", acc(method, last[method]), acc("on_policy", last["on_policy"])),
                          ("acc_eq", acc(method, s_eq), acc("on_policy", s_eq))):
            point = sum(a[0]) / sum(a[1]) - sum(b[0]) / sum(b[1])
            iv = paired_difference([a], [b])
            assert d[key] == pytest.approx([point, iv.lo, iv.hi], abs=1e-12)
    assert "| off_policy - on_policy |" in table and "| rl - on_policy |" in table
    # equal steps at the start (a run made fewer steps than the interval): the table says why (issue 35 item 3)
    from opdistill.demo import format_table

    for s_eq, said in ((0, True), (2, False)):
        rows = {m: [{**r, "acc_eq": r["acc"], "kl_eq": r["kl"]} for r in rs] for m, rs in saved["runs"].items()}
        text = format_table({**saved, "equal_steps": s_eq, "runs": rows})
        assert ("(the start: a run made fewer steps than the evaluation interval in its budget" in text) == said
