"""Fast decoding paths against the plain ones: the static KV cache (int and device-side position), the
fixed-shape graph step (run eagerly on a CPU, traced by torch.compile), and "EOS off" (min_len, min_new_tokens)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch import nn

from attnlab.config import ModelConfig
from attnlab.decode import beam_search, generate, greedy_search
from attnlab.models.attention import KVCache, Mask, StaticKVCache, select_rows
from attnlab.models.transformer import build_model
from conftest import jitter
from dispatch_count import DispatchCount

PAD, BOS, EOS = 0, 1, 2
V = 50


def lm(seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    base = dict(arch="decoder_only", vocab_size=V, d_model=32, n_heads=4, n_kv_heads=2, n_dec_layers=2,
                norm="rmsnorm", norm_position="pre", ffn="swiglu", position="rope", dropout=0.0, max_seq_len=64)
    return jitter(build_model(ModelConfig(**{**base, **kw})), seed).eval()  # biases != 0, norms != 1


def seq2seq(seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    base = dict(vocab_size=V, d_model=32, n_heads=4, n_enc_layers=2, n_dec_layers=2, dropout=0.0)
    return jitter(build_model(ModelConfig(**{**base, **kw})), seed).eval()  # biases != 0, norms != 1


def logit_bias(model: nn.Module, token: int, value: float) -> nn.Module:
    """Add `value` to `token`'s logit wherever the model projects to the vocabulary (both decoding paths do)."""
    logits = model.logits

    def biased(h):
        out = logits(h)  # (..., V)
        out[..., token] += value
        return out

    model.logits = biased
    return model


def stepwise_logits(model, ids: torch.Tensor, cache, chunks: list[int], device_pos_from: int | None = None):
    """Logits of ids fed to the decoder in `chunks` (lengths), the cache switched to a device-side position
    before chunk number `device_pos_from`."""
    out, at = [], 0
    for i, n in enumerate(chunks):
        if device_pos_from is not None and i == device_pos_from:
            cache.device_position(ids.device)
        out.append(model.logits(model.decoder(ids[:, at:at + n], cache=cache)))  # (B, n, V)
        at += n
    return torch.cat(out, 1)  # (B, T, V)


@pytest.mark.parametrize("position", ["rope", "sinusoidal", "learned", "none"])
def test_static_cache_gives_the_logits_of_the_growing_cache_and_of_no_cache(position):
    model = lm(position=position)
    ids = torch.randint(3, V, (3, 14))
    chunks = [5, 1, 1, 3, 1, 1, 1, 1]  # a prefill, single tokens, a chunk of three in the middle
    with torch.no_grad():
        full = model(ids)  # (B, T, V)
        growing = stepwise_logits(model, ids, KVCache(2), chunks)
        static = stepwise_logits(model, ids, StaticKVCache(2, 20), chunks)
        device = stepwise_logits(model, ids, StaticKVCache(2, 20), chunks, device_pos_from=1)
    torch.testing.assert_close(growing, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static, growing, rtol=0, atol=0)  # the same keys in the same order: bitwise
    torch.testing.assert_close(device, growing, rtol=1e-5, atol=1e-5)  # the whole buffer, later slots masked


@pytest.mark.parametrize("position", ["rope", "learned"])
@pytest.mark.parametrize("greedy", [True, False])
def test_generate_gives_the_same_tokens_with_every_cache(position, greedy):
    model = lm(seed=1, position=position)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]  # two lengths: two groups
    runs = []
    for cache in ("dynamic", "static", "graph"):
        g = torch.Generator().manual_seed(3)
        runs.append(generate(model, prompts, 12, greedy=greedy, temperature=0.8, top_k=20, generator=g, cache=cache))
    assert runs[0] == runs[1] == runs[2]
    assert [len(r) for r in runs[0]] == [16, 14, 16]


