"""What a run reads, fingerprinted when it starts, and compared whenever the run is read again.

A config names its inputs by path or URL: the student folder (for a LoRA student, the base its adapters sit on), the
teacher folder or the teacher server, named teachers, data files, a teacher cache. The config check of ``--resume``
sees the names only, so a folder whose weights were replaced, a server that now serves another model or a data
file rewritten in place would resume silently into a run that mixes two. So a run records, when it starts,
``RUN_DIR/inputs.json``: a fingerprint of each input, and ``--resume``, ``opdistill eval RUN_DIR`` and ``opdistill
export`` compute them again and refuse a change with a field-by-field diff, unless the user names it:
``--accept-changed NAME[,NAME]`` (a resume then appends the change to ``config_history.jsonl``, so the next resume
compares against the new fingerprint).

The fingerprints (:func:`local_inputs`, :func:`remote_inputs`):

==========================  ============================================================================================
input                       fingerprint
==========================  ============================================================================================
``model.student``           a model folder: SHA-256 over every weight tensor (name, dtype, shape, bytes; read one
``model.teacher``           tensor at a time from the safetensors files, cast to ``model.dtype``: the hash a teacher
``teachers.<name>`` (path)  server's ``/info`` and a teacher cache state), the config's hash, dtype, vocabulary width,
                            and the tokenizer's (vocabulary, special tokens, chat template) hash and size. Weights are
                            always hashed in full: a resume reads them once more (about 1-2 GB/s).
``teacher`` (``teacher.url``, our server)   the same fields from its ``/info`` (so a server serving the folder a run
``teachers.<name>`` (url)                   started with compares equal to it: ``teacher.url`` may change on resume)
a stock ``vllm serve``      the served model's name only (its API states no fingerprint; docs/teacher_service.md)
``data.path``,              a file up to 64 MiB: its SHA-256 (``"method": "sha256"``); a larger file: its size, its
``data.eval_path``,         modification time (ns) and the SHA-256 of 16 blocks of 64 KiB spread over it, the first and
``data.teacher_cache``      the last included (``"method": "size+mtime+sample"``: a copy that does not keep the
                            modification time reads as a change); a folder: each of its files so; a hub dataset name:
                            the name only (not verifiable offline)
``data.task``               every run's task (the config's, or a Python task object): its class and the SHA-256 of its
                            first 64 problems from seed 0 and first 64 held-out ones (:func:`object_inputs`)
model objects               handed to ``run_training(models=...)``: a folder's fields, computed from the objects
==========================  ============================================================================================

A comparison reads only the inputs the command reads (``export`` reads the student; ``eval`` the student, the teacher
and the data) and, within an input, the fields both fingerprints hold (where it lives, ``source``, is not compared:
a teacher may move to a server).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import warnings
from pathlib import Path

from opdistill.errors import RunError, RunWarning

__all__ = ["INPUTS_FILE", "LARGE_FILE_BYTES", "file_fingerprint", "path_fingerprint", "model_fingerprint",
           "local_inputs", "remote_inputs", "input_changes", "format_changes", "effective_inputs", "check_inputs",
           "record_inputs", "parse_accept_changed"]

INPUTS_FILE = "inputs.json"
LARGE_FILE_BYTES = 64 << 20  # above this a file is fingerprinted by size, mtime and 16 sampled blocks
_SAMPLE_BLOCKS, _SAMPLE_BYTES = 16, 64 << 10
_NOT_COMPARED = ("kind", "source")
_CHUNK = 1 << 20


# -- fingerprints -----------------------------------------------------------------------------------------------------
def file_fingerprint(path: str | os.PathLike) -> dict:
    """A file's fingerprint: its SHA-256 up to :data:`LARGE_FILE_BYTES`, else size + mtime + sampled blocks."""
    path = Path(path)
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if st.st_size <= LARGE_FILE_BYTES:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
            return {"method": "sha256", "size": st.st_size, "sha256": h.hexdigest()}
        last = st.st_size - _SAMPLE_BYTES
        for i in range(_SAMPLE_BLOCKS):
            f.seek(last * i // (_SAMPLE_BLOCKS - 1))
            h.update(f.read(_SAMPLE_BYTES))
    return {"method": "size+mtime+sample", "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sample_sha256": h.hexdigest()}


def path_fingerprint(path: str | os.PathLike) -> dict:
    """A file's :func:`file_fingerprint`, or a folder's: every regular file below it (hidden names skipped)."""
    path = Path(path)
    if path.is_file():
        return {"kind": "file", "source": str(path), **file_fingerprint(path)}
    files = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            fp = file_fingerprint(p)
            files[str(rel)] = fp.get("sha256") or f"{fp['size']}:{fp['mtime_ns']}:{fp['sample_sha256']}"
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"kind": "folder", "source": str(path), "files": len(files), "files_sha256": digest}


