"""The commands of README.md and of every guide in docs/ run as written. Every fenced block of those pages is run
here or skipped with a reason: each line of a `bash` block, in order, in one scratch folder holding the
repository's recipes (later lines, and later pages, use the runs of earlier ones; the pages in PAGES' order), every
`python` block executed, every `yaml` block parsed (and loaded as a study when it is one), and any other block named
in BLOCK_REASONS. A command line is either run or listed in SKIP with the reason it cannot run in a test: a GPU, the
network, a SLURM cluster, or minutes of training. A line that is in neither fails the test, so no page can grow a
command nobody ran. What a line prints is checked against CHECKS, not only its exit code. The ablation lines run on
the guide's own studies, `ablations/demo_significance.yaml` and `ablations/demo_norm_ffn.yaml`, whose trials are
trained and evaluated by the fakes of tests/test_ablate_runner.py (the real 18-minute run is what the guide's table
reports), and `ablate move` moves one to the suite's PostgreSQL server (tests/pg_server.py)."""

from __future__ import annotations

import contextlib
import csv
import io
import re
import runpy
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from attnlab.ablate.runner import Options, run_study
from attnlab.ablate.spec import load_spec
from attnlab.cli import main

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.S | re.M)
# the order the pages run in (a guide uses the runs of the pages before it); other docs/*.md follow, sorted
PAGES = ["README.md"] + [f"docs/{n}.md" for n in ("training", "data", "decoding", "variants", "ablations", "seeds",
                                                   "scaling", "slurm", "reliability", "reproduce", "performance",
                                                   "layout")]
