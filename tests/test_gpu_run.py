"""bench/gpu_run.sh, the one command for a GPU, run as --dry-run: every step at toy size on this CPU, the files
each step promises under one folder; and its early, named failures (no CUDA, no catalogs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["gpu_tests", "train_compile", "base_fit", "base_bench", "decode_ct2", "base_bleu", "base_peer", "ablation",
         "train_eager", "decode", "padded_attn", "demo_fit", "demo_bench"]
PEER = ROOT.parent / "shared" / "peers" / "peer_demo.py"  # the hand-written peer beside a checkout, where there is one


def gpu_run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), "--python", sys.executable, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_dry_run_runs_every_step_and_writes_every_figure_under_one_folder(tmp_path):
    out = tmp_path / "gpu"
    r = gpu_run("--dry-run", "--out", str(out), timeout=1200)  # 170 s alone; a last resort sized for a loaded
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]  # machine (600 s ran out under xdist at -n 4)
    summary = (out / "summary.md").read_text(encoding="utf-8")
    for step in STEPS:
        if step == "base_peer" and not PEER.is_file():
            assert "| base_peer | skipped (no peer at" in summary, summary
            continue
        assert f"| {step} | ok |" in summary, summary
        assert (out / f"{step}.log").stat().st_size > 0
    assert [line.split(" | ")[0][2:] for line in summary.splitlines() if line.startswith("| ")][1:] == STEPS  # parts'
    # order
    for name in ("train_eager", "train_compile", "decode", "demo_bench", "decode_ct2"):
        rows = json.loads((out / f"{name}.json").read_text(encoding="utf-8"))["rows"]
        assert rows and all(row["status"] == "ok" for row in rows), rows
    routes = {r["route"]: r for r in json.loads((out / "padded_attn.json").read_text(encoding="utf-8"))["rows"]}
    assert all(routes[r]["status"] == "ok" for r in ("sdpa_mask", "sdpa_nomask", "jagged", "flex")), routes
    assert routes["jagged"]["max_err"] < 1e-4 and routes["flex"]["max_err"] < 1e-4  # each agrees with the mask
    if PEER.is_file():  # the peer on base_bleu's split, scored beside attnlab's hypotheses of the same sentences
        peer = json.loads((out / "base_peer.json").read_text(encoding="utf-8"))
        assert peer["peer"]["sentences"] == 40 and peer["sentences_compared"].startswith("40 of attnlab's")
        assert peer["peer"]["bleu_signature"] == peer["attnlab"]["bleu_signature"] and peer["peer_steps"] > 0
        assert set(peer["paired_bootstrap"]) == {"BLEU", "chrF2"}
    for name in ("demo_fit", "base_fit"):
        fit = json.loads((out / f"{name}.json").read_text(encoding="utf-8"))
        assert fit["fit_tokens_per_s"] > 0 and fit["bench_tokens_per_s"] > 0 and fit["fit_over_bench"] > 0
        assert 0 < fit["fill"] <= 1 and fit["fit_over_bench_over_fill"] > 0  # both runs name devices: 1
    bleu = json.loads((out / "base_bleu.json").read_text(encoding="utf-8"))
    assert bleu["sentences"] > 100 and "nrefs:1" in bleu["bleu_signature"]
    assert len((out / "base_translations.jsonl").read_text(encoding="utf-8").splitlines()) == bleu["sentences"]
    assert "| norm=rmsnorm ffn=swiglu |" in (out / "ablation.txt").read_text(encoding="utf-8")
    assert "4 trials finished in" in summary and "trials per hour" in summary


def test_without_cuda_or_catalogs_it_stops_at_once_saying_what_is_missing(tmp_path):
    r = gpu_run("--out", str(tmp_path / "a"), timeout=120)
    assert r.returncode == 2 and "no CUDA device visible to torch" in r.stderr and "--dry-run" in r.stderr
    r = gpu_run("--dry-run", "--out", str(tmp_path / "b"), "--locale", str(tmp_path / "none"), timeout=120)
    assert r.returncode == 2 and f"no gettext catalogs in {tmp_path / 'none'}/de/LC_MESSAGES" in r.stderr
    assert "--locale" in r.stderr and not (tmp_path / "b" / "summary.md").exists()


def test_only_runs_the_steps_named_into_one_folder(tmp_path):
    """--only: a subset of the steps (a lease of a few minutes at a time), the next call adding to the summary."""
    out = tmp_path / "gpu"
    for only in ("gpu_tests", "train_eager"):
        r = gpu_run("--dry-run", "--out", str(out), "--only", only, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line for line in (out / "summary.md").read_text(encoding="utf-8").splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| gpu_tests", "| train_eager"]  # after the header
    assert not (out / "decode.json").exists() and (out / "train_eager.json").exists()


def test_base_args_reach_the_base_run(tmp_path):
    """--base-args: overrides for base_bleu's run (a variant of the 5-minute base model without editing the
    script), after the step's own; its run's config says so."""
    out = tmp_path / "gpu"
    r = gpu_run("--dry-run", "--out", str(out), "--only", "base_bleu",
                "--base-args", "--model.norm_position pre  --optim.warmup_steps 7", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    config = (out / "runs" / "gpu_base" / "config.yaml").read_text(encoding="utf-8")
    assert "norm_position: pre" in config and "warmup_steps: 7" in config
    assert json.loads((out / "base_bleu.json").read_text(encoding="utf-8"))["sentences"] > 100


def test_parts_and_carry_are_checked_before_anything_runs(tmp_path):
    """--part N is one of the lists of steps sized for one call of a lent machine; a wrong one, --part with --only,
    and a --carry folder without wheels: each stops at once."""
    for args, message in ((["--part", "7"], "--part 7: give 1 to 6"),
                          (["--part", "1", "--only", "gpu_tests"], "give --part or --only, not both"),
                          (["--carry", str(tmp_path / "none")], f"--carry {tmp_path / 'none'}: no wheels folder")):
        r = gpu_run("--dry-run", "--out", str(tmp_path / "o"), *args, timeout=120)
        assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "o" / "summary.md").exists()


@pytest.mark.slow
def test_part_4_on_a_fresh_machine_builds_the_split_part_3_trains_and_tests_on(tmp_path):
    """The peer's part alone (a fresh machine, no part 3 in its --out) builds attnlab's split itself, with base_bleu's
    config: base_bleu run into the same folder afterwards finds that cache and builds no other."""
    out = tmp_path / "p"
    r = gpu_run("--dry-run", "--out", str(out), "--part", "4", timeout=300)
    summary = (out / "summary.md").read_text(encoding="utf-8")
    if not PEER.is_file():
        assert r.returncode == 0 and "| base_peer | skipped (no peer at" in summary
        return
    assert r.returncode == 0 and "| base_peer | ok" in summary, summary + r.stdout[-2000:] + r.stderr[-2000:]
    assert "building it" in r.stdout
    caches = [d for d in (out / "data_base").iterdir() if (d / "test.jsonl").is_file()]
    assert len(caches) == 1, caches
    peer = json.loads((out / "base_peer.json").read_text(encoding="utf-8"))
    assert peer["peer"]["sentences"] == 40 and peer["peer_steps"] > 0
    r = gpu_run("--dry-run", "--out", str(out), "--only", "base_bleu", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [d for d in (out / "data_base").iterdir() if (d / "test.jsonl").is_file()] == caches, "one split, not two"
