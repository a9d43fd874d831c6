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


def test_a_failing_row_is_recorded_and_the_others_still_run(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("out of something")

    monkeypatch.setitem(train_throughput.PEERS["lm"], "llama", broken)
    rows = by_model(train_throughput.main(["--cpu", "--only", "lm/llama,lm/attnlab", "--steps", "1", "--warmup", "1"]))
    assert rows["lm/llama"]["status"] == "failed: RuntimeError: out of something"
    assert rows["lm/attnlab"]["status"] == "ok"


def test_decoding_benchmark_rows_decode_exactly_the_fixed_lengths():
    rows = by_model(decode_throughput.main(["--cpu", "--only", "mt/attnlab-beam4,lm/attnlab-graph,mt/marian-greedy",
                                            "--repeats", "1", "--warmup", "1"]))
    assert all(r["status"] == "ok" for r in rows.values()), rows  # each call checks its output lengths
    assert rows["mt/attnlab-beam4"]["sentences_per_s"] > 0 and rows["lm/attnlab-graph"]["tokens_per_s"] > 0
