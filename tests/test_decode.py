"""Decoding: greedy and beam search against cache-free references, sampling."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from attnlab.config import ModelConfig
from attnlab.decode import (
    beam_search,
    generate,
    greedy_search,
    length_penalty,
    max_lengths,
    sample_next,
)
from attnlab.decode_graph import choose_beams
from attnlab.models.attention import KVCache
from attnlab.models.transformer import build_model
from conftest import jitter

PAD, BOS, EOS = 0, 1, 2
V = 40


def tiny(arch: str = "encoder_decoder", seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(arch=arch, vocab_size=V, d_model=32, n_heads=4, n_enc_layers=2, n_dec_layers=2, dropout=0.0, **kw)
    return jitter(build_model(cfg), seed).eval()  # biases != 0, norms != 1: each path must apply them


def bias_token(model: nn.Module, token: int, value: float) -> nn.Module:
    """Add `value` to one logit of every decoder step (the real model and cache underneath)."""
    decode = model.decode

    def biased(*args, **kwargs):
        logits = decode(*args, **kwargs)  # (B, T, V)
        logits[..., token] += value
        return logits

    model.decode = biased
    return model


def padded_sources(lengths: list[int], seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (len(lengths), max(lengths)), generator=g)  # (B, S)
    for i, n in enumerate(lengths):
        src[i, n:] = PAD
    return src


LENGTHS = [7, 3, 5, 1, 6, 4]


def eos_ramp(model: nn.Module, slope: float, offset: float) -> nn.Module:
    """EOS logit += slope * position - offset: the same with or without a cache, and it makes a random
    model end its outputs at varied lengths (some by EOS, some at the max length)."""
    decode = model.decode

    def biased(tgt, memory, src_pad, cache=None, **kw):
        start = cache.pos if cache is not None else 0  # read before the call advances it
        logits = decode(tgt, memory, src_pad, cache, **kw)  # (B, T, V)
        logits[..., EOS] += slope * torch.arange(start, start + tgt.shape[1]) - offset
        return logits

    model.decode = biased
    return model


@pytest.fixture(scope="module")
def seq2seq() -> nn.Module:
    return eos_ramp(tiny(tie_embeddings="none"), 0.8, 3.0)


@torch.no_grad()
def full_lprobs(model, src_row: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    """Log-probs of the next token after BOS + prefix, recomputing the whole forward (no cache)."""
    src_row = src_row[src_row.ne(PAD)][None]  # (1, S) without padding
    memory, src_pad = model.encode(src_row)
    tgt = torch.tensor([[BOS] + prefix])  # (1, T)
    return model.decode(tgt, memory, src_pad)[0, -1].float().log_softmax(-1)  # (V,)


def naive_greedy(model, src: torch.Tensor, a: float, b: int) -> list[list[int]]:
    out = []
    for row in src:
        limit = math.floor(a * int(row.ne(PAD).sum()) + b)
        hyp: list[int] = []
        while len(hyp) < limit:
            lp = full_lprobs(model, row, hyp)
            lp[PAD] = -math.inf
            tok = int(lp.argmax())
            if tok == EOS:
                break
            hyp.append(tok)
        out.append(hyp)
    return out


@torch.no_grad()
def sequence_score(model, src_row, hyp, alpha, kind="gnmt") -> float:
    """Full-forward log p(hyp + EOS | src) / lp(len + 1)."""
    src_row = src_row[src_row.ne(PAD)][None]
    logits = model(src_row, torch.tensor([[BOS] + hyp]))[0].float().log_softmax(-1)  # (T, V)
    target = torch.tensor(hyp + [EOS])
    return float(logits.gather(1, target[:, None]).sum()) / length_penalty(len(hyp) + 1, alpha, kind)


def naive_beam(model, src_row, K: int, alpha: float, limit: int) -> list[tuple[list[int], float]]:
    """fairseq-style beam search for one sentence with full recomputation and Python bookkeeping."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    for t in range(limit + 1):
        cands = []
        for toks, s in live:
            lp = full_lprobs(model, src_row, toks).double()
            lp[PAD] = -math.inf
            if t >= limit:
                lp[torch.arange(V) != EOS] = -math.inf
            cands += [(s + float(lp[v]), toks, v) for v in range(V)]
        cands = sorted(cands, key=lambda c: -c[0])[: 2 * K]
        finished += [(toks, s / length_penalty(t + 1, alpha)) for s, toks, v in cands[:K]
                     if v == EOS and s > -math.inf]
        live = [(toks + [v], s) for s, toks, v in cands if v != EOS][:K]
        if len(finished) >= K or t >= limit:
            break
    return sorted(finished, key=lambda h: -h[1])[:K]