BLOCK_REASONS = {  # a fenced block's language -> why it is not run
    "text": "a tree or printed output, not a command (tests/test_docs.py checks the layout tree)",
}
RUN_HERE = ("printf ", "python bench/results.py")  # other lines run: printf by bash, a bench script in this process
WMT = "needs the WMT14 download and the 100,000-step GPU run of the recipe"
SKIP = {  # the start of a line -> why this test does not run it
    "make test": "runs this test suite itself",
    "make demo": "trains for 10 minutes (tests/test_cli.py runs the demo at toy size)",
    "python3 -m venv .venv": "installs from the network",
    ".venv/bin/python -m pytest": "runs tests of this suite, which make test runs",
    "attnlab ablate run ablations/demo_significance.yaml": "trains 6 models and evaluates them, 6 minutes "
                                                           "(here: trained by fakes before the blocks)",
    "make ablate-demo": "the 6-minute run above",
    "make scaling-demo": "72 models, 17 minutes (tests/test_ablate_scaling.py runs a scaling study on a stand-in)",
    "pip install optuna-dashboard": "installs from the network",
    "pip install 'attnlab[ctranslate2]'": "installs from the network (make test installs it with the dev extra)",
    "optuna-dashboard": "serves a dashboard",
    "attnlab ablate submit ablations/block_variants.yaml --launcher slurm": "needs a SLURM cluster (the --dry-run "
                                                                            "line before it runs here)",
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
# lines the pages of other issues are expected to hold (docs/seeds.md, docs/scaling.md): no failure while no page has
# them, unlike the entries above, which must each match a line
SKIP_IF_PRESENT = {
    "attnlab ablate run ablations/scaling_demo.yaml": "the scaling demo's study, tens of minutes (make scaling-demo)",
    "attnlab ablate scaling ablations/scaling_demo.yaml": "needs the scaling study run (make scaling-demo)",
    "attnlab ablate run ablations/demo_seeds.yaml": "trains the seeds demo's rounds, minutes on 2 cores "
                                                    "(tests/test_ablate_sequential_runs.py runs rounds on stand-ins)",
    "attnlab ablate status ablations/demo_seeds.yaml": "the study of the line above",
    "attnlab ablate table ablations/demo_seeds.yaml": "the study of the line above",
    "attnlab ablate seeds-power": "18 minutes of simulation (tests/test_ablate_sequential.py runs one small case a "
                                  "table)",
    "attnlab ablate submit ablations/demo_seeds.yaml --launcher slurm": "needs a SLURM cluster",
}
CHECKS = {  # the start of a line -> a pattern its output must match
    "attnlab fit -c experiments/quick_en_de.yaml --dry-run": r"dry run: nothing trained. Run directory: runs/quick",
    "attnlab fit -c experiments/quick_lm.yaml --model.norm rmsnorm": r"norm: rmsnorm(.|\n)*ffn: swiglu(.|\n)*"
                                                                     r"dry run: nothing trained",
    "attnlab validate": r'"val/loss": [0-9.]+',
    "attnlab test -c experiments/quick_en_de.yaml": r'"test/loss": [0-9.]+,(.|\n)*"bleu": [0-9.]+,(.|\n)*'
                                                    r'"bleu_signature": "nrefs:1\|case:mixed\|eff:no\|tok:13a',
    "attnlab average": r"averaged 3 checkpoints -> .*averaged_last3\.ckpt",
    "attnlab bleu": r"sacreBLEU \(detokenised\): BLEU = [0-9.]+(.|\n)*chrF2: [0-9.]+(.|\n)*BLEU",
    "attnlab translate --ckpt runs/quick_en_de/checkpoints/averaged_last3.ckpt --engine": r"\A[^\n]*\n[^\n]*\n",
    "attnlab generate": r"^Die Datei",
    "attnlab info": r"training FLOPs per target token .*: [0-9.]+e\+08",
    "attnlab ablate move runs/ablations/demo_norm_ffn": r"demo_norm_ffn: 4 trial\(s\) copied to ",
    "attnlab ablate status ablations/demo_significance.yaml": r"6 done|done: 6|\b6\b.*done",
    "attnlab ablate evaluate ablations/demo_significance.yaml": r"(already evaluated(.|\n)*){6}",
    "attnlab ablate table ablations/demo_significance.yaml": r"\| ffn=swiglu \| [0-9.]+ ± [0-9.]+ \| 3 \|(.|\n)*"
                                                             r"Dunnett",
    "attnlab ablate plot ablations/demo_significance.yaml": r"written: .*curves\.png",
    "attnlab ablate effects ablations/demo_significance.yaml": r"main effects on final/test_bleu(.|\n)*model\.ffn",
    "attnlab ablate compare ablations/demo_significance.yaml ablations/demo_norm_ffn.yaml": r"2 variant\(s\) in both, "
    r"joined on the fields both vary \(model\.ffn; other factors averaged over\)",
    "attnlab ablate submit ablations/block_variants.yaml --dry-run": r"#SBATCH --array=0-127(.|\n)*# dry run: "
                                                                     r"nothing written or submitted \(128 point",
    "python bench/results.py --check": r"RESULTS\.md: \d+ generated tables, as the raw files give them(.|\n)*"
                                       r"performance\.md: 1 generated tables",
}
# a line's text -> what it runs here instead: the user's own server, the suite's (tests/pg_server.py)
PLACEHOLDER = "postgresql://user@host/db"


def pages() -> list[Path]:
    found = [REPO / p for p in PAGES if (REPO / p).is_file()]
    return found + sorted(set((REPO / "docs").glob("*.md")) - set(found))


def blocks() -> list[tuple[Path, str, str]]:
    """(page, language, code) of every fenced block, page by page."""
    return [(page, lang, textwrap.dedent(code)) for page in pages()
            for lang, code in BLOCK.findall(page.read_text(encoding="utf-8"))]


def skipped(line: str) -> str | None:
    return next((why for start, why in {**SKIP, **SKIP_IF_PRESENT}.items() if line.startswith(start)), None)


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
    """One command line: `attnlab ...` and `python bench/<script>` in this process (attnlab with < and >
    redirections), anything else in bash; what it printed (stdout not redirected to a file, and stderr)."""
    words = shlex.split(line, comments=True)
    if not words:
        return ""
    if words[0] == "python" and words[1].startswith("bench/") and "|" not in words:  # a bench script, in-process
        out, err = io.StringIO(), io.StringIO()
        saved_argv, sys.argv = sys.argv, words[1:]
        sys.path.insert(0, str((cwd / words[1]).resolve().parent))  # as python does for a script: its imports
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                runpy.run_path(str(cwd / words[1]), run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), f"{line}: exit {e.code}\n{err.getvalue()}"
        finally:
            sys.argv = saved_argv
            sys.path.pop(0)
        return out.getvalue() + err.getvalue()
    if words[0].removeprefix(".venv/bin/") != "attnlab":
        r = subprocess.run(["bash", "-c", line], cwd=cwd, check=True, timeout=60, capture_output=True, text=True)
        return r.stdout + r.stderr
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


def test_every_block_and_line_is_run_or_skipped_for_a_reason():
    found = blocks()
    assert {p.name for p, _, _ in found} >= {"README.md", "training.md", "ablations.md", "reproduce.md"}
    unknown = [(p.name, lang) for p, lang, _ in found if lang not in ("bash", "python", "yaml", *BLOCK_REASONS)]
    assert not unknown, f"fenced blocks in a language this test neither runs nor has a reason for: {unknown}"
    commands = [line for _, lang, code in found if lang == "bash" for line in lines(code)]
    for line in commands:
        assert skipped(line) or line.startswith(("attnlab ", *RUN_HERE)), line[:200]
    stale = [start for start in SKIP if not any(line.startswith(start) for line in commands)]
    assert not stale, f"SKIP entries that match no line: {stale}"
    unchecked = [start for start in CHECKS if not any(line.startswith(start) for line in commands)]
    assert not unchecked, f"CHECKS entries that match no line: {unchecked}"


def readme_fit(exp, ckpt_path=None):
    """fake_fit, whose curves also log val/bleu (demo_norm_ffn's metric): higher where fake_metric's loss is lower."""
    from test_ablate_runner import fake_fit, fake_metric

    run_dir = fake_fit(exp, ckpt_path)
    path = run_dir / "logs" / "metrics.csv"
    rows = list(csv.reader(open(path, encoding="utf-8")))
    bleu = round(40 - 10 * fake_metric(exp), 3)
    rows = [rows[0] + ["val/bleu"]] + [r + [bleu if r[-1] != "" else ""] for r in rows[1:]]
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)
    return run_dir


