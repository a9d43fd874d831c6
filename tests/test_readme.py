"""README.md's commands run as written. Every line of every fenced `bash` block, and every `python` block, is
either run here, in order, in a scratch folder holding the repository's recipes (later lines use the runs of
earlier ones), or listed in SKIP with the reason it cannot run in a test: a GPU, the network, a SLURM cluster, or
minutes of training. A line that is in neither fails the test, so the README cannot grow a command nobody ran.
What a line prints is checked against CHECKS, not only its exit code. The ablation lines run on the README's own
study, `ablations/demo_significance.yaml`, whose trials are trained and evaluated by the fakes of
tests/test_ablate_runner.py (the real 18-minute run is what the README's table reports)."""

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

from attnlab.ablate.runner import Options, run_study
from attnlab.ablate.spec import load_spec
from attnlab.cli import main

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^ *```(\w+)\n(.*?)^ *```", re.S | re.M)
WMT = "needs the WMT14 download and the 100,000-step GPU run of the recipe"
SKIP = {  # the start of a line -> why this test does not run it
    "make test": "runs this test suite itself",
    "make demo": "trains for 10 minutes (tests/test_cli.py runs the demo at toy size)",
    "python3 -m venv .venv": "installs from the network",
    "attnlab ablate run ablations/demo_significance.yaml": "trains 6 models and evaluates them, 18 minutes "
                                                           "(here: trained by fakes before the block)",
    "attnlab ablate move runs/ablations/demo_norm_ffn --to postgresql": "needs a PostgreSQL server "
                                                                        "(tests/test_ablate_storage.py moves to one)",
    "attnlab ablate compare ablations/block_variants.yaml": "needs both 64-variant studies run "
                                                            "(tests/test_ablate_report.py compares two small ones)",
    "make ablate-demo": "the 18-minute run above",
    "make scaling-demo": "36 models, 22 minutes (tests/test_ablate_scaling.py runs a scaling study on a stand-in)",
    "pip install optuna-dashboard": "installs from the network",
    "pip install 'attnlab[ctranslate2]'": "installs from the network (make test installs it with the dev extra)",
    "optuna-dashboard": "serves a dashboard",
    "attnlab ablate submit ablations/block_variants.yaml --launcher slurm": "needs a SLURM cluster",
    "attnlab ablate status ablations/block_variants.yaml": "the SLURM study of the line above",
    "attnlab ablate table ablations/block_variants.yaml": "the SLURM study of the line above",
    "attnlab fit -c experiments/wmt14_en_de_base.yaml --slurm": "needs a SLURM cluster with 8 GPUs",
    "attnlab ablate run ablations/lm_block_variants.yaml": "needs 8 GPUs (on a CPU: 64 models, hours)",
    "attnlab ablate run ablations/demo_norm_ffn.yaml --workers-per-gpu": "packs trials on a GPU (on a CPU: 4 models, 8 "
    "minutes; tests/test_ablate_runner.py checks the packing with a fake fit)",
    ".venv/bin/python -c \"import datasets": "downloads WMT14",
    ".venv/bin/python - <<'PY'": "reads WMT14 (downloaded, 820 MB)",
    "sbatch slurm/wmt14_base.sbatch": "needs a SLURM cluster with 8 GPUs",
    ".venv/bin/attnlab demo -c experiments/wmt14_en_de_base.yaml": "needs a GPU: the 63M-parameter base model for 5 "
    "minutes, then beam decoding (bench/gpu_run.sh's base_bleu step runs this command; tests/test_gpu_run.py runs it "
    "at toy size)",
    ".venv/bin/attnlab fit -c experiments/wmt14_en_de_base.yaml": WMT,
    ".venv/bin/attnlab average --run-dir runs/wmt14_en_de_base": WMT,
    "CKPT=runs/wmt14_en_de_base": WMT,
    ".venv/bin/attnlab test -c experiments/wmt14_en_de_base.yaml": WMT,
    ".venv/bin/attnlab translate --ckpt $CKPT": WMT,
    ".venv/bin/attnlab bleu --hyp newstest2014": WMT,
}
CHECKS = {  # the start of a line -> a pattern its output must match
    "attnlab fit -c experiments/quick_en_de.yaml --dry-run": r"dry run: nothing trained. Run directory: runs/quick",
    "attnlab validate": r'"val/loss": [0-9.]+',
    "attnlab test -c experiments/quick_en_de.yaml": r'"test/loss": [0-9.]+,(.|\n)*"bleu": [0-9.]+,(.|\n)*'
                                                    r'"bleu_signature": "nrefs:1\|case:mixed\|eff:no\|tok:13a',
    "attnlab average": r"averaged 3 checkpoints -> .*averaged_last3\.ckpt",
    "attnlab bleu": r"sacreBLEU \(detokenised\): BLEU = [0-9.]+(.|\n)*chrF2: [0-9.]+(.|\n)*BLEU",
    "attnlab translate --ckpt runs/quick_en_de/checkpoints/averaged_last3.ckpt --engine": r"\A[^\n]*\n[^\n]*\n",
    "attnlab generate": r"^Die Datei",
    "attnlab info": r"training FLOPs per target token .*: [0-9.]+e\+08",
    "attnlab ablate status ablations/demo_significance.yaml": r"6 done|done: 6|\b6\b.*done",
    "attnlab ablate evaluate ablations/demo_significance.yaml": r"(already evaluated(.|\n)*){6}",
    "attnlab ablate table ablations/demo_significance.yaml": r"\| ffn=swiglu \| [0-9.]+ ± [0-9.]+ \| 3 \|(.|\n)*Welch",
    "attnlab ablate plot ablations/demo_significance.yaml": r"written: .*curves\.png",
    "attnlab ablate effects ablations/demo_significance.yaml": r"main effects on final/test_bleu(.|\n)*model\.ffn",
}


