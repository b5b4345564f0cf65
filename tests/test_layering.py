"""Each layer imports only the layers below it (docs/architecture.md), checked on the source."""

import ast
from pathlib import Path

import opdistill

# lowest first; a module's layer is that of its longest matching prefix
LAYERS = [
    ["opdistill.ops"],
    ["opdistill.batch", "opdistill.metrics", "opdistill.parallel", "opdistill.fused"],
    ["opdistill.loss.signals", "opdistill.loss.config"],  # the loss package, bottom-up
    ["opdistill.loss.backend"],
    ["opdistill.loss.distillation"],
    ["opdistill.loss", "opdistill"],  # the package root re-exports the loss layer and below
    ["opdistill.models", "opdistill.data", "opdistill.engines", "opdistill.rollout", "opdistill.teacher"],
    ["opdistill.train", "opdistill.serve"],
    ["opdistill.demo"],
    ["opdistill.cli", "opdistill.__main__"],
]


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


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


def test_lower_layers_never_import_upper_ones():
    root = Path(opdistill.__file__).parent
    violations = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        own = layer_of(module)
        for target in imports_of(path, module):
            if layer_of(target) > own:
                violations.append(f"{module} (layer {own}) imports {target} (layer {layer_of(target)})")
    assert not violations, "\n".join(violations)