def test_the_compiled_graph_step_traces_as_one_graph_and_gives_the_same_tokens(monkeypatch):
    """compile_step=True with fullgraph: a graph break fails here. The eager backend keeps this test cheap on a
    CPU (no code generation); on CUDA tests/test_gpu.py runs the default backend under a CUDA graph."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    model = lm(seed=2)
    prompt = torch.randint(3, V, (2, 6))
    want = generate(model, prompt, 8, greedy=True)
    assert generate(model, prompt, 8, greedy=True, cache="graph", compile_step=True) == want
    torch._dynamo.reset()


def test_translation_with_a_static_cache_equals_the_growing_cache():
    model = seq2seq(tie_embeddings="none")
    src = torch.randint(3, V, (5, 8))
    src[1, 4:] = PAD
    src[3, 2:] = PAD
    assert greedy_search(model, src, static_cache=True) == greedy_search(model, src)
    a = beam_search(model, src, beam_size=3, nbest=2, static_cache=True)
    b = beam_search(model, src, beam_size=3, nbest=2)
    assert [[h for h, _ in s] for s in a] == [[h for h, _ in s] for s in b]
    for sa, sb in zip(a, b, strict=True):
        assert [s for _, s in sa] == pytest.approx([s for _, s in sb], rel=1e-6)


def test_static_cache_reorder_selects_rows_like_the_growing_cache():
    model = lm(seed=4)
    ids = torch.randint(3, V, (4, 6))
    index = torch.tensor([2, 2, 0, 3])
    with torch.no_grad():
        out = []
        for cache in (KVCache(2), StaticKVCache(2, 10)):
            model.decoder(ids, cache=cache)
            cache.reorder(index)
            out.append(model.logits(model.decoder(ids[:, :2], cache=cache)))  # (B, 2, V)
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=0)


def test_static_cache_limits_are_clear_errors():
    model = lm()
    cache = StaticKVCache(2, 5)
    with torch.no_grad(), pytest.raises(ValueError, match="holds 5 positions; position 5"):
        model.decoder(torch.randint(3, V, (1, 6)), cache=cache)
    with pytest.raises(ValueError, match="max_len=0"):
        StaticKVCache(2, 0)
    device_cache = StaticKVCache(1, 4)
    device_cache.device_position("cpu")
    k = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match="no mask bias"):
        device_cache.append(0, k, k, Mask(bias=torch.ones(1, 4, dtype=torch.bool)))
    with pytest.raises(ValueError, match="cache='bogus' is not one of"):
        generate(model, [[3]], 2, cache="bogus")
    with pytest.raises(ValueError, match="compile_step"):
        generate(model, [[3]], 2, compile_step=True)
    with pytest.raises(ValueError, match="alibi"):
        generate(lm(position="alibi"), [[3]], 2, cache="graph")
    for cache in ("static", "dynamic"):  # refused before any token is made (dynamic: it failed at the 8th)
        with pytest.raises(ValueError, match=r"prompt 3 \+ 7 new tokens is longer than the learned position table"):
            generate(lm(position="learned", max_seq_len=8), [[3, 4, 5]], 7, cache=cache)
    assert len(generate(lm(position="learned", max_seq_len=8), [[3, 4, 5]], 6, cache="dynamic", eos_id=None)[0]) == 9


# ------------------------------------------------------------------------------------------ EOS off
def test_min_len_holds_eos_back_in_greedy_and_beam_search():
    model = logit_bias(seq2seq(seed=5), EOS, 30.0)  # EOS would win every step
    src = torch.randint(3, V, (3, 6))
    assert greedy_search(model, src) == [[], [], []]
    assert all(h[0][0] == [] for h in beam_search(model, src))
    fixed = greedy_search(model, src, max_len_a=0, max_len_b=7, min_len=7)
    assert [len(r) for r in fixed] == [7, 7, 7]
    longer = greedy_search(model, src, max_len_a=0, max_len_b=20, min_len=4)
    assert [len(r) for r in longer] == [4, 4, 4]  # EOS as soon as it may come
    beams = beam_search(model, src, max_len_a=0, max_len_b=7, min_len=7, nbest=2)
    assert all(len(h) == 7 for s in beams for h, _ in s)
    assert [s[0][0] for s in beam_search(model, src, beam_size=1, max_len_a=0, max_len_b=7, min_len=7)] == fixed
    # min_len beyond the max length: the max length still ends every output (EOS forced)
    assert all(len(s[0][0]) == 3 for s in beam_search(model, src, max_len_a=0, max_len_b=3, min_len=10))


def test_min_len_tokens_are_those_of_the_model_without_eos():
    src = torch.randint(3, V, (4, 7))
    want = greedy_search(logit_bias(seq2seq(seed=6), EOS, float("-inf")), src, max_len_a=0, max_len_b=6)
    got = greedy_search(logit_bias(seq2seq(seed=6), EOS, 30.0), src, max_len_a=0, max_len_b=6, min_len=6)
    assert got == want and all(len(r) == 6 for r in got)


def test_min_new_tokens_holds_eos_back_in_generate(monkeypatch):
    model = lm(seed=7)
    forward = model.forward

    def eos_first(*args, **kwargs):
        logits = forward(*args, **kwargs)  # (B, T, V)
        logits[..., EOS] += 30.0
        return logits

    monkeypatch.setattr(model, "forward", eos_first)
    prompt = [[3, 4, 5]]
    assert generate(model, prompt, 10, greedy=True, eos_id=EOS) == [[3, 4, 5, EOS]]
    out = generate(model, prompt, 10, greedy=True, eos_id=EOS, min_new_tokens=4)[0]
    assert len(out) == 3 + 5 and out[-1] == EOS and EOS not in out[3:-1]
    with pytest.raises(ValueError, match="min_new_tokens=-1"):
        generate(model, prompt, 10, min_new_tokens=-1)


def test_bf16_weights_decode_with_absolute_positions():
    """Sinusoidal positions are computed in fp32; a bf16 model adds them in bf16 rather than failing."""
    model = seq2seq(seed=8)
    src = torch.randint(3, V, (2, 6))
    tgt = torch.randint(3, V, (2, 5))
    with torch.no_grad():
        want = model(src, tgt)
        got = model.to(torch.bfloat16)(src, tgt)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 0.05 * want.abs().max()
    assert len(greedy_search(model, src, max_len_a=0, max_len_b=4, min_len=4)[0]) == 4


def decode_syncs(search, model, src, steps: int, **kw) -> int:
    with DispatchCount() as c:
        search(model, src, max_len_a=0, max_len_b=steps, min_len=steps, **kw)  # exactly `steps` tokens: EOS held back
    return c.syncs


@pytest.mark.parametrize("search,kw", [(greedy_search, {}), (beam_search, {"beam_size": 4}),
                                       (beam_search, {"beam_size": 4, "early_stop": False, "nbest": 2})])
def test_a_decode_step_makes_at_most_one_host_sync(search, kw):
    """Each step of greedy and beam search reads one thing back: whether every sentence is done. Finished
    hypotheses stay on the device until the end (one read of them then). Counted as the syncs that 8 more steps
    add, so the one-off reads (the length budget, the results) drop out."""
    model = seq2seq(n_kv_heads=2)
    src = torch.randint(3, V, (3, 7))
    per_step = (decode_syncs(search, model, src, 12, **kw) - decode_syncs(search, model, src, 4, **kw)) / 8
    assert per_step <= 1, per_step


def test_beam_search_projects_each_sentences_cross_attention_keys_once():
    """The encoder output's cross-attention K/V are computed once per sentence and layer (B rows), then shared
    by its K beams, not projected from a K-times repeated memory at the first step."""
    model = seq2seq()
    src = torch.randint(3, V, (3, 7))
    rows: list[int] = []
    for block in model.decoder.layers:
        block.cross_attn.kv_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    beam_search(model, src, beam_size=4, max_len_a=0, max_len_b=6, min_len=6)
    assert rows == [3] * len(model.decoder.layers)


# ------------------------------------------------------------------------------------------ batch shrinking
def decode_rows(search, model, src, **kw) -> tuple[list, list[int]]:
    """The search's output and the rows of each decoder call."""
    rows: list[int] = []
    decode = model.decode

    def spy(tgt, *args, **kwargs):
        rows.append(tgt.shape[0])
        return decode(tgt, *args, **kwargs)

    model.decode = spy
    return search(model, src, **kw), rows


