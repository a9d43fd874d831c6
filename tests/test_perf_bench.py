"""The throughput benchmarks run (small CPU mode, a few rows), skip a missing peer and survive a failing row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import decode_throughput  # noqa: E402
import train_throughput  # noqa: E402
from harness import PROVENANCE_KEYS  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    yield  # the benchmarks set one thread themselves (--threads 1)
    torch.set_num_threads(n)


def by_model(rows: list[dict]) -> dict[str, dict]:
    return {f"{r['task']}/{r['model']}": r for r in rows}


def test_training_benchmark_rows_skipped_peer_and_json(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "x_transformers", None)  # as on a machine without the package
    out = tmp_path / "train.json"
    rows = by_model(train_throughput.main(["--cpu", "--only", "lm/attnlab,lm/attnlab-chunked,lm/x-transformers",
                                           "--steps", "2", "--warmup", "1", "--json", str(out)]))
    assert set(rows) == {"lm/attnlab", "lm/attnlab-chunked", "lm/x-transformers"}
    for name in ("lm/attnlab", "lm/attnlab-chunked"):
        r = rows[name]
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and 0 < r["mfu_pct"] and r["peak_mem_GiB"] is None
    assert rows["lm/x-transformers"]["status"].startswith("skipped: x_transformers not installed")
    saved = json.loads(out.read_text())
    assert "small size" in saved["env"] and len(saved["rows"]) == 3
    assert list(saved["provenance"]) == list(PROVENANCE_KEYS)  # tests/test_bench_record.py checks the values


def test_a_failing_row_is_recorded_and_the_others_still_run(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("out of something")

    monkeypatch.setitem(train_throughput.PEERS["lm"], "llama", broken)
    rows = by_model(train_throughput.main(["--cpu", "--only", "lm/llama,lm/attnlab", "--steps", "1", "--warmup", "1"]))
    assert rows["lm/llama"]["status"] == "failed: RuntimeError: out of something"
    assert rows["lm/attnlab"]["status"] == "ok"


def test_decoding_benchmark_rows_decode_exactly_the_fixed_lengths(tmp_path):
    out = tmp_path / "decode.json"
    rows = by_model(decode_throughput.main(["--cpu", "--only", "mt/attnlab-beam4,lm/attnlab-graph,mt/marian-greedy",
                                            "--repeats", "1", "--warmup", "1", "--json", str(out)]))
    assert all(r["status"] == "ok" for r in rows.values()), rows  # each call checks its output lengths
    assert list(json.loads(out.read_text())["provenance"]) == list(PROVENANCE_KEYS)
    assert rows["mt/attnlab-beam4"]["sentences_per_s"] > 0 and rows["lm/attnlab-graph"]["tokens_per_s"] > 0


def test_fit_vs_bench_fill_is_the_real_target_tokens_of_one_gpus_micro_batch_over_max_tokens(tmp_path):
    """fit_vs_bench's fill, from a run's logged cumulative train/tokens (every GPU) and its config: tokens a step
    over the GPUs and micro-batches of the step, over data.max_tokens; None where the file does not say how many
    GPUs ran."""
    import fit_vs_bench
    import yaml

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    rows = ["step,train/tokens,train/tokens_per_s"] + [f"{s},{(s + 1) * 6000},{1000 + s}" for s in (99, 199, 299)]
    (run / "logs" / "metrics.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")

    def config(devices, accumulate):
        cfg = {"trainer": {"devices": devices, "num_nodes": 1}, "optim": {"accumulate": accumulate},
               "data": {"max_tokens": 1000}}
        (run / "config.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")

    config(1, 1)
    assert fit_vs_bench.fill(run) == pytest.approx(6.0)  # 6,000 tokens a step of 1,000 slots (made-up numbers)
    config(2, 3)
    assert fit_vs_bench.fill(run) == pytest.approx(1.0)  # 6,000 over 2 GPUs x 3 micro-batches
    config("auto", 1)
    assert fit_vs_bench.fill(run) is None