def blocks() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return [(lang, textwrap.dedent(code)) for lang, code in BLOCK.findall(text) if lang in ("bash", "python")]


def skipped(line: str) -> str | None:
    return next((why for start, why in SKIP.items() if line.startswith(start)), None)


def lines(code: str) -> list[str]:
    """A bash block's command lines: continuations joined, comments and blank lines dropped, a heredoc kept
    with the line that opens it."""
    out: list[str] = []
    heredoc = None
    for line in code.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            out[-1] += "\n" + line
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        out.append(line.strip())
        m = re.search(r"<<'?(\w+)'?", line)
        heredoc = m.group(1) if m else None
    return out


def run_line(line: str, cwd: Path) -> str:
    """One command line: `attnlab ...` in this process (with < and > redirections), anything else in bash; what it
    printed (stdout not redirected to a file, and stderr)."""
    words = shlex.split(line, comments=True)
    if not words:
        return ""
    if words[0].removeprefix(".venv/bin/") != "attnlab":
        return subprocess.run(["bash", "-c", line], cwd=cwd, check=True, timeout=60, capture_output=True,
                              text=True).stdout
    argv, stdin, stdout = [], None, None
    it = iter(words[1:])
    for word in it:
        if word == "<":
            stdin = cwd / next(it)
        elif word == ">":
            stdout = cwd / next(it)
        else:
            argv.append(word)
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin
    try:
        if stdin is not None:
            sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.read_bytes()), encoding="utf-8")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert main(argv) == 0, line
    finally:
        sys.stdin = saved
    if stdout is not None:
        stdout.write_text(out.getvalue(), encoding="utf-8")
        return err.getvalue()
    return out.getvalue() + err.getvalue()


def test_every_line_is_run_or_skipped_for_a_reason():
    found = blocks()
    assert len(found) >= 8
    commands = [line for lang, code in found if lang == "bash" for line in lines(code)]
    for line in commands:
        assert skipped(line) or line.startswith(("attnlab ", "printf ")), line[:200]
    stale = [start for start in SKIP if not any(line.startswith(start) for line in commands)]
    assert not stale, f"SKIP entries that match no line: {stale}"
    unchecked = [start for start in CHECKS if not any(line.startswith(start) for line in commands)]
    assert not unchecked, f"CHECKS entries that match no line: {unchecked}"


def fake_study(cwd: Path) -> None:
    """The README's study, trained and evaluated by the fakes of tests/test_ablate_runner.py (in this process)."""
    from test_ablate_runner import fake_fit

    spec = load_spec(cwd / "ablations" / "demo_significance.yaml")
    fakes = Options(fit="test_ablate_runner:fake_fit", evaluate="test_ablate_runner:fake_evaluate", heartbeat_s=1,
                    grace_s=2, poll_s=0.2)
    assert run_study(spec, opts=fakes, fit=fake_fit) == {"done": 6}


@pytest.mark.slow
def test_readme_lines_run_as_written_and_print_what_they_should(tmp_path, monkeypatch, capsys):
    for name in ("experiments", "ablations"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    fake_study(tmp_path)
    ran, checked = 0, set()
    for lang, code in blocks():
        if lang == "python":
            exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
            continue
        for line in lines(code):
            if skipped(line):
                continue
            out = run_line(line, tmp_path)
            ran += 1
            for start, pattern in CHECKS.items():
                if line.startswith(start):
                    assert re.search(pattern, out, re.M), f"{line}\nprinted:\n{out[-2000:]}"
                    checked.add(start)
    assert ran >= 20 and checked == set(CHECKS)
    # what the tour produced
    assert len((tmp_path / "output.de").read_text(encoding="utf-8").splitlines()) == 2
    for name in ("quick_en_de", "quick_lm"):
        assert (tmp_path / "hf" / name / "model.safetensors").is_file()
    steps = {p.name for p in (tmp_path / "runs" / "quick_en_de" / "checkpoints").glob("step=*.ckpt")}
    assert {"step=30.ckpt", "step=40.ckpt"} <= steps  # continued from step 30 to 40
    assert "averaged_last3.ckpt" in {p.name for p in (tmp_path / "runs" / "quick_en_de" / "checkpoints").iterdir()}
    assert list((tmp_path / "runs" / "quick_en_de" / "ct2").glob("averaged_last3-*/model.bin"))  # --engine ctranslate2
    assert (tmp_path / "runs" / "ablations" / "demo_significance" / "effects.png").is_file()