@pytest.mark.parametrize("search,K", [(greedy_search, 1), (beam_search, 3)])
def test_a_sentence_that_is_done_leaves_the_batch(search, K):
    """Without EOS each sentence runs to its own max length (a = 1, b = 0: its source length); from then on it is
    no row of any decoder call (beam search takes one more step: EOS forced at the max length). Its output is
    the one it gets decoded alone. Beam search's first step decodes one row a sentence, not K."""
    lengths = [2, 7, 4, 7, 3]
    src = torch.randint(3, V, (len(lengths), max(lengths)))
    for i, n in enumerate(lengths):
        src[i, n:] = PAD
    model = logit_bias(seq2seq(seed=9), EOS, -30.0)  # EOS only where forced
    kw = {"max_len_a": 1.0, "max_len_b": 0} | ({"beam_size": K} if search is beam_search else {})
    out, rows = decode_rows(search, model, src, **kw)
    last = max(lengths) if K == 1 else max(lengths) + 1
    width = [1] + [K] * (last - 1)  # beam search's first step: one row a sentence (its beams are all BOS)
    assert rows == [width[t] * sum(n > t if K == 1 else n >= t for n in lengths) for t in range(last)]
    alone = [search(model, src[i:i + 1, :n], **kw)[0] for i, n in enumerate(lengths)]
    if K > 1:  # the same hypotheses; scores to float rounding (a padded source against an unpadded one)
        assert [s for h in out for _, s in h] == pytest.approx([s for h in alone for _, s in h], rel=1e-6)
        out, alone = [[t for t, _ in h] for h in out], [[t for t, _ in h] for h in alone]
    assert out == alone
    assert [len(h if K == 1 else h[0]) for h in out] == lengths