# ---------------------------------------------------------------------------------------------
# greedy and beam search on a real (random) encoder-decoder
# ---------------------------------------------------------------------------------------------
def test_greedy_with_cache_equals_full_recompute(seq2seq):
    src = padded_sources(LENGTHS)
    got = greedy_search(seq2seq, src, max_len_a=1.0, max_len_b=3)
    assert got == naive_greedy(seq2seq, src, 1.0, 3)
    ended = [len(h) < n + 3 for h, n in zip(got, LENGTHS, strict=True)]
    assert any(ended) and not all(ended)  # some end at EOS, some at their max length: both paths are tested


def test_beam_1_equals_greedy_exactly(seq2seq):
    src = padded_sources(LENGTHS + [2, 7, 5], seed=3)
    greedy = greedy_search(seq2seq, src, max_len_a=1.0, max_len_b=3)
    for penalty in ("gnmt", "fairseq"):
        beam = beam_search(seq2seq, src, beam_size=1, penalty=penalty, max_len_a=1.0, max_len_b=3)
        assert [h[0][0] for h in beam] == greedy


def test_beam_with_cache_equals_naive_beam_and_scores_are_model_log_probs(seq2seq):
    src = padded_sources(LENGTHS, seed=5)
    K, alpha, a, b = 3, 0.6, 1.0, 2
    got = beam_search(seq2seq, src, beam_size=K, len_penalty=alpha, max_len_a=a, max_len_b=b, nbest=K)
    for row, hyps in zip(src, got, strict=True):
        ref = naive_beam(seq2seq, row, K, alpha, math.floor(a * int(row.ne(PAD).sum()) + b))
        assert [h for h, _ in hyps] == [h for h, _ in ref]
        for hyp, score in hyps:
            assert score == pytest.approx(sequence_score(seq2seq, row, hyp, alpha), abs=1e-4)
            assert math.isfinite(score)
        assert [s for _, s in hyps] == sorted((s for _, s in hyps), reverse=True)
        assert len({tuple(h) for h, _ in hyps}) == len(hyps)  # distinct hypotheses


def test_bound_stopping_never_worse_than_greedy_at_beam_1(seq2seq):
    # early_stop=False keeps searching after greedy's hypothesis finishes and keeps the best finished,
    # and the greedy path is always among the candidates: its score can only be matched or beaten
    src = padded_sources(LENGTHS, seed=7)
    kw = dict(beam_size=1, len_penalty=1.0, max_len_a=1.0, max_len_b=3)
    count = beam_search(seq2seq, src, early_stop=True, **kw)
    bound = beam_search(seq2seq, src, early_stop=False, **kw)
    for row, c, b in zip(src, count, bound, strict=True):
        assert b[0][1] >= c[0][1] - 1e-6
        assert b[0][1] == pytest.approx(sequence_score(seq2seq, row, b[0][0], 1.0), abs=1e-4)


def test_eos_first_gives_empty_hypotheses():
    model = bias_token(tiny(), EOS, 100.0)
    src = padded_sources(LENGTHS)
    assert greedy_search(model, src) == [[]] * len(LENGTHS)
    for hyps in beam_search(model, src, beam_size=4, nbest=1):
        assert hyps[0][0] == [] and hyps[0][1] == pytest.approx(0.0, abs=1e-3)  # log p(EOS) ~ 0, lp(1) = 1


