"""oneDNN's prepacked linears for CPU decoding (attnlab.models.prepack): the same logits and tokens as torch's
nn.Linear, every layer put back afterwards, and nothing changed where it would not be the same computation."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from attnlab.config import ModelConfig
from attnlab.decode import beam_search, greedy_search
from attnlab.models import prepack
from attnlab.models.prepack import prepacked_linears
from attnlab.models.transformer import build_model
from conftest import jitter

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
V = 300


def model(tie: str, seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="encoder_decoder", vocab_size=V, d_model=64, n_heads=4, n_enc_layers=2, n_dec_layers=2,
                      d_ff=128, dropout=0.0, tie_embeddings=tie, **kw)
    return jitter(build_model(cfg), seed).eval()  # biases != 0, norms != 1


def logits(m: nn.Module, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return m(src, tgt)  # (B, T, V)


def packed_state(m: nn.Module) -> tuple[int, bool]:
    """How many nn.Linear run a packed forward, and whether the head is replaced."""
    return sum("forward" in x.__dict__ for x in m.modules() if type(x) is nn.Linear), m.__dict__.get("head") is not None


def linear_calls(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")


@pytest.mark.parametrize("tie,kw", [("all", {}), ("none", {"attn_bias": False, "ffn": "swiglu", "ffn_bias": False})])
def test_packed_linears_give_torchs_logits_and_every_layer_is_put_back(tie, kw, monkeypatch):
    monkeypatch.setattr(prepack, "MIN_MACS", 0)  # every call through oneDNN, however small
    m = model(tie, **kw)
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, V, (5, 9), generator=g), torch.randint(3, V, (5, 7), generator=g)
    n_linear = sum(type(x) is nn.Linear for x in m.modules())
    with torch.no_grad():
        want = logits(m, src, tgt)
        with prepacked_linears(m):
            assert packed_state(m) == (n_linear, tie != "none")
            got = logits(m, src, tgt)
            # every projection of the forward runs oneDNN's kernel: the linears' calls and the tied head's
            calls = linear_calls(lambda: logits(m, src, tgt))
        assert packed_state(m) == (0, False) and "_attnlab_prepacked" not in m.__dict__
        assert m.head is None if tie != "none" else isinstance(m.head, nn.Linear)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    enc, dec = m.cfg.n_enc_layers, m.cfg.n_dec_layers
    # self-attention qkv + out, cross-attention q + kv + out, the FFN's two (a gated one's are fused), the head
    assert calls == enc * (2 + 2) + dec * (2 + 3 + 2) + 1, calls
    # put back: the weights a later step changes are the ones the model uses
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.5)
        changed = logits(m, src, tgt)
        assert not torch.allclose(changed, want, rtol=1e-3, atol=1e-3)
        with prepacked_linears(m):  # packed anew: not the first entry's weights
            torch.testing.assert_close(logits(m, src, tgt), changed, rtol=1e-5, atol=1e-5)


def test_greedy_and_beam_search_give_the_same_tokens_packed_or_not(monkeypatch):
    monkeypatch.setattr(prepack, "MIN_MACS", 0)
    m = model("all", seed=3)
    g = torch.Generator().manual_seed(2)
    src = torch.randint(3, V, (6, 11), generator=g)
    src[2, 6:] = 0
    packed = greedy_search(m, src, max_len_b=12), beam_search(m, src, beam_size=3, max_len_b=12)
    assert linear_calls(lambda: greedy_search(m, src, max_len_b=2)) > 0, "the search packs its model"
    monkeypatch.setattr("attnlab.models.prepack.applies", lambda model: False)
    assert linear_calls(lambda: greedy_search(m, src, max_len_b=2)) == 0
    plain = greedy_search(m, src, max_len_b=12), beam_search(m, src, beam_size=3, max_len_b=12)
    assert plain[0] == packed[0]  # greedy: the same tokens
    for (mine,), (theirs,) in zip(plain[1], packed[1], strict=True):  # beam: the same tokens, scores to fp32 sums
        assert mine[0] == theirs[0] and mine[1] == pytest.approx(theirs[1], rel=1e-5)
    assert packed_state(m) == (0, False)


def test_calls_too_small_to_gain_run_torchs_linear():
    """oneDNN's call costs more than it saves below MIN_MACS multiply-adds (bench/cpu_linear.py)."""
    layer = nn.Linear(128, 512)
    small, large = torch.randn(15, 128), torch.randn(16, 128)  # 15 * 128 * 512 < 2^20 <= 16 * 128 * 512
    with torch.no_grad(), prepacked_linears(layer):
        assert linear_calls(lambda: layer(small)) == 0 and linear_calls(lambda: layer(large)) == 1
        got = layer(large)
    torch.testing.assert_close(got, layer(large), rtol=1e-5, atol=1e-5)


def test_nothing_is_packed_where_it_would_not_be_the_same_computation():
    m = model("all")
    with prepacked_linears(m):  # autograd on: a training step's linears keep their gradients
        assert packed_state(m) == (0, False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), prepacked_linears(m):
        assert packed_state(m) == (0, False)  # autocast casts torch's linears, not these
    b = model("all").to(torch.bfloat16)
    with torch.no_grad(), prepacked_linears(b):
        assert packed_state(b) == (0, False)


def test_nested_and_concurrent_uses_share_one_packing_and_the_last_one_out_restores():
    m = model("all")
    n_linear = sum(type(x) is nn.Linear for x in m.modules())
    with torch.no_grad(), prepacked_linears(m):
        first = [x.__dict__["forward"] for x in m.modules() if type(x) is nn.Linear]
        with prepacked_linears(m):
            assert [x.__dict__["forward"] for x in m.modules() if type(x) is nn.Linear] == first  # not packed again
        assert packed_state(m) == (n_linear, True), "the inner exit left the outer packing in place"
    assert packed_state(m) == (0, False)

    src = torch.randint(3, V, (4, 8), generator=torch.Generator().manual_seed(4))
    want = greedy_search(m, src, max_len_b=10)
    start, got = threading.Barrier(4), []

    def decode() -> None:
        start.wait()
        for _ in range(5):
            got.append(greedy_search(m, src, max_len_b=10))

    threads = [threading.Thread(target=decode) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 20 and packed_state(m) == (0, False) and "_attnlab_prepacked" not in m.__dict__


@pytest.mark.parametrize("script, shapes, keys, figures", [
    ("cpu_linear.py", "4,32,64;16,64,128", ("M", "K", "N"), ("plain_us", "packed_us")),
    ("cpu_argmax.py", "4,300;70,1000", ("rows", "V"), ("torch_us", "row_argmax_us", "chunked_us")),
])
def test_the_cpu_kernel_benches_write_both_kernels_figures_with_provenance(tmp_path, script, shapes, keys, figures):
    """bench/cpu_linear.py and bench/cpu_argmax.py, whose rows MIN_MACS and ARGMAX_MIN_NUMEL are read off, at two
    small shapes each: both kernels timed, the same results."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "kernels.json"
    r = subprocess.run([sys.executable, str(root / "bench" / script), "--iters", "3", "--shapes", shapes,
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads(out.read_text(encoding="utf-8"))
    expected = [tuple(int(v) for v in s.split(",")) for s in shapes.split(";")]
    assert [tuple(row[k] for k in keys) for row in record["rows"]] == expected
    for row in record["rows"]:
        assert row["status"] == "ok" and all(row[f] > 0 for f in figures)
        assert row["max_abs_diff"] < 1e-4 if script == "cpu_linear.py" else row["same"] is True
    assert record["provenance"]["device"].startswith("CPU") and record["provenance"]["git_commit"]