def test_beams_attend_to_their_sentences_one_row_of_cross_attention_keys():
    """The K beams of a sentence are K rows of queries over one cached row of keys and values: every cross-attention
    call of beam search after the first sees K times more query rows than key rows."""
    model = seq2seq(n_kv_heads=2)
    seen: list[tuple[int, int]] = []

    def hook(module, args, kwargs):
        cache, layer = kwargs.get("cache"), kwargs.get("layer", 0)
        if cache is not None and cache.cross_kv[layer] is not None:
            seen.append((args[0].shape[0], cache.cross_kv[layer][0].shape[0]))

    for block in model.decoder.layers:
        block.cross_attn.register_forward_pre_hook(hook, with_kwargs=True)
    beam_search(model, torch.randint(3, V, (3, 7)), beam_size=4, max_len_a=0, max_len_b=5, min_len=5)
    layers = len(model.decoder.layers)
    assert seen[:layers] == [(3, 3)] * layers  # the first step: one row a sentence
    assert len(seen) > layers and all(queries == 4 * keys for queries, keys in seen[layers:]), seen


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_shared_cross_attention_rows_give_what_repeated_rows_give(backend):
    """Cross-attention of B*g query rows over B cached rows (row b serves rows b*g .. b*g+g-1) equals attention over
    the rows repeated g times, padding included."""
    model = seq2seq(seed=3, n_kv_heads=2, attention_backend=backend)
    attn = model.decoder.layers[0].cross_attn
    memory = torch.randn(3, 6, 32)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = pad[2, 2:] = True
    x = torch.randn(3 * 4, 2, 32)  # (B*g, T, d)
    with torch.no_grad():
        shared, repeated = KVCache(1), KVCache(1)
        k, v = attn.memory_kv(memory)  # (B, Hkv, S, hd)
        shared.cross_kv[0] = (k, v)
        repeated.cross_kv[0] = (k.repeat_interleave(4, 0), v.repeat_interleave(4, 0))  # (B*g, Hkv, S, hd)
        got = attn(x, Mask(bias=~pad[:, None, None, :], key_pad=pad), cache=shared)
        pad4 = pad.repeat_interleave(4, 0)
        want = attn(x, Mask(bias=~pad4[:, None, None, :], key_pad=pad4), cache=repeated)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_select_rows_is_index_select():
    t = torch.randn(5, 3, 4, 2)
    index = torch.tensor([4, 0, 0, 2])
    assert torch.equal(select_rows(t, index), t.index_select(0, index))
    strided = t.transpose(1, 2)  # not contiguous: the plain path
    assert torch.equal(select_rows(strided, index), strided.index_select(0, index))


