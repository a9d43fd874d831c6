"""Project rules that code review would otherwise have to remember."""

import ast
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

from attnlab.config import ModelConfig

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


def test_every_row_of_the_readme_config_table_names_tests_that_exist():
    """The "proven against" column of the model-config table (docs/variants.md): each row names at least one
    test, and every `file.py::test_name` (or `::test_name` after a file, `test_x_*` a prefix, `[...]` a parameter
    id) exists."""
    readme = (SRC.parents[1] / "docs" / "variants.md").read_text(encoding="utf-8")
    header = readme.index("| field | values | reference | proven against (tests/) |")
    rows = readme[header:readme.index("\n\n", header)].splitlines()[2:]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    covered: set[str] = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        covered.update(n for n in re.findall(r"`(\w+)`", cells[0]))
        refs = re.findall(r"`(test_\w+\.py)?(?:::)?(test_\w*\*?)?(?:\[[\w-]+\])?`", cells[3])
        assert refs, f"no test named for {cells[0]}"
        current = None
        for file, name in refs:
            current = file or current
            assert current is not None and (SRC.parents[1] / "tests" / current).exists(), (cells[0], file)
            if name:
                defined = {n.name for n in ast.walk(ast.parse((SRC.parents[1] / "tests" / current).read_text()))
                           if isinstance(n, ast.FunctionDef)}
                assert any(d == name or (name.endswith("*") and d.startswith(name[:-1])) for d in defined), name
    assert covered >= fields - {"vocab_size", "src_vocab_size", "max_seq_len", "norm_eps", "pad_id"}, \
        fields - covered
