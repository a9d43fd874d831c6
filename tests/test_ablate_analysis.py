"""The analysis package (attnlab.analysis: tables, significance, effects, plots, scaling fits) reads a study and
never imports the running half of ablate/ (runner, workers, final evaluation, SLURM submission)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "attnlab"
RUNNING = {"attnlab.ablate.runner", "attnlab.ablate.final", "attnlab.ablate.submit", "attnlab.ablate.commands",
           "attnlab.ablate.budget", "attnlab.ablate.devices", "attnlab.ablate.results", "attnlab.launch",
           "attnlab.train"}


def module_imports(path: Path) -> set[str]:
    """Absolute names of the attnlab modules a file imports (relative imports resolved), inside functions too."""
    package = "attnlab." + ".".join(path.relative_to(SRC).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            name = f"{base}.{node.module}" if node.level and node.module else node.module or base
            out.update({name} | {f"{name}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {n.rstrip(".") for n in out if n.startswith("attnlab")}


def module_path(name: str) -> Path | None:
    rel = SRC.parent / Path(*name.split("."))
    return next((p for p in (rel.with_suffix(".py"), rel / "__init__.py") if p.is_file()), None)


def test_the_analysis_package_never_imports_the_runner():
    """Every module attnlab.analysis reaches, transitively: none of the running half."""
    seen: set[str] = set()
    todo = [f"attnlab.analysis.{p.stem}" for p in (SRC / "analysis").glob("*.py")]
    while todo:
        name = todo.pop()
        path = module_path(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        todo += module_imports(path)
    bad = sorted(n for n in seen if any(n == r or n.startswith(r + ".") for r in RUNNING))
    assert not bad, f"attnlab.analysis reaches {bad}"
    assert {"attnlab.ablate.study", "attnlab.analysis.report"} <= seen  # the walk did reach the study's storage
