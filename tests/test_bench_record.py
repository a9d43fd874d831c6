"""The benchmark record: every bench script's JSON carries its provenance (bench/harness.py), bench/RESULTS.md's
generated tables are what bench/results.py writes from the raw files (an edit by hand fails here), results.py
refuses a file without provenance naming the file and the key, and fit_vs_bench.py takes the fit's tokens/s by the
wall clock from the run's own metrics.csv."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import data_throughput  # noqa: E402
import fit_vs_bench  # noqa: E402
import harness  # noqa: E402
import padded_attention  # noqa: E402
import results  # noqa: E402
import sdpa_variable_shapes  # noqa: E402

SCRIPTS = ["train_throughput.py", "decode_throughput.py", "decode_vs_ct2.py", "data_throughput.py",
           "padded_attention.py", "sdpa_variable_shapes.py", "fit_vs_bench.py", "peer_score.py"]


def check_provenance(path: Path, argv: list[str] | None = None) -> dict:
    prov = json.loads(path.read_text(encoding="utf-8"))["provenance"]
    assert list(prov) == list(harness.PROVENANCE_KEYS)
    assert re.fullmatch(r"[0-9a-f]{40}", prov["git_commit"]) and isinstance(prov["git_dirty"], bool)
    assert prov["torch"] == torch.__version__ and prov["device"]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", prov[k]) for k in ("started_utc", "ended_utc"))
    assert prov["started_utc"] <= prov["ended_utc"]
    if argv is not None:
        assert prov["argv"] == argv
    return prov


def test_every_bench_script_writes_its_json_through_the_harness():
    """No script writes a JSON file of its own: each calls harness.write_json or write_record, which add the
    provenance (decode_vs_ct2.py, which needs a trained checkpoint and CTranslate2, is checked by this alone)."""
    for name in SCRIPTS:
        tree = ast.parse((BENCH / name).read_text(encoding="utf-8"))
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                 for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert calls & {"write_json", "write_record"}, name
        assert "dump" not in calls, name  # json.dump(obj, file)
        for n in ast.walk(tree):  # path.write_text(json.dumps(...))
            if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "write_text":
                assert "json.dumps" not in ast.unparse(n), (name, ast.unparse(n))


def test_provenance_without_git_or_gpu(tmp_path, monkeypatch):
    """The commit comes from ATTNLAB_GIT_COMMIT where set (a copy of the tree on a device machine), even inside a
    checkout, else from git;
    without nvidia-smi or the driver's /proc file the driver is None; packages not installed are None."""
    path = os.environ["PATH"]
    monkeypatch.setattr(harness, "REPO", tmp_path)
    monkeypatch.setenv("ATTNLAB_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("ATTNLAB_GIT_DIRTY", "false")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, no git
    prov = harness.provenance(["x"], "cpu", 0.0)
    assert prov["git_commit"].startswith("0123456") and prov["git_dirty"] is False
    assert prov["started_utc"] == "1970-01-01T00:00:00Z" and prov["device"].startswith("CPU: ")
    assert prov["cuda"] == torch.version.cuda and harness.installed("no-such-package-attnlab") is None
    if not Path("/proc/driver/nvidia/version").exists():
        assert prov["nvidia_driver"] is None
    monkeypatch.setattr(harness, "REPO", Path(__file__).resolve().parent.parent)  # a checkout: the caller's word wins
    monkeypatch.setenv("PATH", path)
    assert harness.git_state() == ("0123456789abcdef0123456789abcdef01234567", False)
    monkeypatch.delenv("ATTNLAB_GIT_COMMIT")
    assert harness.git_state()[0] != "0123456789abcdef0123456789abcdef01234567"


def test_row_benchmarks_record_provenance(tmp_path):
    """padded_attention.py (as train_throughput.py and decode_throughput.py: tests/test_perf_bench.py) writes its
    rows with the provenance of the run."""
    out = tmp_path / "padded.json"
    argv = ["--dry-run", "--json", str(out)]
    padded_attention.main(argv)
    assert check_provenance(out, argv)["device"].startswith("CPU: ")


def test_data_and_sdpa_benchmarks_record_provenance(tmp_path, monkeypatch):
    """data_throughput.py and sdpa_variable_shapes.py (CUDA only; its measurements faked here) write their JSON
    through write_record."""
    monkeypatch.setattr(data_throughput, "run_size", lambda n, root, max_tokens: [{"phase": "build", "pairs": n}])
    out = tmp_path / "data.json"
    data_throughput.main(["--pairs", "10", "--json", str(out)])
    check_provenance(out, ["--pairs", "10", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == [{"phase": "build", "pairs": 10}]

    from attnlab.models import attention

    monkeypatch.chdir(BENCH.parent)  # the script reads experiments/ from the repository root
    monkeypatch.setattr(attention, "SDPA_GPU_BACKENDS", attention.SDPA_GPU_BACKENDS)  # restored afterwards
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(sdpa_variable_shapes, "step_times", lambda cfg: [0.01] * 12)
    monkeypatch.setattr(sdpa_variable_shapes.train_throughput, "main", lambda argv: [
        {"task": "encdec", "tokens_per_s": 1.0, "peak_mem_GiB": 1.0}])
    out = tmp_path / "sdpa.json"
    sdpa_variable_shapes.main([str(out)])
    assert check_provenance(out, [str(out)])["device"] == "a GPU"
    assert results.kind(out, json.loads(out.read_text())) == "sdpa"


# ------------------------------------------------------------------------------------------------ RESULTS.md
def test_results_md_tables_are_what_the_raw_files_give():
    """Every generated table of bench/RESULTS.md, rewritten from bench/results/, is the table the file holds: a
    figure edited by hand fails here (`python bench/results.py` rewrites them)."""
    text = results.RESULTS_MD.read_text(encoding="utf-8")
    assert len(results.START.findall(text)) >= 10
    assert results.render(text) == text, "bench/RESULTS.md differs from its raw files: run python bench/results.py"


def test_a_hand_edit_is_found_and_rewritten(tmp_path, capsys):
    md = tmp_path / "RESULTS.md"
    text = results.RESULTS_MD.read_text(encoding="utf-8")
    assert "| 5.46x marian-greedy |" in text  # the second session's greedy graph over Marian, one file
    md.write_text(text.replace("| 5.46x marian-greedy |", "| 5.44x marian-greedy |"), encoding="utf-8")
    assert results.main(["--check", "--results-md", str(md)]) == 1
    assert "h100_2026-11-25b_decode_mt.json" in capsys.readouterr().err
    assert results.main(["--results-md", str(md)]) == 0 and md.read_text(encoding="utf-8") == text


def test_files_before_provenance_say_not_recorded_and_new_ones_must_carry_it(tmp_path):
    """A raw file from before the provenance shows 'not recorded'; any other file a bench script wrote is refused
    without it, naming the file and the key, and so is one whose provenance lacks a key or a commit."""
    old = "h100_2026-11-26_train_compile.json"
    row = results.table([old]).splitlines()[2]
    assert row.endswith(f"| `{old}` | not recorded | NVIDIA H100 80GB HBM3 |")

    raw = tmp_path / "results"
    raw.mkdir()
    data = json.loads((results.RAW / old).read_text(encoding="utf-8"))
    (raw / "new.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(results.RecordError, match=r"new\.json: no \"provenance\" key"):
        results.table(["new.json"], raw)

    data["provenance"] = harness.provenance(["bench/train_throughput.py"], "cpu")
    (raw / "new.json").write_text(json.dumps(data), encoding="utf-8")
    commit = data["provenance"]["git_commit"][:7]
    assert f"| `new.json` | {commit}" in results.table(["new.json"], raw)
    for key, value in (("git_commit", None), ("device", "")):
        broken = {**data, "provenance": {**data["provenance"], key: value}}
        (raw / "new.json").write_text(json.dumps(broken), encoding="utf-8")
        with pytest.raises(results.RecordError, match=rf"new\.json: provenance '{key}' is null"):
            results.table(["new.json"], raw)
    del data["provenance"]["ended_utc"]
    (raw / "new.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(results.RecordError, match=r"new\.json: provenance lacks the key 'ended_utc'"):
        results.table(["new.json"], raw)
    md = tmp_path / "RESULTS.md"
    md.write_text("<!-- generated by bench/results.py from new.json: do not edit -->\n<!-- end -->\n")
    assert results.main(["--results-md", str(md), "--raw", str(raw)]) == 2


def test_a_ratio_divides_rows_of_one_file_only(tmp_path):
    """Two files in one table: each row's ratio is against its own file's reference row; a file without one gives
    none rather than borrowing another file's."""
    raw = tmp_path / "results"
    raw.mkdir()
    for name in ("h100_2026-11-25_train_eager.json", "h100_2026-11-25_train_compile_lm_xt.json"):
        shutil.copy(results.RAW / name, raw / name)
    lines = results.table(["h100_2026-11-25_train_eager.json", "h100_2026-11-25_train_compile_lm_xt.json"],
                          raw).splitlines()
    chunked = next(line for line in lines if "| encdec | attnlab-chunked | eager |" in line)
    assert "| 1.20x |" in chunked  # 309,672 / 258,067, both in train_eager.json
    xt = next(line for line in lines if "| encdec | x-transformers | compile |" in line)
    assert "| - |" in xt  # no compiled encdec/attnlab in its file


def test_a_decoding_target_without_its_rows_is_an_error_not_a_yes(tmp_path):
    """The CTranslate2 targets read each engine's rows (their `engine` field is "attnlab --engine ctranslate2" since
    2026-11-26): a file with none beside CTranslate2's own is refused with its name, never met by an empty list."""
    raw = tmp_path / "results"
    raw.mkdir()
    name = "h100_2026-11-26c_decode_ct2.json"
    data = json.loads((results.RAW / name).read_text(encoding="utf-8"))
    assert results.t_engine_cuda(data)[0].startswith("greedy 2.27x, beam 4 0.72x")  # 1,838 / 811 and 349 / 484
    data["rows"] = [r for r in data["rows"] if not r["row"].startswith("attnlab --engine")]
    (raw / name).write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(results.RecordError, match="no row of attnlab's engine 'ctranslate2'"):
        results.t_engine_cuda(data)
    old = results.TARGETS
    try:
        results.TARGETS = [t for t in old if t[1] == name]
        with pytest.raises(results.RecordError, match=name):
            results.targets_table(raw)
    finally:
        results.TARGETS = old


def test_the_cpu_decoding_target_counts_attnlabs_own_batches_only():
    """A row in the decode config's batches (--config-batches: not how translate_lines batches on a CPU) does not
    count toward the CPU target, however fast; attnlab's own row does."""
    row = {"threads": 2, "beam": 1, "status": "ok", "sentences": 10}
    data = {"rows": [{**row, "row": "ctranslate2 beam 1", "engine": "ctranslate2", "sent_per_s": 1000.0},
                     {**row, "row": "attnlab beam 1", "engine": "attnlab", "sent_per_s": 700.0},
                     {**row, "row": "attnlab beam 1, the decode config's batches", "engine": "attnlab",
                      "sent_per_s": 900.0}]}
    assert results.ct2_ratios(data, "attnlab") == [(1, 2, 0.7)]
    assert results.t_ct2_cpu(data)[1] == "no"
    # a row measured while the hypervisor took 30% of the CPUs: the verdict says so, and the table shows it
    data["rows"][1]["steal_share"] = 0.3
    assert results.t_ct2_cpu(data)[1] == "no; not a clean measurement: the hypervisor took up to 30% of the CPUs"
    assert [r[-2] for r in results.ct2_rows(data)] == ["-", "30%", "-"]
    data["rows"][1]["steal_share"] = 0.01
    assert results.t_ct2_cpu(data)[1] == "no"


def test_the_decoding_benchmark_warms_up_for_its_seconds_then_times_its_passes():
    """decode_vs_ct2.timed: one warm-up pass at least, more until --warmup seconds have gone, then the timed
    passes, each timed alone."""
    import time

    import decode_vs_ct2

    calls = []
    seconds, out = decode_vs_ct2.timed(lambda: calls.append(time.sleep(0.01)) or len(calls), 3)
    assert len(calls) == 4 and out == 4 and len(seconds) == 3 and all(s >= 0.009 for s in seconds)
    ends: list[float] = []
    t0 = time.perf_counter()
    decode_vs_ct2.timed(lambda: ends.append(time.sleep(0.01) or time.perf_counter()), 2, warmup=0.1)
    warm = ends[:-2]  # each pass sleeps 10 ms: the warm-up passes end past 0.1 s, the one before them did not
    assert len(warm) >= 2 and warm[-1] - t0 >= 0.1 and warm[-2] - t0 < 0.1 + 0.005, ends


# ------------------------------------------------------------------------------------------------ fit_vs_bench
def run_dir(tmp_path: Path, rows: list[str], devices: int = 1) -> Path:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "metrics.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    cfg = {"trainer": {"devices": devices, "num_nodes": 1}, "optim": {"accumulate": 1}, "data": {"max_tokens": 1000}}
    (run / "config.yaml").write_text(json.dumps(cfg), encoding="utf-8")  # JSON is YAML
    return run


def bench_json(tmp_path: Path, tokens_per_s: float) -> Path:
    path = tmp_path / "bench.json"
    harness.write_record(path, {"rows": [{"task": "encdec", "model": "attnlab", "mode": "eager", "status": "ok",
                                          "tokens_per_s": tokens_per_s}]}, ["bench"], "cpu")
    return path


def test_fit_vs_bench_takes_the_fit_by_the_wall_clock(tmp_path):
    """fit_tokens_per_s: target tokens from the warm logged step (after the first 10% of them) to the last, over
    the train/time between them, per GPU; the median of the logged per-step rates stays beside it. Made-up
    figures: 900 tokens a step, logged every 10 steps, 1 s apart, except a 9 s pause (a checkpoint, say)."""
    header = "step,train/tokens,train/tokens_per_s,train/time"
    times = [1e9 + s // 10 + (8 if s >= 109 else 0) for s in range(9, 200, 10)]
    rows = [header] + [f"{s},{(s + 1) * 900},{5000 + s},{t}" for s, t in zip(range(9, 200, 10), times, strict=True)]
    run, bench = run_dir(tmp_path, rows, devices=2), bench_json(tmp_path, 1000.0)
    out_json = tmp_path / "fit.json"
    out = fit_vs_bench.main([str(run), str(bench), "--json", str(out_json)])
    # 20 logged steps: the window starts at the third (index 2, step 29) and ends at step 199
    assert out["fit_window"] == {"from_step": 29, "to_step": 199, "seconds": 25.0, "target_tokens": 170 * 900,
                                 "gpus": 2}
    assert out["fit_tokens_per_s"] == pytest.approx(170 * 900 / 25 / 2, abs=0.1)
    assert out["fit_over_bench"] == pytest.approx(out["fit_tokens_per_s"] / 1000, abs=1e-3)
    assert out["median_tokens_per_s"] == 5000 + (109 + 119) / 2 and out["median_steps"] == 18  # steps 29-199
    assert out["fill"] == pytest.approx(0.45) and out["bench_provenance"]["argv"] == ["bench"]
    check_provenance(out_json)
    assert "| run | 3,060 | steps 29-199, 25.0 s | 5,114 | 1,000 | 3.06x | 5.11x | 0.45 | `fit.json` |" in \
        results.table(["fit.json"], tmp_path)

    late = fit_vs_bench.main([str(run), str(bench), "--warm-step", "110"])
    assert late["fit_window"]["from_step"] == 119 and late["fit_window"]["seconds"] == 8.0


def test_fit_vs_bench_on_a_run_from_before_the_wall_clock(tmp_path):
    rows = ["step,train/tokens,train/tokens_per_s"] + [f"{s},{(s + 1) * 900},{5000 + s}" for s in range(9, 200, 10)]
    out = fit_vs_bench.main([str(run_dir(tmp_path, rows)), str(bench_json(tmp_path, 1000.0))])
    assert out["fit_tokens_per_s"] is None and out["fit_over_bench"] is None and out["fit_window"] is None
    assert out["median_over_bench"] == pytest.approx(5.114) and out["fit_over_bench_over_fill"] is None