@pytest.mark.parametrize("a,b", [(0.5, 2), (1.0, 0), (0.0, 3)])
def test_max_length_is_a_times_source_length_plus_b(a, b):
    model = bias_token(tiny(), EOS, -100.0)  # never ends by itself
    src = padded_sources(LENGTHS)
    want = [math.floor(a * n + b) for n in LENGTHS]
    assert max_lengths(model, src, a, b).tolist() == want
    assert [len(h) for h in greedy_search(model, src, max_len_a=a, max_len_b=b)] == want
    for beam in (1, 3):
        hyps = beam_search(model, src, beam_size=beam, max_len_a=a, max_len_b=b, nbest=beam)
        assert [[len(h) for h, _ in n] for n in hyps] == [[w] * beam for w in want]
        assert all(math.isfinite(s) for n in hyps for _, s in n)


def test_learned_positions_cap_the_length():
    model = tiny(position="learned", max_seq_len=6)
    src = padded_sources([4, 2])
    assert max_lengths(model, src, 1.0, 50).tolist() == [5, 5]
    assert all(len(h[0][0]) <= 5 for h in beam_search(model, src, beam_size=2, max_len_b=50))


def test_beam_search_rejects_bad_arguments(seq2seq):
    src = padded_sources([3])
    with pytest.raises(ValueError, match="nbest"):
        beam_search(seq2seq, src, beam_size=2, nbest=3)
    with pytest.raises(ValueError, match="penalty"):
        beam_search(seq2seq, src, penalty="wu")


def test_decoding_restores_training_mode(seq2seq):
    seq2seq.train()
    greedy_search(seq2seq, padded_sources([3]), max_len_b=2)
    assert seq2seq.training
    seq2seq.eval()


# ---------------------------------------------------------------------------------------------
# a hand-built Markov "translation model" whose best output is known
# ---------------------------------------------------------------------------------------------
class Markov(nn.Module):
    """Next-token distribution depends only on the previous token: table[prev] = probabilities."""

    def __init__(self, table: dict[int, dict[int, float]], vocab: int = 6) -> None:
        super().__init__()
        self.cfg = SimpleNamespace(vocab_size=vocab, position="sinusoidal", max_seq_len=100)
        lp = torch.full((vocab, vocab), -30.0)
        for prev, nxt in table.items():
            for tok, p in nxt.items():
                lp[prev, tok] = math.log(p)
        self.register_buffer("lp", lp)

    def encode(self, src):
        return torch.zeros(*src.shape, 1), src.eq(PAD)

    def decode(self, tgt, memory, src_pad, cache=None, check=True):
        if cache is not None:
            cache.pos += tgt.shape[1]
        return self.lp[tgt]  # (B, T, V)

    def new_cache(self):
        return KVCache(1)

    def cache_cross_attention(self, memory, cache):  # no cross-attention: nothing to fill
        pass

    def log_prob(self, hyp: list[int]) -> float:
        seq = [BOS] + hyp + [EOS]
        return sum(float(self.lp[p].log_softmax(-1)[n]) for p, n in itertools.pairwise(seq))


A, B, C = 3, 4, 5
# greedy takes A (0.5) and then has nothing good; B (0.4) is followed by EOS with 0.9
GARDEN = {BOS: {A: 0.5, B: 0.4, C: 0.1}, A: {EOS: 0.3, A: 0.26, B: 0.24, C: 0.2},
          B: {EOS: 0.9, A: 0.04, B: 0.03, C: 0.03}, C: {EOS: 0.5, A: 0.2, B: 0.2, C: 0.1}}


def brute_force_best(model: Markov, limit: int, alpha: float, kind: str = "gnmt") -> list[int]:
    seqs = [list(s) for n in range(limit + 1) for s in itertools.product((A, B, C), repeat=n)]
    return max(seqs, key=lambda s: model.log_prob(s) / length_penalty(len(s) + 1, alpha, kind))


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
def test_beam_finds_the_known_best_where_greedy_fails(early_stop, alpha):
    model = Markov(GARDEN)
    src = torch.tensor([[A, B, C, PAD], [A, B, C, A]])
    best = brute_force_best(model, 4, alpha)
    assert best == [B]
    assert greedy_search(model, src, max_len_a=1.0, max_len_b=0) == [[A], [A]]
    for hyps in beam_search(model, src, beam_size=2, len_penalty=alpha, max_len_a=1.0, max_len_b=0,
                            early_stop=early_stop):
        assert hyps[0][0] == best
        assert hyps[0][1] == pytest.approx(model.log_prob(best) / length_penalty(2, alpha), abs=1e-5)