# ------------------------------------------------------------------------------------------ graph=True (fixed rows)
@pytest.mark.parametrize("kw", [{}, {"position": "rope", "n_kv_heads": 2, "norm_position": "pre"},
                                {"position": "learned", "max_seq_len": 16, "tie_embeddings": "none"}])
def test_graph_decoding_gives_the_tokens_of_the_shrinking_batch(kw):
    """graph=True keeps every row over a device-position static cache (on a CPU the step runs eagerly): the
    same tokens as the default path, whose batch shrinks, with sentences ending at different steps (an EOS
    bias), padded sources, n-best, the GNMT stopping bound and min_len."""
    model = logit_bias(seq2seq(seed=3, **kw), EOS, 1.0)
    torch.manual_seed(0)
    src = torch.randint(3, V, (6, 9))
    src[1, 5:] = PAD
    src[4, 2:] = PAD
    common = {"max_len_a": 1.0, "max_len_b": 4}
    assert greedy_search(model, src, graph=True, **common) == greedy_search(model, src, **common)
    lengths = {len(h) for h in greedy_search(model, src, **common)}
    assert len(lengths) >= 3, lengths  # the rows end at different steps (at EOS, at their max lengths)
    for beam in ({"beam_size": 3, "nbest": 2}, {"beam_size": 4, "early_stop": False, "nbest": 3},
                 {"beam_size": 2, "min_len": 3}):
        a = beam_search(model, src, graph=True, **common, **beam)
        b = beam_search(model, src, **common, **beam)
        assert [[h for h, _ in s] for s in a] == [[h for h, _ in s] for s in b], beam
        assert [s for h in a for _, s in h] == pytest.approx([s for h in b for _, s in h], rel=1e-6)


def test_a_sentence_done_under_graph_keeps_the_hypotheses_it_had_when_done():
    """Under graph=True a done sentence's beams go on (idle) and may finish better later. Sentence 0: step 0 ends
    it with EOS (p 0.4, score log 0.4) while token 5 (p 0.35) lives on, and at step 1 EOS (p 0.9) would give [5]
    a better score under a strong length penalty (-1.155 / (7/6)^2 = -0.85). It is done at step 0 (K = 1
    finished): the result is [], as when it leaves the batch. Sentence 1 decodes token 7 to its max length."""
    model, calls = seq2seq(), []

    def scripted(h):
        out = torch.full((*h.shape[:-1], V), -20.0)  # (rows, 1, V)
        out[..., 7] = 0.0
        if h.shape[0] == 2:  # sentence 0 is still a row (the shrinking batch drops it after step 0)
            out[0] = -20.0
            for tok, p in zip((EOS, 5, 6), (0.4, 0.35, 0.25) if not calls else (0.9, 0.05, 0.05), strict=True):
                out[0, ..., tok] = math.log(p)
        calls.append(1)
        return out

    model.logits = scripted
    src = torch.randint(3, V, (2, 4))
    for graph in (False, True):
        calls.clear()
        out = beam_search(model, src, beam_size=1, len_penalty=2.0, max_len_a=0, max_len_b=5, graph=graph)
        [(tokens, score)], [(rest, _)] = out
        assert tokens == [] and score == pytest.approx(math.log(0.4)) and rest == [7] * 5, (graph, out)