def _weight_files_sha256(folder: Path) -> str:
    """Fallback when the tensor hash cannot be made without loading the model: the weight files' fingerprints."""
    files = {p.name: file_fingerprint(p) for p in sorted(folder.iterdir())
             if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf")}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def model_fingerprint(name: str, *, dtype: str, trust_remote_code: bool, key: str) -> dict:
    """A model folder's fingerprint (module notes); ``name`` is a folder, a ``builtin:`` name or a cached hub id."""
    from opdistill.models import load_tokenizer, resolve_model_path
    from opdistill.teachers.fingerprint import teacher_fingerprint_from_folder, tokenizer_fingerprint

    folder = Path(resolve_model_path(name)).expanduser()
    if not folder.is_dir():
        try:  # a hub id: its cached snapshot, when there is one
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(str(name), local_files_only=True))
        except Exception:  # noqa: BLE001 -- nothing cached: a hub id cannot be fingerprinted offline
            return {"kind": "hub id", "source": str(name)}
    out: dict = {"kind": "model folder", "source": str(name)}
    fp = teacher_fingerprint_from_folder(folder, dtype=dtype, trust_remote_code=trust_remote_code)
    if fp is not None:
        out.update({k.removeprefix("teacher_"): v for k, v in fp.items()})
    else:
        out["weight_files_sha256"] = _weight_files_sha256(folder)
    out.update(tokenizer_fingerprint(load_tokenizer(folder, trust_remote_code=trust_remote_code, key=key)))
    return out


def local_inputs(cfg, *, only: tuple[str, ...] | None = None, given: dict | None = None) -> dict[str, dict]:
    """The fingerprints of what ``cfg``'s run reads from files (``only``: those input names): the student folder,
    the in-process teacher folders, the data files. The servers' come from :func:`remote_inputs`. ``given``: the
    fingerprints of the objects a Python caller handed in (:func:`object_inputs`), in place of the files the config
    names for them."""
    mc, dc = cfg.model, cfg.data
    kw = dict(dtype=mc.dtype, trust_remote_code=mc.trust_remote_code)
    given = given or {}
    want = (lambda n: n not in given) if only is None else (lambda n: n in only and n not in given)
    out = {}
    if want("model.student"):
        out["model.student"] = model_fingerprint(mc.student, key="model.student", **kw)
    if want("teacher") and mc.teacher and mc.teacher != "self" and cfg.teacher.url is None:
        out["teacher"] = model_fingerprint(mc.teacher, key="model.teacher", **kw)
    for i, spec in enumerate(cfg.teachers or []):
        if spec.path is not None and want(f"teachers.{spec.name}"):
            out[f"teachers.{spec.name}"] = model_fingerprint(spec.path, key=f"teachers.{i}.path", **kw)
    for key, value in (("data.path", dc.path if dc.task == "dataset" else None),
                       ("data.eval_path", dc.eval_path), ("data.teacher_cache", dc.teacher_cache)):
        if value and want(key):
            out[key] = path_fingerprint(value) if os.path.exists(value) else {"kind": "hub dataset", "source": value}
    return out | {n: v for n, v in given.items() if only is None or n in only}


def _base_state(model) -> dict:
    """A model's tensors as its folder holds them: a LoRA student's (adapters injected by run/lora.py) without the
    adapters, each wrapped layer's weight under its own name (what the folder's fingerprint, the base's, hashes)."""
    state = model.state_dict()
    if not any(".base_layer." in k for k in state):
        return state
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}


