"""README.md's commands run as written. Every fenced `bash` and `python` block is either run here, in order, in a
scratch folder holding the repository's recipes (later lines use the runs of earlier ones), or listed in SKIP with
the reason it cannot run in a test: a GPU, the network, a SLURM cluster, or minutes of training. A new block that
is in neither fails the test, so the README cannot grow a command nobody ran."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnlab.cli import main

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^ *```(\w+)\n(.*?)^ *```", re.S | re.M)
SKIP = {  # a block's first line -> why this test does not run it
    "make test": "runs this test suite itself, and `make demo` trains for 10 minutes",
    'python3 -m venv .venv && .venv/bin/pip install -e ".[hf,tensorboard]"': "installs from the network",
    "attnlab ablate run ablations/demo_significance.yaml --workers 2": "trains 6 models and evaluates them, 38 minutes",
    "pip install optuna-dashboard": "installs from the network, then serves a dashboard",
    "attnlab ablate submit ablations/block_variants.yaml --launcher slurm": "needs a SLURM cluster",
    "attnlab ablate run ablations/lm_block_variants.yaml --workers 8": "needs 8 GPUs (on a CPU: 64 models, hours)",
    ".venv/bin/python -c \"import datasets": "downloads WMT14",
    ".venv/bin/python - <<'PY'": "reads WMT14 (downloaded, 820 MB)",
    "sbatch slurm/wmt14_base.sbatch": "needs a SLURM cluster with 8 GPUs",
    ".venv/bin/attnlab average --run-dir runs/wmt14_en_de_base": "needs the 100,000-step GPU run of the step before",
}


def blocks() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return [(lang, textwrap.dedent(code)) for lang, code in BLOCK.findall(text) if lang in ("bash", "python")]


def skipped(code: str) -> str | None:
    first = code.strip().splitlines()[0]
    return next((why for start, why in SKIP.items() if first.startswith(start)), None)


def run_line(line: str, cwd: Path) -> None:
    """One command line: `attnlab ...` in this process (with < and > redirections), anything else in bash."""
    words = shlex.split(line, comments=True)
    if not words:
        return
    if words[0].removeprefix(".venv/bin/") != "attnlab":
        subprocess.run(["bash", "-c", line], cwd=cwd, check=True, timeout=60)
        return
    argv, stdin, stdout = [], None, None
    it = iter(words[1:])
    for word in it:
        if word == "<":
            stdin = cwd / next(it)
        elif word == ">":
            stdout = cwd / next(it)
        else:
            argv.append(word)
    out = io.StringIO()
    saved = sys.stdin
    try:
        if stdin is not None:
            sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.read_bytes()), encoding="utf-8")
        with contextlib.redirect_stdout(out):
            assert main(argv) == 0, line
    finally:
        sys.stdin = saved
    if stdout is not None:
        stdout.write_text(out.getvalue(), encoding="utf-8")


def test_every_block_is_run_or_skipped_for_a_reason():
    found = blocks()
    assert len(found) >= 8
    for lang, code in found:
        assert skipped(code) or lang == "python" or code.lstrip().startswith("attnlab "), code[:200]
    stale = [start for start in SKIP if not any(code.strip().startswith(start) for _, code in found)]
    assert not stale, f"SKIP entries that match no block: {stale}"


@pytest.mark.slow
def test_readme_blocks_run_as_written(tmp_path, monkeypatch, capsys):
    for name in ("experiments", "ablations"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    ran = 0
    for lang, code in blocks():
        if skipped(code):
            continue
        if lang == "python":
            exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
        else:
            for line in code.replace("\\\n", " ").splitlines():
                run_line(line, tmp_path)
        ran += 1
    assert ran >= 2
    # what the tour produced
    assert len((tmp_path / "output.de").read_text(encoding="utf-8").splitlines()) == 2
    for name in ("quick_en_de", "quick_lm"):
        assert (tmp_path / "hf" / name / "model.safetensors").is_file()
    steps = {p.name for p in (tmp_path / "runs" / "quick_en_de" / "checkpoints").glob("step=*.ckpt")}
    assert {"step=30.ckpt", "step=40.ckpt"} <= steps  # continued from step 30 to 40
    assert "averaged_last3.ckpt" in {p.name for p in (tmp_path / "runs" / "quick_en_de" / "checkpoints").iterdir()}