def test_graph_decoding_keeps_every_row_and_reads_one_flag_a_step():
    """The decoder runs n (greedy) or n*K (beam, after its first step of n) rows at every step, finished
    sentences included. A greedy step still reads one thing back to the host; beam search, whose whole step after
    the first is one fixed-shape step (decode_graph.BeamGraph), reads whether all are done once every 4 steps."""
    model = logit_bias(seq2seq(seed=3), EOS, 1.0)
    torch.manual_seed(0)
    src = torch.randint(3, V, (5, 7))
    src[1, 2:] = PAD
    src[3, 4:] = PAD
    rows: list[int] = []
    model.decoder.register_forward_hook(lambda m, args, out: rows.append(out.shape[0]))
    kw = {"max_len_a": 1.0, "max_len_b": 2}  # maximum lengths 4, 6 and 9: rows end at different steps
    assert len({len(h) for h in greedy_search(model, src, **kw)}) >= 2
    rows.clear()
    greedy_search(model, src, graph=True, **kw)
    assert set(rows) == {5}
    rows.clear()
    beam_search(model, src, beam_size=3, graph=True, **kw)
    assert rows[0] == 5 and set(rows[1:]) == {15}, rows
    for search, kw, most in ((greedy_search, {}, 1), (beam_search, {"beam_size": 4}, 0.25),
                             (beam_search, {"beam_size": 4, "early_stop": False, "nbest": 2}, 0.25)):
        per_step = (decode_syncs(search, model, src, 12, graph=True, **kw)
                    - decode_syncs(search, model, src, 4, graph=True, **kw)) / 8
        assert per_step <= most, (search.__name__, per_step)


def test_graph_decoding_refuses_what_a_fixed_step_cannot_run():
    src = torch.randint(3, V, (2, 5))
    with pytest.raises(ValueError, match="graph=True does not support model.position=alibi"):
        greedy_search(seq2seq(position="alibi"), src, graph=True)
    with pytest.raises(ValueError, match="graph=True attends through a mask"):
        model = seq2seq()
        model.cfg = model.cfg.replace(attention_backend="flash_attn")  # the check reads the config alone
        beam_search(model, src, graph=True)


# ------------------------------------------------------------------------------------- operators a step
def step_launches(search, model, src, **kw) -> float:
    """Non-view operators (on a GPU: kernel launches) that each of 8 more decoding steps adds."""
    def count(steps: int) -> int:
        with DispatchCount() as c:
            search(model, src, max_len_a=0, max_len_b=steps, min_len=steps, **kw)
        return c.launches

    count(12)  # first-use work (the position table, grown to these lengths) drops out
    return (count(12) - count(4)) / 8


@pytest.mark.parametrize("search,kw,budget", [(greedy_search, {}, 41), (beam_search, {"beam_size": 4}, 94)])
def test_a_decode_step_of_the_2017_model_runs_a_pinned_number_of_operators(search, kw, budget):
    """The post-norm, sinusoidal, 2-layer decoder's step: 12 projections, 4 attentions, 6 norms, 7 adds, 4 cache
    appends, the head and the search. It was 68 (greedy) and 116 (beam 4) before the step stopped checking its
    own ids against the vocabulary (5), recomputing the sinusoids (8) and converting the source mask in each
    cross-attention layer (SDPA's `where`); then 50 and 98 before the source mask was made once a search, not
    once a step (4), and greedy's bookkeeping moved to the host with the step's tokens, its one read (5). On a CPU
    each costs host time whatever the batch."""
    model = seq2seq(dropout=0.1).eval()  # dropout in eval mode: no operator either
    src = torch.randint(3, V, (3, 7))
    src[0, -2:] = PAD
    assert step_launches(search, model, src, **kw) <= budget


def test_a_padded_batch_converts_its_mask_once_a_forward_not_once_a_layer():
    """SDPA makes an additive mask of a bool one at every call; the Mask does it once for every layer, and the
    attention is the same, bit for bit."""
    model = seq2seq(n_enc_layers=3)
    src = torch.randint(3, V, (3, 7))
    src[0, -2:] = PAD
    with torch.no_grad(), DispatchCount() as c:
        model.encode(src)
    assert c.ops["aten::where"] == 0 and c.ops["aten::masked_fill_"] == 1, c.ops
    attn = model.encoder.layers[0].self_attn
    x = torch.randn(3, 7, 32)  # (B, S, d)
    pad = src.eq(PAD)  # (B, S)
    with torch.no_grad():
        mask = Mask(bias=~pad[:, None, None, :], key_pad=pad)
        got = attn(x, mask)  # (B, S, d)
        assert len(mask.additive) == 1
        attn.backend = "eager"
        want = attn(x, Mask(bias=~pad[:, None, None, :], key_pad=pad))
    assert torch.allclose(got, want, atol=1e-6)
    q, k, v = (torch.randn(3, 4, 7, 8) for _ in range(3))  # (B, H, S, hd)
    bool_mask = ~pad[:, None, None, :]  # (B, 1, 1, S)
    assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask),
                       torch.nn.functional.scaled_dot_product_attention(
                           q, k, v, attn_mask=Mask(bias=bool_mask).additive_bias(q.dtype)))