def fake_studies(cwd: Path) -> None:
    """The guide's studies, trained and evaluated by the fakes of tests/test_ablate_runner.py (in this process)."""
    fakes = Options(fit="test_readme:readme_fit", evaluate="test_ablate_runner:fake_evaluate", heartbeat_s=1,
                    grace_s=2, poll_s=0.2)
    for name, points in (("demo_significance", 6), ("demo_norm_ffn", 4)):
        spec = load_spec(cwd / "ablations" / f"{name}.yaml")
        assert run_study(spec, opts=fakes, fit=readme_fit) == {"done": points}


def postgres_url(request, tmp_path: Path) -> str:
    """A database on the suite's PostgreSQL server, or (where it cannot start: the test says so) a journal file."""
    try:
        return request.getfixturevalue("postgres").new_database("readme_move")
    except pytest.skip.Exception as e:
        print(f"ablate move: no PostgreSQL server ({e}); moved to a journal file instead")
        return str(tmp_path / "moved_journal.log")


def check_yaml(code: str, cwd: Path, page: Path) -> None:
    """A yaml block parses; one that is a study file (name, base and axes) loads as one."""
    data = yaml.safe_load(code)
    assert isinstance(data, dict), f"{page.name}: a yaml block that is not a mapping"
    if {"name", "base", "axes"} <= set(data):
        path = cwd / "doc_blocks" / f"{data['name']}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(code, encoding="utf-8")
        load_spec(path)


@pytest.mark.slow
def test_pages_lines_run_as_written_and_print_what_they_should(tmp_path, monkeypatch, request):
    for name in ("experiments", "ablations", "bench"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    fake_studies(tmp_path)
    ran, checked = 0, set()
    for page, lang, code in blocks():
        if lang == "python":
            exec(compile(code, str(page.relative_to(REPO)), "exec"), {"__name__": "docs"})
            continue
        if lang == "yaml":
            check_yaml(code, tmp_path, page)
            continue
        if lang != "bash":
            continue
        for line in lines(code):
            if skipped(line):
                continue
            if PLACEHOLDER in line:
                line = line.replace(PLACEHOLDER, postgres_url(request, tmp_path))
            out = run_line(line, tmp_path)
            ran += 1
            for start, pattern in CHECKS.items():
                if line.startswith(start):
                    assert re.search(pattern, out, re.M), f"{page.name}: {line}\nprinted:\n{out[-2000:]}"
                    checked.add(start)
    assert ran >= 25 and checked == set(CHECKS)
    # what the tour produced
    assert len((tmp_path / "output.de").read_text(encoding="utf-8").splitlines()) == 2
    for name in ("quick_en_de", "quick_lm"):
        assert (tmp_path / "hf" / name / "model.safetensors").is_file()
    steps = {p.name for p in (tmp_path / "runs" / "quick_en_de" / "checkpoints").glob("step=*.ckpt")}
    assert {"step=30.ckpt", "step=40.ckpt"} <= steps  # continued from step 30 to 40
    assert "averaged_last3.ckpt" in {p.name for p in (tmp_path / "runs" / "quick_en_de" / "checkpoints").iterdir()}
    assert list((tmp_path / "runs" / "quick_en_de" / "ct2").glob("averaged_last3-*/model.bin"))  # --engine ctranslate2
    assert (tmp_path / "runs" / "ablations" / "demo_significance" / "effects.png").is_file()
    moved = yaml.safe_load((tmp_path / "runs" / "ablations" / "demo_norm_ffn" / "study.yaml").read_text())
    assert "journal.log" not in str(moved), moved  # ablate move recorded the new storage
