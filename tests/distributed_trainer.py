"""Launch target of tests/test_trainer_distributed.py: the trainer at world size 2 (gloo), several runs in one launch.

``plan.json`` in ``out_dir`` lists the runs (name, config dict, options); each rank runs them in order. An item
``{"sharded_teacher_scores": teacher folder}`` compares the sharded teacher's scores with the replicated one's instead. The tokens
every rank sampled are recorded per step (``{name}_tokens_rank{r}.json``) by wrapping the loop's
``generate_rollouts``, so the test can compare them with the one-process run's.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from opdistill.engines import vllm as engines  # EngineSet: the loop's rollouts go through its generate_rollouts
from opdistill.train import loop
from opdistill.train.run.config import load_config


def record_rollouts(sink: dict, calls: list | None = None):
    """Wrap ``EngineSet.generate_rollouts`` (where the loop's rollouts are made: our sampler or a vLLM student
    engine) so that each call's rows (their tokens, keyed by step and global prompt index) land in ``sink``, and
    each call's step in ``calls``; returns a function that restores the original."""
    original = engines.EngineSet.generate_rollouts

    def recording(self, *args, step, prompt_offset=0, **kwargs):
        if calls is not None:
            calls.append(step)
        ro = original(self, *args, step=step, prompt_offset=prompt_offset, **kwargs)
        for row, p in enumerate(ro.prompt_index):
            tokens = ro.input_ids[row][ro.attention_mask[row].bool()].tolist()
            sink.setdefault(str(step), {}).setdefault(str(prompt_offset + p), []).append(tokens)
        return ro

    engines.EngineSet.generate_rollouts = recording
    return lambda: setattr(engines.EngineSet, "generate_rollouts", original)


class count_teacher_requests:
    """Wrap ``Collector.ask`` (where a training step asks its teacher: a server request, an in-process or sharded
    forward) to record the steps this rank asked for; ``restore()`` puts the original back."""

    def __init__(self):
        from opdistill.train.steps import collect

        self.steps: list[int] = []
        self.cls, self.original = collect.Collector, collect.Collector.ask
        original, steps = self.original, self.steps

        def counting(collector, batch):
            steps.append(batch.step)
            return original(collector, batch)

        self.cls.ask = counting

    def restore(self) -> None:
        self.cls.ask = self.original


class watch_sharded_decoding:
    """Wrap ``Lockstep.logits`` (every forward of a decode from the FSDP2 student, real or in step) to count the
    forwards, and those after which the student's input embedding was held whole (FSDP2 gathered the root); and
    ``load_models`` to record whether the student was built without its weights (read shard by shard)."""

    def __init__(self):
        from torch.distributed.tensor import DTensor

        from opdistill.engines import sampler
        from opdistill.train import assemble

        self.seen = {"forwards": 0, "root_gathered": 0, "student_shards": None}
        self.cls, self.original = sampler.Lockstep, sampler.Lockstep.logits
        self.assemble, self.load_models = assemble, assemble.load_models
        original, seen, load_models = self.original, self.seen, self.load_models

        def watching(lock, model, *args, **kwargs):
            out = original(lock, model, *args, **kwargs)
            seen["forwards"] += 1
            seen["root_gathered"] += not isinstance(model.get_input_embeddings().weight, DTensor)
            return out

        def loading(*args, **kwargs):
            seen["student_shards"] = kwargs.get("student_shards", False)
            tok, student, teacher = load_models(*args, **kwargs)
            if seen["student_shards"]:
                assert all(p.is_meta for p in student.parameters()), "a student built with its weights"
            return tok, student, teacher

        self.cls.logits = watching
        assemble.load_models = loading

    def restore(self) -> None:
        self.cls.logits = self.original
        self.assemble.load_models = self.load_models


def run_plan(rank: int, world: int, out_dir: str) -> None:
    plan = json.loads((Path(out_dir) / "plan.json").read_text())
    for item in plan:
        if "sharded_teacher_scores" in item:  # not a run: the sharded teacher's scores (tests/test_trainer_distributed.py)
            result = sharded_teacher_scores(rank, world, item["sharded_teacher_scores"])
            (Path(out_dir) / f"sharded_scores_rank{rank}.json").write_text(json.dumps(result))
            continue
        cfg = load_config(base=item["config"])
        if item.get("prepare_resume_from") is not None:  # a copy of a finished run cut back to one checkpoint
            if rank == 0:
                src, dst = Path(item["prepare_resume_from"]), Path(cfg.run_dir)
                shutil.copytree(src, dst)
                for ckpt in (dst / "checkpoints").iterdir():
                    if int(ckpt.name.split("_")[1]) > item["resume_step"]:
                        shutil.rmtree(ckpt)
            dist.barrier()
        sink: dict = {}
        calls: list = []
        restore = record_rollouts(sink, calls)
        requests = count_teacher_requests()
        decoding = watch_sharded_decoding()
        try:
            loop.run_training(cfg, resume=item.get("resume", False), quiet=True)
        finally:
            restore()
            requests.restore()
            decoding.restore()
        with open(os.path.join(out_dir, f"{item['name']}_decoding_rank{rank}.json"), "w") as f:
            json.dump(decoding.seen, f)
        with open(os.path.join(out_dir, f"{item['name']}_generates_rank{rank}.json"), "w") as f:
            json.dump(calls, f)
        with open(os.path.join(out_dir, f"{item['name']}_tokens_rank{rank}.json"), "w") as f:
            json.dump(sink, f)
        with open(os.path.join(out_dir, f"{item['name']}_requests_rank{rank}.json"), "w") as f:
            json.dump(requests.steps, f)


