"""Project rules that code review would otherwise have to remember."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "attnlab"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_models_never_import_lightning_or_do_io():
    for path in (SRC / "models").glob("*.py"):
        bad = imported_modules(path) & {"lightning", "pytorch_lightning", "yaml", "tokenizers", "datasets"}
        assert not bad, f"{path.name} imports {bad}: models/ is plain PyTorch"


def test_source_files_stay_small():
    for path in SRC.rglob("*.py"):
        n = len(path.read_text(encoding="utf-8").splitlines())
        assert n <= 650, f"{path.relative_to(SRC)} has {n} lines; split it (the project keeps files under ~600)"


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    root = SRC.parents[1]
    r = subprocess.run([ruff, "check", "--output-format", "concise", "src", "tests", "bench"], cwd=root,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