def check_ties_keep_the_earlier_finished(device: str) -> None:
    """choose_beams merges new finished hypotheses into the kept ones by a stable sort: on equal scores the one
    finished earlier stays first. 8 kept and 8 new of one score in 64 sentences: an unstable sort (CUDA's is, for
    short rows; a CPU's happens not to be) or the new ones merged first moves new lengths in."""
    n, K, t = 64, 8, 5
    lprobs = -2.0 - torch.arange(V, device=device, dtype=torch.float32) / V  # (V,) distinct non-EOS scores
    lprobs = lprobs.expand(n, K, V).clone()  # (n, K, V)
    lprobs[..., EOS] = -1.0  # every beam's EOS: K new finished of one score, the K best candidates
    fin_scores = torch.full((n, K), -1.0, dtype=torch.float64, device=device)  # (n, K) K kept, the same score
    fin_len = torch.arange(100, 100 + K, device=device).expand(n, K).clone()  # (n, K) their lengths
    no = torch.zeros(n, dtype=torch.bool, device=device)
    c = choose_beams(lprobs, torch.zeros(n, K, device=device), fin_scores, fin_len, 1.0, t, no,
                     torch.ones((), dtype=torch.float64, device=device), EOS, early_stop=False, nbest=1)
    assert c.fin_scores.eq(-1.0).all()
    assert c.order.tolist() == [list(range(K))] * n  # the kept ones, in their order
    assert c.fin_len.tolist() == [list(range(100, 100 + K))] * n
    assert c.done.all()  # the best finished (-1) beats every live beam's bound (-2 and below)


def test_beam_step_ties_keep_the_earlier_finished_first():
    check_ties_keep_the_earlier_finished("cpu")


def test_length_penalty_formulas():
    for n, a in [(1, 0.6), (7, 0.6), (10, 1.0), (3, 0.0)]:
        assert length_penalty(n, a) == pytest.approx(((5 + n) / 6) ** a)
        assert length_penalty(n, a, "fairseq") == pytest.approx(n**a)
    assert length_penalty(1, 0.6) == 1.0 and length_penalty(10, 1.0) == 2.5
    assert length_penalty(torch.tensor([1, 10]), 1.0).tolist() == pytest.approx([1.0, 2.5])
    # a short and a long hypothesis: alpha = 0 ranks by log-prob, a larger alpha favours the long one
    short, long_ = (-2.0, 2), (-2.5, 10)
    for kind in ("gnmt", "fairseq"):
        def score(h, a, kind=kind):
            return h[0] / length_penalty(h[1], a, kind)
        assert score(short, 0.0) > score(long_, 0.0)
        assert score(short, 1.0) < score(long_, 1.0)


@pytest.mark.parametrize("penalty", ["gnmt", "fairseq"])
def test_alpha_changes_the_ranking_end_to_end(penalty):
    # [] (p 0.5) against [A] (0.45 * 0.9 = 0.405): alpha = 0 prefers the shorter, a large alpha the longer
    model = Markov({BOS: {EOS: 0.5, A: 0.45, B: 0.05}, A: {EOS: 0.9, A: 0.05, B: 0.05}})
    src = torch.tensor([[A, B]])
    low = beam_search(model, src, beam_size=2, len_penalty=0.0, penalty=penalty, nbest=2)[0]
    high = beam_search(model, src, beam_size=2, len_penalty=2.0, penalty=penalty, nbest=2)[0]
    assert [h for h, _ in low] == [[], [A]]
    assert [h for h, _ in high] == [[A], []]


# ---------------------------------------------------------------------------------------------
# language-model generation
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm() -> nn.Module:
    return tiny("decoder_only", seed=2, tie_embeddings="none")


@torch.no_grad()
def naive_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids


def test_greedy_generate_with_cache_equals_full_recompute(lm):
    prompts = torch.randint(3, V, (3, 4), generator=torch.Generator().manual_seed(0))
    got = generate(lm, prompts, max_new_tokens=8, greedy=True)
    assert got == [naive_generate(lm, p, 8) for p in prompts.tolist()]
    assert generate(lm, prompts, max_new_tokens=8, temperature=0.0) == got