TASK_PROBLEMS_HASHED = 64  # a task handed in Python: the problems its fingerprint hashes


def object_inputs(models=None, task=None) -> dict[str, dict]:
    """The fingerprints of the objects a run reads: ``models`` a Python caller handed to ``run_training`` in place of
    the config's folders (tok, student, teacher: a model, ``{name: model}`` or None), as a folder's fingerprint of
    the same models reads (weights, config, dtype, vocabulary, tokenizer); and the run's ``task`` (``data.task``:
    the config's or one handed in), its class and the SHA-256 of its first :data:`TASK_PROBLEMS_HASHED` problems
    drawn from seed 0 and of its first as many held-out problems (``held_out(n, 0)``)."""
    import dataclasses
    import random

    from opdistill.teachers.fingerprint import canonical_json, teacher_fingerprint, tokenizer_fingerprint

    out = {}
    if models is not None:
        tok, student, teacher = models
        named = teacher if isinstance(teacher, dict) else {"": teacher}
        for name, model in {"model.student": student, **{("teachers." + n if n else "teacher"): m
                                                         for n, m in named.items() if m is not None}}.items():
            if name == "teacher" and model is student:  # model.teacher: self, handed in as the student itself
                continue
            fp = teacher_fingerprint(model, _base_state(model))
            out[name] = {"kind": "model object", "source": type(model).__name__,
                         **{k.removeprefix("teacher_"): v for k, v in fp.items()}, **tokenizer_fingerprint(tok)}
    if task is not None:
        rng = random.Random(0)
        problems = [task.sample(rng) for _ in range(TASK_PROBLEMS_HASHED)]
        problems += list(task.held_out(TASK_PROBLEMS_HASHED, 0) or [])
        digest = hashlib.sha256(canonical_json([dataclasses.asdict(p) for p in problems])).hexdigest()
        out["data.task"] = {"kind": "task", "source": type(task).__qualname__, "problems_sha256": digest}
    return out


def _server_input(client) -> dict:
    client = client.served_by()  # through any wrapper (cross-tokenizer, context): the client of the server(s)
    info = client.info or {}
    if "served" in info:  # a stock vllm serve endpoint: its served model only
        return {"kind": "vllm server", "source": client.url, "served_model": info.get("model")}
    out = {"kind": "server", "source": client.url}
    for field in ("teacher_config_sha256", "teacher_weights_sha256", "teacher_dtype", "teacher_vocab_size",
                  "tokenizer_sha256", "tokenizer_vocab_size"):
        if field in info:
            out[field.removeprefix("teacher_")] = info[field]
    return out


def remote_inputs(cfg, teachers) -> dict[str, dict]:
    """The fingerprints of the servers ``teachers`` (:class:`~opdistill.teachers.Teachers`, connected: their
    ``/info`` read) scores with: ``teacher`` (``teacher.url``) and ``teachers.<name>`` (a url entry)."""
    out = {}
    if cfg.teacher.url is not None:
        client = teachers.train or teachers.eval
        if client is not None:
            out["teacher"] = _server_input(client)
    members = teachers.train.named() if teachers.train is not None else {}
    for spec in cfg.teachers or []:
        if spec.url is not None and spec.name in members:
            out[f"teachers.{spec.name}"] = _server_input(members[spec.name])
    return out


# -- comparison ---------------------------------------------------------------------------------------------------------
def input_changes(recorded: dict, current: dict) -> dict[str, dict[str, tuple]]:
    """``{input: {field: (recorded, current)}}`` over the inputs ``current`` holds that ``recorded`` holds too, and
    the fields both fingerprints hold (``kind`` and ``source`` excepted)."""
    out = {}
    for name, now in current.items():
        then = recorded.get(name)
        if not isinstance(then, dict):
            continue
        diff = {f: (then[f], now[f]) for f in sorted(set(then) & set(now)) if f not in _NOT_COMPARED
                and then[f] != now[f]}
        if diff:
            out[name] = diff
    return out


def _short(v):
    return v[:12] if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v) else v


