"""decode.row_argmax: torch.argmax's indices (first of ties, NaN the largest), by chunks on a CPU."""

from __future__ import annotations

import pytest
import torch

from attnlab.config import ModelConfig
from attnlab.decode import ARGMAX_CHUNK, ARGMAX_MIN_NUMEL, greedy_search, row_argmax, sample_next
from attnlab.models.transformer import build_model
from conftest import jitter


def hard_rows(n: int, V: int, seed: int) -> torch.Tensor:
    """(n, V) logits whose rows are the cases a chunked argmax can get wrong: ties within a chunk, across chunks,
    between a chunk and the tail, a NaN (first NaN wins), rows of -inf, constant rows, the maximum at either end."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g)  # (n, V)
    w, tail = ARGMAX_CHUNK, min((V // ARGMAX_CHUNK) * ARGMAX_CHUNK, V - 1)  # the first logit past the chunks
    cases = [
        [(5, 9.0), (6, 9.0)], [(3 * w + 1, 9.0), (w + 7, 9.0)], [(V - 1, 9.0), (w - 1, 9.0)],
        [(V - 1, 9.0)], [(0, 9.0)], [(tail, 9.0), (V - 1, 9.0)], [(2 * w, float("nan")), (w + 3, float("nan"))],
        [(V - 2, float("nan"))], [(V - 1, float("nan")), (4, 99.0)], [(w, 9.0), (V - 1, 8.0)],
    ]
    for r, sets in enumerate(cases):
        for j, v in sets:
            x[r, j % V] = v  # a narrow vocabulary folds the far positions back
    x[len(cases)] = float("-inf")
    x[len(cases) + 1] = 0.5
    x[len(cases) + 2, : w] = float("-inf")
    return x


@pytest.mark.parametrize("V", [4000, 4096, 2 * ARGMAX_CHUNK, 1037])
def test_row_argmax_gives_torchs_indices_on_ties_nans_and_infinities(V):
    n = max(20, -(-ARGMAX_MIN_NUMEL // V))  # enough rows for the chunked path
    x = hard_rows(n, V, seed=V)
    assert x.numel() >= ARGMAX_MIN_NUMEL
    assert torch.equal(row_argmax(x), x.argmax(-1))
    view = torch.cat([x, x], 1)[:, None, :V][:, -1]  # a strided view, as a decoder step's last position is
    assert not view.is_contiguous() or view.stride(0) != V
    assert torch.equal(row_argmax(view), x.argmax(-1))


def test_greedy_sampling_takes_torchs_argmax_through_the_chunks():
    """A language model's greedy next tokens (sample_next with greedy=True or temperature 0) over hard rows."""
    x = hard_rows(40, 32000, seed=3)
    assert x.numel() >= ARGMAX_MIN_NUMEL
    assert torch.equal(sample_next(x, greedy=True), x.argmax(-1))
    assert torch.equal(sample_next(x, temperature=0.0), x.argmax(-1))


def test_row_argmax_on_few_logits_or_a_narrow_vocabulary_is_torchs():
    for shape in [(1, 4000), (3, 200), (600, 100)]:  # too few logits; too few chunks for a vocabulary of 100
        x = hard_rows(max(shape[0], 13), shape[1], seed=1)[: shape[0]]
        assert torch.equal(row_argmax(x), x.argmax(-1))


def test_greedy_search_over_a_wide_vocabulary_equals_argmax_of_each_step():
    """A batch whose step logits take the chunked path: greedy_search's tokens are those of torch.argmax over the
    same model's full forward, one sentence at a time."""
    torch.manual_seed(0)
    V = 1500
    cfg = ModelConfig(arch="encoder_decoder", vocab_size=V, d_model=32, n_heads=4, n_enc_layers=1, n_dec_layers=1,
                      dropout=0.0, tie_embeddings="none")
    model = jitter(build_model(cfg), 0).eval()
    with torch.no_grad():
        model.head.weight.mul_(40)  # sharp logits: outputs of varied lengths, some ending at EOS
    g = torch.Generator().manual_seed(2)
    src = torch.randint(3, V, (48, 6), generator=g)  # (48, 6) 48 x 1,500 logits a step: the chunked path
    got = greedy_search(model, src, max_len_a=0.0, max_len_b=5)
    with torch.no_grad():
        for row, hyp in zip(src, got, strict=True):
            memory, src_pad = model.encode(row[None])
            out: list[int] = []
            while len(out) < 5:
                logits = model.decode(torch.tensor([[1] + out]), memory, src_pad)[0, -1]  # (V,)
                logits[0] = float("-inf")
                tok = int(logits.argmax())
                if tok == 2:
                    break
                out.append(tok)
            assert hyp == out
    assert len({t for h in got for t in h}) > 20  # the rows' tokens differ: not one logit that always wins

