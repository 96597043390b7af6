"""requirements.txt, the README's install: it names every package the code imports, and the
sections it points to exist."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements.txt"
OWN = ("recognition", "benchmarks", "train", "evaluate", "tests")
# Imported, and installed by what requirements.txt names: the reason each is not named.
CARRIED = {"triton": "torch's CUDA build installs the Triton it was built against"}


def required() -> set[str]:
    """The distributions requirements.txt names, normalised (lower case, '-' for '_')."""
    names = set()
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def imported() -> dict[str, str]:
    """{top-level module the code imports: a file that imports it}, the standard library's
    and the project's own left out."""
    files = [*(ROOT / "recognition").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    found: dict[str, str] = {}
    for path in [*files, ROOT / "train.py", ROOT / "evaluate.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OWN:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_required():
    distributions = packages_distributions()
    names = required()
    missing = []
    for module, where in sorted(imported().items()):
        if module in CARRIED:
            continue
        dists = [d.lower().replace("_", "-") for d in distributions.get(module, [module])]
        if not names.intersection(dists):
            missing.append(f"{module} ({', '.join(dists)}; imported by {where})")
    assert not missing, f"imported but not in requirements.txt: {missing}"


def test_the_sections_requirements_points_to_exist():
    text = " ".join(REQUIREMENTS.read_text().split())
    pointers = re.findall(r"(README|docs/[\w-]+\.md)'s \"([^\"]+)\"", text)
    assert pointers, "requirements.txt says where its pins are explained"
    for page, section in pointers:
        path = ROOT / ("README.md" if page == "README" else page)
        headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
        assert section in headings, f"requirements.txt points to {page}'s {section!r}: not there"