def format_changes(changes: dict) -> str:
    return ", ".join(f"{name}.{field} {_short(a)!r} -> {_short(b)!r}" for name, diff in changes.items()
                     for field, (a, b) in diff.items())


def parse_accept_changed(values) -> tuple[str, ...]:
    """``--accept-changed`` values (repeatable, comma-separated) as input names."""
    return tuple(n.strip() for v in values or () for n in v.split(",") if n.strip())


# -- the record in the run directory -------------------------------------------------------------------------------------
def effective_inputs(run_dir: str | os.PathLike) -> dict | None:
    """The run's recorded fingerprints with every accepted change of ``config_history.jsonl`` applied in order, or
    None when the run has no record (it started before this version)."""
    from opdistill.runs.files import read_jsonl

    path = Path(run_dir) / INPUTS_FILE
    if not path.is_file() or path.is_symlink():
        return None
    try:
        record = json.loads(path.read_text())
        inputs = dict(record["inputs"])
        if not all(isinstance(v, dict) for v in inputs.values()):
            raise TypeError("an input's fingerprint is not an object")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise RunError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]}); the run's record of what it reads "
                       f"is damaged (delete it to record the current inputs at the next --resume)") from None
    history = Path(run_dir) / "config_history.jsonl"
    for i, row in enumerate(read_jsonl(history), 1):
        changes = row.get("inputs") if isinstance(row, dict) else None
        if changes is None:
            continue
        if not isinstance(changes, dict) or not all(isinstance(c, dict) and isinstance(c.get("to"), dict)
                                                    for c in changes.values()):
            raise RunError(f"{history}: row {i}: 'inputs' is not {{name: {{\"from\", \"to\"}}}}; the run's history "
                           f"is damaged")
        for name, change in changes.items():
            inputs[name] = change["to"]
    return inputs


def check_inputs(run_dir, current: dict, accept: tuple[str, ...], *, what: str) -> dict[str, dict]:
    """Compare ``current`` with the run's record (:func:`effective_inputs`); refuse a change not named in ``accept``
    with the diff of every changed field (:class:`RunError`, ``what``: the command, e.g. ``--resume``). Returns the
    accepted changes ``{input: {"from": recorded, "to": current}}``."""
    recorded = effective_inputs(run_dir)
    known = sorted(set(current) | set(recorded or {}))
    unknown = [n for n in accept if n not in known]
    if unknown:
        raise RunError(f"--accept-changed: {', '.join(map(repr, unknown))} is not an input of run {run_dir} (its "
                       f"inputs: {', '.join(known)})")
    if recorded is None:
        if what != "--resume":  # a resume records them now (record_inputs warns there)
            warnings.warn(f"{what}: run {run_dir} has no record of what it reads ({INPUTS_FILE}: it started before "
                          f"opdistill kept one, or the file was removed); its inputs are not compared", RunWarning,
                          stacklevel=2)
        return {}
    changes = input_changes(recorded, current)
    refused = {n: d for n, d in changes.items() if n not in accept}
    if refused:
        raise RunError(f"{what}: what run {run_dir} reads has changed since it was recorded: "
                       f"{format_changes(refused)}; give the run the inputs it started with, or name the changes to "
                       f"accept them: --accept-changed {','.join(refused)}")
    return {n: {"from": recorded[n], "to": current[n]} for n in changes}


def record_inputs(rd, inputs: dict, accepted: dict, *, step: int) -> None:
    """Write the run's record: ``inputs.json`` when the run has none (a fresh run, or one that started before this
    version: then with a warning), else the accepted changes appended to ``config_history.jsonl``."""
    from opdistill.train.disk.rundir import append_history, atomic_write_text

    path = rd.path / INPUTS_FILE
    if not os.path.lexists(path):
        if step > 0:
            warnings.warn(f"{rd.path} has no record of what it reads ({INPUTS_FILE}: it started before opdistill "
                          f"recorded one); recording the current inputs now, at step {step}", RunWarning,
                          stacklevel=3)
        record = {"recorded_at_step": step, "inputs": inputs}
        atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
        return
    if accepted:
        append_history(rd, {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "resumed_at_step": step, "inputs": accepted})