def test_unequal_prompts_are_grouped_by_length(lm):
    prompts = [[1, 5, 9], [1, 7, 8, 20, 11], [1, 4, 4], [1]]
    got = generate(lm, prompts, max_new_tokens=6, greedy=True)
    assert got == [naive_generate(lm, p, 6) for p in prompts]


def test_top_k_1_and_tiny_top_p_equal_greedy(lm):
    prompts = torch.randint(3, V, (4, 3), generator=torch.Generator().manual_seed(1))
    greedy = generate(lm, prompts, max_new_tokens=6, greedy=True)
    g = torch.Generator().manual_seed(0)
    assert generate(lm, prompts, max_new_tokens=6, top_k=1, generator=g) == greedy
    assert generate(lm, prompts, max_new_tokens=6, top_p=1e-6, generator=g) == greedy


def test_sampling_is_reproducible_with_a_seeded_generator(lm):
    prompts = [[1, 5], [1, 6, 7]]
    kw = dict(max_new_tokens=10, temperature=1.3, top_k=20, top_p=0.9)
    a = generate(lm, prompts, generator=torch.Generator().manual_seed(123), **kw)
    b = generate(lm, prompts, generator=torch.Generator().manual_seed(123), **kw)
    assert a == b


def test_temperature_shapes_the_distribution(lm):
    prompt = torch.tensor([[1, 5, 9]]).expand(4000, 3)  # (N, T): N draws of the first new token
    with torch.no_grad():
        logits = lm(prompt[:1])[0, -1].float()  # (V,)
    entropy = {}
    for temp in (0.5, 2.0):
        toks = generate(lm, prompt, max_new_tokens=1, temperature=temp, generator=torch.Generator().manual_seed(0))
        freq = torch.bincount(torch.tensor([t[-1] for t in toks]), minlength=V).float() / len(toks)
        want = (logits / temp).softmax(-1)
        assert (freq - want).abs().max() < 0.03
        entropy[temp] = -(want * want.log()).sum()
    assert entropy[0.5] < entropy[2.0]


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]]).expand(2000, 5)  # p ~ .64 .23 .09 .03 .004
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, top_k=2, generator=g).tolist()) == {0, 1}
    assert set(sample_next(logits, top_p=0.8, generator=g).tolist()) == {0, 1}  # .64 < .8 <= .64 + .23


def test_generate_stops_rows_at_eos(lm):
    prompts = [[1, 5, 9], [1, 7, 8]]  # one batch
    free = [p[len(q):] for p, q in zip(generate(lm, prompts, max_new_tokens=8, greedy=True), prompts, strict=True)]
    # the first new token of row 0 not generated before it plays EOS: row 0 stops there, row 1 goes on
    j = next(j for j in range(1, 8) if free[0][j] not in free[0][:j])
    eos = free[0][j]
    got = generate(lm, prompts, max_new_tokens=8, greedy=True, eos_id=eos)
    assert got[0] == prompts[0] + free[0][: j + 1]
    cut = free[1].index(eos) + 1 if eos in free[1] else 8
    assert got[1] == prompts[1] + free[1][:cut]


def test_generate_needs_a_decoder_only_model(seq2seq):
    with pytest.raises(TypeError, match="decoder_only"):
        generate(seq2seq, [[1, 2]], max_new_tokens=2)