def test_the_sinusoid_table_holds_the_functions_values():
    """Positions from the table (an int start inside it) are the function's own, bit for bit; past its end and
    from a device-side start they are computed as before."""
    from attnlab.models.layers import AbsolutePositions, sinusoidal_positions

    pos = AbsolutePositions(ModelConfig(vocab_size=V, d_model=32, n_heads=4, max_seq_len=40))
    cpu = torch.device("cpu")
    for start, n in ((7, 1), (0, 40), (39, 1), (30, 25), (45, 3), (0, 1)):
        assert torch.equal(pos(start, n, cpu), sinusoidal_positions(torch.arange(start, start + n), 32))
    assert torch.equal(pos(torch.tensor(5), 2, cpu), sinusoidal_positions(torch.arange(5, 7), 32))
    assert pos.sines.rows[0].shape == (40, 32)
    # the table holds the positions used so far (a power of two of them), not max_seq_len: a long-context model's
    # table would be max_seq_len x d_model
    long = AbsolutePositions(ModelConfig(vocab_size=V, d_model=32, n_heads=4, max_seq_len=1 << 20))
    long(0, 5, cpu)
    assert long.sines.rows[0].shape == (8, 32)
    assert torch.equal(long(100, 3, cpu), sinusoidal_positions(torch.arange(100, 103), 32))
    assert long.sines.rows[0].shape == (128, 32)
    pickle.loads(pickle.dumps(long))  # a spawned process receives the model pickled


def test_the_rope_table_holds_the_functions_values():
    """RoPE's cos and sin from the stack's table are rope_cos_sin's own, bit for bit, inside the table, past it and
    from a device-side start; a cached LM step no longer recomputes them."""
    from attnlab.models.layers import rope_cos_sin

    model = lm(max_seq_len=40, rope_fraction=0.5)
    table, cfg = model.decoder.rope, model.cfg
    cpu = torch.device("cpu")
    for start, n in ((3, 1), (0, 40), (39, 1), (30, 25), (45, 3), (0, 1)):
        want = rope_cos_sin(torch.arange(start, start + n), cfg.rotary_dim, cfg.rope_theta)
        got = table(start, n, cpu)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    want = rope_cos_sin(torch.arange(5, 7), cfg.rotary_dim, cfg.rope_theta)
    assert all(torch.equal(a, b) for a, b in zip(table(torch.tensor(5), 2, cpu), want, strict=True))
    prompt = torch.randint(3, V, (2, 4))
    with DispatchCount() as c:  # the table holds its 40 positions already
        generate(model, prompt, 12, greedy=True)
    assert c.ops["aten::cos"] == 0 and c.ops["aten::sin"] == 0, c.ops
    pickle.loads(pickle.dumps(model))


def test_a_greedy_lm_step_runs_a_pinned_number_of_operators():
    """A cached step of the 2-layer Llama-style LM (RoPE, GQA, SwiGLU, RMSNorm): 77 non-view operators, 94 before it
    took RoPE's cos and sin from a table and stopped checking its own sampled ids against the vocabulary."""
    model = lm()
    prompt = torch.randint(3, V, (2, 4))

    def launches(new_tokens: int) -> int:
        with DispatchCount() as c:
            generate(model, prompt, new_tokens, greedy=True)
        return c.launches

    launches(14)  # first-use work (the RoPE table) drops out
    assert (launches(14) - launches(6)) / 8 <= 77


def test_a_bos_outside_the_vocabulary_is_a_clear_error():
    model = seq2seq()
    src = torch.randint(3, V, (2, 5))
    for search in (greedy_search, beam_search):
        with pytest.raises(ValueError, match=f"bos_id={V} is outside the vocabulary"):
            search(model, src, bos_id=V)
