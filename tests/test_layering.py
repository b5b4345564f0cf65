"""The house's structure, checked on the source (docs/architecture.md): each layer imports only the layers below it,
no module imports itself back through others, and the few rules layers cannot say (the optimizer step knows nothing
of where scores come from) hold."""

import ast
from pathlib import Path

import opdistill

# lowest first; a module's layer is that of its longest matching prefix
LAYERS = [
    ["opdistill.errors", "opdistill.yaml12", "opdistill.durable", "opdistill.ops"],
    ["opdistill.batch", "opdistill.metrics"],
    ["opdistill.parallel", "opdistill.fused"],  # variants of the ops (fused reads parallel's stages)
    ["opdistill.loss.signals", "opdistill.loss.config"],  # the loss package, bottom-up
    ["opdistill.loss.backend"],
    ["opdistill.loss.distillation"],
    ["opdistill.loss", "opdistill"],  # the package root re-exports the loss layer and below
    ["opdistill.xtok"],  # tokens as bytes and the cross-tokenizer mapping (SPEC 6.6)
    ["opdistill.models", "opdistill.data", "opdistill.env"],
    ["opdistill.engines.sampler"],  # where student tokens come from, bottom-up
    ["opdistill.engines.rollout"],
    ["opdistill.engines.episodes"],
    ["opdistill.engines.vllm", "opdistill.engines"],
    # where teacher scores come from: the interface and the shared codecs, one class per source, the one choice
    ["opdistill.teachers.base", "opdistill.teachers.fingerprint", "opdistill.teachers.http", "opdistill.teachers.wire",
     "opdistill.teachers.prompt_logprobs", "opdistill.teachers.answers"],
    ["opdistill.teachers.local", "opdistill.teachers.cache", "opdistill.teachers.remote",
     "opdistill.teachers.stock_vllm", "opdistill.teachers.vllm", "opdistill.teachers.routed",
     "opdistill.teachers.xtok"],
    ["opdistill.teachers.sharded"],
    ["opdistill.teachers.build", "opdistill.teachers"],
    # a run's files read back (the trainer writes them in these formats)
    ["opdistill.runs.stats", "opdistill.runs.files", "opdistill.runs.outputs"],
    ["opdistill.runs.values"],
    ["opdistill.runs.compare", "opdistill.runs.plot", "opdistill.runs"],
    # the trainer, bottom-up: parts, the step and what feeds it, the assembly, the loop
    ["opdistill.train.run", "opdistill.train.disk", "opdistill.train.steps"],  # the three parts (docstrings only)
    ["opdistill.train.run.rules"],
    ["opdistill.train.run.config", "opdistill.train.run.placement", "opdistill.train.run.lora",
     "opdistill.train.run.optim", "opdistill.train.run.tensor_parallel", "opdistill.train.disk.wandb_log",
     "opdistill.train.run.interrupt"],
    ["opdistill.train.disk.rundir", "opdistill.train.run.distributed"],
    ["opdistill.train.disk.logger", "opdistill.train.disk.checkpoint", "opdistill.train.steps.step",
     "opdistill.train.disk.preflight", "opdistill.train.steps.evaluate", "opdistill.train.disk.inputs",
     "opdistill.train.steps.share"],
    ["opdistill.train.steps.collect", "opdistill.train.steps.pipeline"],
    ["opdistill.train.assemble"],
    ["opdistill.train.loop"],
    ["opdistill.train.commands"],
    ["opdistill.train", "opdistill.serve"],
    ["opdistill.demo", "opdistill.console"],
    ["opdistill.cli", "opdistill.__main__"],
]

# imports a layer would allow but the design does not: (importer prefix, imported prefix, why)
FORBIDDEN = [
    ("opdistill.train.steps.step", "opdistill.teachers", "the optimizer step knows nothing of where scores come from"),
    ("opdistill.train.steps.step", "opdistill.engines", "the optimizer step knows nothing of where rows come from"),
    ("opdistill.train.steps.step", "opdistill.data", "the optimizer step knows nothing of tasks or prompts"),
    ("opdistill.train.steps.step", "opdistill.train.steps.collect", "the step receives rows, scores and a plan"),
    ("opdistill.train.steps.step", "opdistill.loss.backend", "the trainer calls the loss, not a back-end"),
    ("opdistill.train", "opdistill.loss.backend", "the trainer calls the loss, not a back-end"),
    ("opdistill.teachers.local", "opdistill.teachers.build", "a teacher source never chooses another"),
    ("opdistill.serve", "opdistill.train", "the server scores through the teachers, not the trainer"),
]


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def imports_of(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "opdistill"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "opdistill":
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    root = Path(opdistill.__file__).parent
    graph = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        graph[module] = imports_of(path, module)
    return graph


def test_lower_layers_never_import_upper_ones():
    violations = []
    for module, targets in _graph().items():
        own = layer_of(module)
        for target in targets:
            if layer_of(target) > own:
                violations.append(f"{module} (layer {own}) imports {target} (layer {layer_of(target)})")
    assert not violations, "\n".join(violations)


def test_forbidden_imports():
    violations = [f"{module} imports {target}: {why}" for module, targets in _graph().items() for target in targets
                  for importer, imported, why in FORBIDDEN if _under(module, importer) and _under(target, imported)]
    assert not violations, "\n".join(violations)


def test_no_import_cycles():
    """No module reaches itself through the imports of others (a package's ``__init__`` counts as the package)."""
    graph = _graph()
    modules = set(graph)

    def resolve(target: str) -> str | None:  # ``from opdistill.x import name`` names the module opdistill.x
        while target and target not in modules:
            target = target.rsplit(".", 1)[0] if "." in target else ""
        return target or None

    edges = {m: {t for t in map(resolve, targets) if t and t != m} for m, targets in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_the_rules_can_fail():
    """The checks above see a violation when there is one (a module of a lower layer importing an upper one, a
    forbidden pair, a two-module cycle)."""
    assert layer_of("opdistill.engines.rollout") < layer_of("opdistill.engines.vllm")
    assert layer_of("opdistill.teachers.base") < layer_of("opdistill.train.steps.step")
    assert any(_under("opdistill.train.steps.step", a) and _under("opdistill.teachers.routed", b)
               for a, b, _ in FORBIDDEN)