@pytest.mark.parametrize("fork", [True, False], ids=["processes", "threads"])
@pytest.mark.parametrize("beam", [1, 3])
def test_translate_lines_gives_the_sequential_texts_on_any_number_of_workers(no_hang, tokenizer, beam, fork, tmp_path,
                                                                             monkeypatch):
    """translate_lines with token batches decoded by 2 or 3 workers at once (this thread and forked processes, or
    threads where a fork is not safe; each batch on its own worker, in order of cost) gives the texts of one worker
    decoding them in turn, empty lines included; torch's thread count is back after."""
    import os
    import threading

    import attnlab.decode_workers
    from attnlab.evaluate import translate_lines
    from attnlab.lit import Seq2SeqModule
    from conftest import make_pairs

    monkeypatch.setattr(attnlab.decode_workers, "can_fork", lambda: fork)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_enc_layers=2, n_dec_layers=2,
                      dropout=0.0)
    torch.manual_seed(0)
    module = Seq2SeqModule(cfg.to_dict(), {}, {"max_len_a": 0.5, "max_len_b": 4})  # lengths: 4 + half the source's
    jitter(module.model, seed=3)
    lines = [s for s, _ in make_pairs(40, seed=7)] + ["", "open the window 3."]
    log = tmp_path / "workers.log"  # one line a batch, from whichever process decodes it: "pid thread"
    real = module.translate_ids

    def spy(src, b=None):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {threading.current_thread().name}\n")
        return real(src, b)

    module.translate_ids = spy

    def seen() -> list[str]:
        text = log.read_text() if log.exists() else ""
        log.unlink(missing_ok=True)
        return text.splitlines()

    threads = torch.get_num_threads()
    alone = translate_lines(module, tokenizer, lines, beam=beam, device="cpu", max_tokens=60, workers=1)
    first = seen()
    assert set(first) == {f"{os.getpid()} {threading.current_thread().name}"} and len(first) >= 6  # here, in turn
    assert alone[40] == "" and all(alone[:40])
    for workers in (2, 3):
        assert translate_lines(module, tokenizer, lines, beam=beam, device="cpu", max_tokens=60,
                               workers=workers) == alone
        where = seen()
        assert len(where) == len(first) and 2 <= len(set(where)) <= workers and torch.get_num_threads() == threads
        pids = {int(w.split()[0]) for w in where}
        assert (os.getpid() in pids and len(pids) >= 2) if fork else (pids == {os.getpid()}), where


@pytest.mark.parametrize("beam", [1, 4])
def test_translate_lines_on_a_cpu_batches_by_tokens_whatever_the_decode_configs_sentences(tokenizer, beam,
                                                                                          monkeypatch):
    """On a CPU translate_lines' batches hold up to 1,024 rows (sentences x beam) and decode.max_tokens but at most
    4,096 source tokens, not decode.batch_sentences (a GPU's memory bound: small batches on a CPU pay a step's fixed
    cost for few sentences); sizes given to it win; on CUDA the decode config's stand. The texts are those of the
    decode config's batches."""
    from attnlab import evaluate
    from attnlab.config import DecodeConfig
    from attnlab.lit import Seq2SeqModule
    from conftest import make_pairs

    decode = DecodeConfig(batch_sentences=8, max_tokens=8192)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert evaluate.batch_sizes(decode, cpu, beam) == (1024 // beam, 4096)
    assert evaluate.batch_sizes(decode.replace(max_tokens=300), cpu, beam) == (1024 // beam, 300)
    assert evaluate.batch_sizes(decode.replace(max_tokens=0), cpu, beam) == (1024 // beam, 4096)
    assert evaluate.batch_sizes(decode, cpu, beam, 5, 0) == (5, 0)
    assert evaluate.batch_sizes(decode, cuda, beam) == (8, 8192)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, n_enc_layers=1, n_dec_layers=1,
                      dropout=0.0)
    torch.manual_seed(0)
    module = Seq2SeqModule(cfg.to_dict(), {}, {"max_len_a": 0.5, "max_len_b": 4, "batch_sentences": 8})
    jitter(module.model, seed=3)
    lines = [s for s, _ in make_pairs(60, seed=11)]
    sizes: list[tuple[int, int]] = []
    real = evaluate.token_batches
    monkeypatch.setattr(evaluate, "token_batches", lambda n, bs, mt=0: sizes.append((bs, mt)) or real(n, bs, mt))
    own = evaluate.translate_lines(module, tokenizer, lines, beam=beam, device="cpu", workers=1)
    by_config = evaluate.translate_lines(module, tokenizer, lines, beam=beam, device="cpu", workers=1,
                                         batch_sentences=8, max_tokens=8192)
    assert sizes == [(1024 // beam, 4096), (8, 8192)]
    assert own == by_config and all(own)