def sharded_teacher_scores(rank: int, world: int, teacher_dir: str) -> dict:
    """``ShardedTeacher.score`` against the replicated teacher's (``LocalTeacher.score``) on rows whose counts differ by rank
    (rank 0: 5 rows with a chunk of no response position; the others: 2), then with no row at all on the last rank,
    at ``row_chunk`` 2 (3 chunks vs 1: the short ranks run padding forwards) and at the default 64. Returns what the
    test checks: every compared tensor exactly equal, the forwards run, whether the weights are sharded again."""
    import torch
    from torch.distributed.tensor import DTensor

    from opdistill.models import empty_model, load_model
    from opdistill.teachers import LocalTeacher, Rows, ScoreRequest, ShardedTeacher

    def rows(n, seed, S=9):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (n, S), generator=g)
        am = torch.ones(n, S, dtype=torch.long)
        am[:, :2] = (torch.arange(n)[:, None] % 2 == 0).long()  # left padding on every other row
        resp = torch.zeros(n, S, dtype=torch.long)
        resp[:, 5:] = 1
        if n >= 4:
            resp[2:4] = 0  # rows 2-3 (chunk 1 at row_chunk 2): nothing scored there
        return ids, am, resp

    vocab = load_model(teacher_dir).config.vocab_size
    mesh = init_device_mesh_cpu(world)
    out = {"exact": [], "forwards": [], "sharded_after": [], "local_fraction": []}
    for row_chunk, source in ((2, "loaded"), (64, "loaded"), (2, "shards")):
        reference = load_model(teacher_dir)
        # "shards": built on the meta device, each rank reading only its rows from the safetensors file
        model = load_model(teacher_dir) if source == "loaded" else empty_model(teacher_dir)
        sharded = ShardedTeacher(model, mesh, mesh.get_group(), row_chunk=row_chunk)
        cases = [(5 if rank == 0 else 2, dict(k=4, sampled=True)),
                 (0 if rank == world - 1 else 3, dict(k=None, sampled=True)),
                 (3 if rank == 0 else 1, dict(k=4, sampled=False))]
        for n, kw in cases:
            ids, am, resp = rows(n, seed=10 * rank + n)
            got = sharded.score(Rows(ids, am, resp), ScoreRequest(**kw))
            want = LocalTeacher(reference).score(Rows(ids, am, resp), ScoreRequest(**kw)) if n else None
            pairs = []
            if kw["k"]:
                pairs += [(got.topk.ids, None if want is None else want.topk.ids),
                          (got.topk.logprobs, None if want is None else want.topk.logprobs)]
            if kw["sampled"]:
                pairs.append((got.sampled_logprobs, None if want is None else want.sampled_logprobs))
            out["exact"].append(all((g.shape[0] == 0) if w is None else (g.shape == w.shape and torch.equal(g, w))
                                    for g, w in pairs))
        out["forwards"].append(sharded.forwards)
        w = sharded.model.get_output_embeddings().weight
        out["sharded_after"].append(isinstance(w, DTensor) and w.to_local().shape[0] < w.shape[0])
        local = sum(p.to_local().numel() for p in sharded.model.parameters())
        out["local_fraction"].append(local / sum(p.numel() for p in reference.parameters()))
    out["refused"] = _bad_shards(rank, teacher_dir, mesh)
    return out


def _bad_shards(rank: int, teacher_dir: str, mesh) -> dict:
    """The messages of ``models.load_shards`` (through ``ShardedTeacher``) for a folder whose final norm weight is
    missing, of another shape, or NaN on one rank's rows only (each rank its own copy of the folder)."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    from opdistill.errors import ModelError
    from opdistill.models import empty_model
    from opdistill.teachers import ShardedTeacher

    out = {}
    for case in ("missing", "shape", "nan"):
        bad = Path(tempfile.mkdtemp()) / "teacher"
        shutil.copytree(teacher_dir, bad)
        sd = load_file(str(bad / "model.safetensors"))
        name = "model.norm.weight"
        if case == "missing":
            sd["model.norm.renamed"] = sd.pop(name)
        elif case == "shape":
            sd[name] = sd[name][:-1].clone()
        else:  # a NaN in the last row: on the last rank's shard only, so the others learn it from the vote
            sd[name] = sd[name].clone()
            sd[name][-1] = float("nan")
        save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
        try:
            ShardedTeacher(empty_model(bad), mesh, mesh.get_group())
        except ModelError as e:
            out[case] = str(e).replace(str(bad), "<folder>")
        finally:
            shutil.rmtree(bad.parent)
    return out


def init_device_mesh_cpu(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
