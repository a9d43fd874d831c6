"""Decoding: greedy and beam search for translation, sampling for language models.

Conventions shared by the translation searches:
- max output length per sentence = floor(max_len_a * source length + max_len_b), the source length
  counting non-pad tokens; capped at max_seq_len - 1 for learned positions. Outputs hold at most that
  many tokens; beam search then forces EOS (fairseq's convention), greedy just stops.
- PAD is never generated (its log-prob is set to -inf after the softmax, so scores stay exact).
- `min_len` keeps EOS from ending an output of fewer tokens (EOS excluded); min_len = max_len_b with
  max_len_a = 0 decodes exactly max_len_b tokens per sentence ("EOS off", for fixed-length benchmarks).
- `static_cache` preallocates the self-attention keys/values (StaticKVCache) instead of growing them; the
  results are the same (and on a CPU slower: the buffers are sized for the batch's longest output).
- A sentence that is done leaves the batch with its cache rows; each step reads one thing back to the host
  (greedy: the step's tokens, whose bookkeeping is then the host's; beam search: which sentences are done), and
  the batch shrinks on the device with the indices built from it.
- `graph=True` keeps every row to the end instead (finished ones idle, their outputs frozen) over a StaticKVCache
  whose position lives on the device, so that every decoder step has the same shapes and addresses: on CUDA the
  step is captured once as a CUDA graph and replayed (decode_graph.DecodeStep); elsewhere it runs eagerly, as a
  check of the same path. Beam search's steps after the first are whole fixed-shape steps, the bookkeeping
  included (decode_graph.BeamGraph), which read whether every sentence is done once every 4 steps. The tokens
  are those of the default path.
- Outputs exclude BOS and EOS. The hypothesis length used by the length penalty counts the EOS.
Special ids default to the data layer's: PAD=0, BOS=1, EOS=2.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from .decode_graph import NEG_INF, BeamGraph, DecodeStep, choose_beams, force_eos
from .models.attention import KVCache, StaticKVCache
from .models.prepack import prepacked_linears
from .models.transformer import DecoderOnly

PAD, BOS, EOS = 0, 1, 2
GENERATE_MAX_NEW_TOKENS = 50  # attnlab generate's default, and an exported LM's generation_config


def _decoding(fn):
    """Run under no_grad in eval mode, restoring the caller's mode (dropout would make decoding random)."""

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), prepacked_linears(model):  # oneDNN's GEMM on a CPU (models/prepack.py)
                return fn(model, *args, **kwargs)
        finally:
            model.train(was_training)

    return wrapper


def length_penalty(length: int | float | torch.Tensor, alpha: float, kind: str = "gnmt") -> Any:
    """Divisor of a hypothesis' log-prob. gnmt: ((5 + len) / 6)^alpha (Wu et al. 2016, arXiv:1609.08144,
    eq. 14); fairseq: len^alpha. Both are 1 at alpha = 0 and grow with len for alpha > 0."""
    length = length.double() if isinstance(length, torch.Tensor) else float(length)
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if kind == "fairseq":
        return length**alpha
    raise ValueError(f"penalty={kind!r} is not one of: gnmt, fairseq")


def max_lengths(model, src: torch.Tensor, max_len_a: float, max_len_b: float, pad_id: int = PAD) -> torch.Tensor:
    """Per-sentence output budget floor(a * source length + b), source length without padding -> (B,) long."""
    src_len = src.ne(pad_id).sum(1)  # (B,)
    limit = (max_len_a * src_len.double() + max_len_b).floor().long().clamp_min(0)  # (B,)
    cap = position_cap(getattr(model, "cfg", None))
    return limit if cap is None else limit.clamp_max(cap)


def position_cap(cfg) -> int | None:
    """The most output tokens a model's positions allow: a learned table's decoder positions 0..L must fit its
    max_seq_len rows; other positions have no cap (None)."""
    return cfg.max_seq_len - 1 if cfg is not None and cfg.position == "learned" else None


def _new_cache(model, static: bool, max_len: int) -> KVCache:
    return StaticKVCache(model.cfg.n_dec_layers, max_len) if static else model.new_cache()


def graph_unsupported(model) -> str | None:
    """Why a fixed-shape step (DecodeStep) cannot run this model, or None: it needs a mask over the whole static
    cache and no per-length bias."""
    if model.cfg.position == "alibi":
        return "does not support model.position=alibi (its bias is built per length)"
    if model.cfg.attention_backend == "flash_attn":
        return "attends through a mask: use model.attention_backend=sdpa or eager"
    return None


def _check_graph(model, what: str) -> None:
    if (why := graph_unsupported(model)) is not None:
        raise ValueError(f"{what} {why}")


def _step_logits(model, tok: torch.Tensor, src_pad: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
    """Logits (n, V) after the new tokens tok (n, 1) over the cache, without `model.decode`'s check of the ids
    against the vocabulary, which the search's own ids always pass (BOS is checked once, by `_check_bos`; the
    others come from the vocabulary's logits)."""
    return model.decode(tok, None, src_pad, cache, check=False)[:, -1]  # (n, V)


def _check_bos(model, bos_id: int) -> None:
    if not 0 <= bos_id < model.cfg.vocab_size:
        raise ValueError(f"bos_id={bos_id} is outside the vocabulary [0, {model.cfg.vocab_size}) (model.vocab_size)")


# row_argmax's chunk width and the fewest logits it takes them for: on this project's Intel VM the chunks lost at
# 16,000 logits and won from 32,000 (bench/cpu_argmax.py's column "chunks at any size")
ARGMAX_CHUNK, ARGMAX_MIN_NUMEL = 128, 24_000


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) of logits (n, V) -> (n,) long: the same indices (the first of ties; NaN counts as the
    largest, as in torch), faster on a CPU, where torch's argmax is several times slower than its amax over the same
    logits (bench/cpu_argmax.py and its raw files). So: the maximum of each 128-wide chunk (amax), and of a last
    chunk ending at V (overlapping the one before where 128 does not divide V), the first chunk that holds the
    row's maximum, and argmax within that chunk alone. Elsewhere, or for fewer than ARGMAX_MIN_NUMEL logits,
    torch's argmax."""
    n, V = logits.shape
    w = ARGMAX_CHUNK
    if logits.device.type != "cpu" or logits.numel() < ARGMAX_MIN_NUMEL or V < 2 * w:
        return logits.argmax(-1)
    windows = logits.unfold(1, w, 1)  # (n, V - w + 1, w) every w-wide window, a view
    maxima = torch.cat((logits.unfold(1, w, w).amax(-1), logits[:, V - w:].amax(-1, keepdim=True)), 1)  # (n, C + 1)
    # the first chunk holding the maximum (an earlier chunk wins a tie, so the last one only where the maximum is
    # past the others), and where it starts: chunk c at c * w, the last at V - w
    begin = maxima.argmax(-1).mul_(w).clamp_max_(V - w)  # (n,)
    return windows[torch.arange(n, device=logits.device), begin].argmax(-1).add_(begin)  # (n,)


def _strip(row: list[int], eos_id: int, pad_id: int) -> list[int]:
    row = row[: row.index(eos_id)] if eos_id in row else row
    return [t for t in row if t != pad_id]  # PAD is never generated: only the filler of finished rows


# ---------------------------------------------------------------------------------------------
# Translation: greedy and beam search over the KV cache
# ---------------------------------------------------------------------------------------------
def _host_flags(done: torch.Tensor) -> list[bool]:
    """The one host read of a decoding step: which rows (or sentences) are done."""
    return done.tolist()


@_decoding
def greedy_search(
    model, src: torch.Tensor, max_len_a: float = 1.0, max_len_b: int = 50,
    bos_id: int = BOS, eos_id: int = EOS, pad_id: int = PAD, min_len: int = 0, static_cache: bool = False,
    graph: bool = False,
) -> list[list[int]]:
    """Batched greedy decoding of src (B, S) with an EncoderDecoder -> B token lists without BOS/EOS.

    A row stops at its EOS or its max length and leaves the batch (its cache rows too: a finished row costs
    nothing more, as in CTranslate2); the search ends when every row has. EOS cannot come before `min_len`
    output tokens. Each step reads its tokens back (its one host read) and the outputs, lengths and stops are kept
    on the host, not by operators on the device. `graph`: every row stays, one CUDA graph per step (module
    docstring)."""
    if graph:
        _check_graph(model, "graph=True")
    B = src.shape[0]
    limit = max_lengths(model, src, max_len_a, max_len_b, pad_id)  # (B,)
    if B == 0:
        return []
    L = int(limit.max())
    _check_bos(model, bos_id)
    memory, src_pad = model.encode(src)  # (B, S, d), (B, S)
    cache = _new_cache(model, static_cache or graph, L + 1)
    model.cache_cross_attention(memory, cache)
    if graph:
        return _greedy_graph(model, cache, src_pad, limit, L, bos_id, eos_id, pad_id, min_len)
    dev = src.device
    budget = limit.tolist()  # (B,) each sentence's most tokens, on the host
    banned = torch.tensor([pad_id], device=dev)  # PAD never; EOS too before min_len
    banned_eos = torch.tensor([pad_id, eos_id], device=dev)
    outs: list[list[int]] = [[] for _ in range(B)]  # each sentence's tokens, on the host
    rows = list(range(B))  # the sentence of each live row
    done = [n <= 0 for n in budget]  # (n,) each live row's: no budget left, or EOS
    tok = torch.full((B, 1), bos_id, dtype=torch.long, device=dev)  # (n, 1)
    for t in range(L + 1):
        if all(done):
            break
        if any(done):  # finished rows leave the batch, with their cache rows
            keep = [i for i, f in enumerate(done) if not f]
            index = torch.tensor(keep, device=dev)  # (n',)
            cache.reorder(index)
            tok, src_pad, rows = tok[index], src_pad[index], [rows[i] for i in keep]  # (n', 1), (n', S)
        logits = _step_logits(model, tok, src_pad, cache)  # (n, V)
        logits = logits if logits.dtype == torch.float32 else logits.float()
        logits.index_fill_(1, banned_eos if t < min_len else banned, NEG_INF)
        tok = row_argmax(logits)[:, None]  # (n, 1)
        done = []
        for r, x in zip(rows, tok.view(-1).tolist(), strict=True):  # the step's one read: its tokens
            outs[r].append(x)
            done.append(x == eos_id or len(outs[r]) >= budget[r])
    return [_strip(row, eos_id, pad_id) for row in outs]


def _greedy_graph(model, cache: KVCache, src_pad: torch.Tensor, limit: torch.Tensor, L: int, bos_id: int,
                  eos_id: int, pad_id: int, min_len: int) -> list[list[int]]:
    """greedy_search with graph=True: every row stays to the end (a finished one's output frozen), each step one
    fixed-shape DecodeStep; the step reads whether every row is done."""
    B, dev = limit.shape[0], limit.device
    step = DecodeStep.translation(model, cache, src_pad, B)
    out = torch.full((B, max(L, 1)), pad_id, dtype=torch.long, device=dev)  # (B, L) every row's tokens
    tok = torch.full((B, 1), bos_id, dtype=torch.long, device=dev)  # (B, 1)
    ended = limit.le(0)  # (B,) no budget left
    for t in range(L + 1):
        if all(_host_flags(ended)):
            break
        logits = step(tok).float()  # (B, V) the graph's output, overwritten by the next replay
        logits[:, pad_id] = NEG_INF
        if t < min_len:
            logits[:, eos_id] = NEG_INF
        tok = logits.argmax(-1, keepdim=True)  # (B, 1)
        out[:, t] = tok[:, 0].masked_fill(ended, pad_id)
        ended = ended | tok[:, 0].eq(eos_id) | limit.le(t + 1)  # (B,)
    return [_strip(row, eos_id, pad_id) for row in out.tolist()]


@_decoding
def beam_search(
    model, src: torch.Tensor, beam_size: int = 4, len_penalty: float = 0.6, penalty: str = "gnmt",
    max_len_a: float = 1.0, max_len_b: int = 50, nbest: int = 1, early_stop: bool = True,
    bos_id: int = BOS, eos_id: int = EOS, pad_id: int = PAD, min_len: int = 0, static_cache: bool = False,
    graph: bool = False,
) -> list[list[tuple[list[int], float]]]:
    """Batched beam search of src (B, S) with an EncoderDecoder over the KV cache.

    Returns, per sentence, up to `nbest` (tokens without BOS/EOS, score) pairs, best first, where
    score = sum of token log-probs (EOS included) / length_penalty(len + 1, len_penalty, penalty).

    Each step takes the 2K best continuations of the K live beams (K = beam_size). A candidate ending
    in EOS among the K best is finished and scored; the K best non-EOS candidates stay live, so K
    hypotheses are always extended (fairseq's `SequenceGenerator`). The K best finished are kept.
    Stopping, per sentence:
      early_stop=True  (fairseq): stop once K hypotheses are finished. Beam size 1 is then greedy search.
      early_stop=False (GNMT / tensor2tensor bound): stop once no live beam can still beat the nbest-th
        finished score. With alpha >= 0 and log-probs <= 0, a live beam's best reachable score is its
        log-prob / lp(max length + 1), so the bound is exact.
    At the max length every live beam is force-finished with EOS; before `min_len` tokens (and the max length)
    EOS is not a candidate.
    A sentence that stops leaves the batch with its beams and cache rows (CTranslate2 does the same), folded into
    the step's reordering of the cache; its cross-attention keys are one row shared by its beams. With `graph`
    it stays, idle, and every step after the first is one CUDA graph (module docstring).
    """
    if beam_size < 1 or not 1 <= nbest <= beam_size:
        raise ValueError(f"need beam_size >= 1 and 1 <= nbest <= beam_size, got beam_size={beam_size}, nbest={nbest}")
    if len_penalty < 0:
        raise ValueError(f"len_penalty={len_penalty} must be >= 0")
    length_penalty(1, len_penalty, penalty)  # reject an unknown penalty before any work
    if graph:
        _check_graph(model, "graph=True")
    B, K, V = src.shape[0], beam_size, model.cfg.vocab_size
    if B == 0:
        return []
    dev = src.device
    limit = max_lengths(model, src, max_len_a, max_len_b, pad_id)  # (B,)
    limits = limit.tolist()  # (n,) on the host too: one read of the lengths, before the loop
    L = max(limits)  # the longest output
    _check_bos(model, bos_id)
    memory, src_pad = model.encode(src)  # (B, S, d), (B, S)
    cache = _new_cache(model, static_cache or graph, L + 1)
    model.cache_cross_attention(memory, cache)  # K/V of each sentence computed once, one row shared by its beams
    if graph:  # the first step too writes at the device position; the later ones are BeamGraph's
        cache.device_position(dev)
    # the first step decodes one row a sentence (its K beams would all be BOS) and its 2K best continuations start
    # K distinct beams; a vocabulary of fewer than 2K tokens starts from K rows, all but the first at -inf
    w = 1 if V >= 2 * K else K  # (rows a sentence at this step)
    seqs = torch.full((B * w, 1), bos_id, dtype=torch.long, device=dev)  # (n*w, t+1) rows b*w .. b*w+w-1: sentence b
    scores = torch.full((B, K), NEG_INF, device=dev)  # (n, K) log-prob of each live beam
    scores[:, 0] = 0.0
    sent = torch.arange(B, device=dev)  # (n,) the sentence of each live one
    # the K best finished hypotheses of each sentence, best first, kept on the device (no read per step);
    # res_* hold those of the sentences that left the batch
    fin_scores = torch.full((B, K), NEG_INF, dtype=torch.float64, device=dev)  # (n, K) -inf = none yet
    fin_seqs = torch.full((B, K, max(L, 1)), pad_id, dtype=torch.long, device=dev)  # (n, K, L) tokens, no BOS/EOS
    fin_len = torch.zeros(B, K, dtype=torch.long, device=dev)  # (n, K)
    res_scores, res_seqs, res_len = fin_scores.clone(), fin_seqs.clone(), fin_len.clone()  # (B, K[, L])
    bound_lp = length_penalty(limit + 1, len_penalty, penalty)  # (n,) lp of the longest possible hypothesis
    for t in range(L + 1):
        n = scores.shape[0]
        base = torch.arange(n, device=dev)[:, None] * w  # (n, 1) first row of each sentence
        logits = _step_logits(model, seqs[:, -1:], src_pad, cache)  # (n*w, V)
        lprobs = logits.float().log_softmax(-1).view(n, w, V)  # (n, w, V)
        lprobs[..., pad_id] = NEG_INF
        forced = limit <= t  # (n,) at max length only EOS may follow
        if t < min_len or min(limits) <= t:  # (the host knows the limits: most steps skip this)
            force_eos(lprobs, forced, t < min_len, eos_id)
        c = choose_beams(lprobs, scores, fin_scores, fin_len, length_penalty(t + 1, len_penalty, penalty), t, forced,
                         bound_lp, eos_id, early_stop, nbest)
        fin_scores, fin_len, scores, tok, done = c.fin_scores, c.fin_len, c.scores, c.tok, c.done
        if t:  # finished so far hold at most t tokens: only those columns move
            parents = (base + c.top_beam[:, :K]).view(-1)  # (n*K,) the row each candidate extends
            new_seqs = seqs.index_select(0, parents)[:, 1:].view(n, K, t)  # (n, K, t) drop BOS; EOS is not stored
            both_seqs = torch.cat((fin_seqs[:, :, :t], new_seqs), 1)  # (n, 2K, t)
            fin_seqs[:, :, :t] = both_seqs.gather(1, c.order[..., None].expand(-1, -1, t))  # (n, K, t)
        index = (base + c.beam).view(-1)  # (n*K,) parent row of each new beam
        flags = _host_flags(done)
        if any(flags):  # store the finished sentences' hypotheses; they leave the batch (with graph: stay, idle)
            gone = torch.tensor([i for i, f in enumerate(flags) if f], device=dev)  # (g,)
            at = sent[gone]  # (g,)
            res_scores[at], res_len[at], res_seqs[at] = fin_scores[gone], fin_len[gone], fin_seqs[gone]
        if all(flags):
            break
        if any(flags) and not graph:
            live = torch.tensor([i for i, f in enumerate(flags) if not f], device=dev)  # (n',)
            index = index.view(n, K)[live].view(-1)  # (n'*K,)
            scores, tok, sent, limit, bound_lp = scores[live], tok[live], sent[live], limit[live], bound_lp[live]
            limits = [m for m, f in zip(limits, flags, strict=True) if not f]
            fin_scores, fin_len, fin_seqs, src_pad = fin_scores[live], fin_len[live], fin_seqs[live], src_pad[live]
            cache.select_cross(live)
        seqs = torch.cat((seqs.index_select(0, index), tok.view(-1, 1)), dim=1)  # (n*K, t+2)
        cache.reorder(index, self_only=True)  # a sentence's beams share its cross-attention row
        w = K
        if graph:  # steps 1..L: each one fixed-shape step, decoder and bookkeeping (decode_graph.BeamGraph)
            state = BeamGraph(
                seqs=torch.cat((seqs, seqs.new_full((B * K, L), pad_id)), 1),  # (B*K, L+2)
                scores=scores, fin_scores=fin_scores, fin_len=fin_len, fin_seqs=fin_seqs, res_scores=res_scores,
                res_len=res_len, res_seqs=res_seqs, stored=torch.tensor(flags, device=dev), limit=limit,
                bound_lp=bound_lp, lp=torch.tensor([float(length_penalty(i + 1, len_penalty, penalty))
                                                    for i in range(L + 2)], dtype=torch.float64, device=dev))
            state.run(model, cache, src_pad, L, eos_id, pad_id, min_len, early_stop, nbest)
            break
    found, lengths, tokens = res_scores.tolist(), res_len.tolist(), res_seqs.tolist()  # one read at the end
    return [[(tokens[b][j][:lengths[b][j]], found[b][j]) for j in range(nbest) if found[b][j] > NEG_INF]
            or [([], NEG_INF)] for b in range(B)]


# ---------------------------------------------------------------------------------------------
# Language models: sampling over the KV cache
# ---------------------------------------------------------------------------------------------
def sample_next(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V): argmax when greedy or temperature == 0, else a sample from
    softmax(logits / temperature) restricted to the top_k tokens (0 = all) and to the nucleus: the
    smallest set of most likely tokens whose probability reaches top_p (Holtzman et al. 2020)."""
    logits = logits.float()
    if greedy or temperature == 0:
        return row_argmax(logits)
    logits = logits / temperature  # (B, V)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, NEG_INF)  # ties with the k-th are kept
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(-1)  # (B, V)
        drop = probs.cumsum(-1) - probs >= top_p  # the tokens before already reach top_p; the first always stays
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, NEG_INF))  # back to vocab order
    probs = logits.softmax(-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]  # (B,)


CACHES = ("dynamic", "static", "graph")


@_decoding
def generate(
    model, prompt: torch.Tensor | Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int,
    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
    eos_id: int | None = None, generator: torch.Generator | None = None, min_new_tokens: int = 0,
    cache: str = "dynamic", compile_step: bool = False,
) -> list[list[int]]:
    """Continue prompts with a DecoderOnly model -> per prompt, its tokens followed by the new ones.

    `prompt` is a (B, T) tensor (one batch) or a list of prompts of any lengths. The causal decoder has no
    key padding, so left-padded prompts would attend to their pads: prompts are grouped by length and each
    group is one batch (prefill once, then one token per step over the KV cache). With `eos_id`, a row
    stops after its EOS (kept in the output); the others continue. EOS is not drawn before `min_new_tokens`
    new tokens. Rows draw from one shared `generator`, group by group in order of first appearance, so a
    seeded generator reproduces the output.

    `cache` (the results are the same for each):
      dynamic  KVCache, grown by concatenation at every step.
      static   StaticKVCache: keys written in place into buffers sized prompt + max_new_tokens.
      graph    StaticKVCache with its position on the device: every step after the prefill has the same
               shapes and reads no Python number, so on CUDA it is captured once as a CUDA graph and
               replayed for each token (one launch instead of one per kernel); on a CPU the same step runs
               eagerly. `compile_step` also compiles that step with torch.compile (fullgraph)."""
    if not isinstance(model, DecoderOnly):
        raise TypeError(f"generate needs a DecoderOnly model (model.arch=decoder_only), got {type(model).__name__}")
    if not temperature >= 0 or top_k < 0 or not 0 < top_p <= 1 or max_new_tokens < 0 or min_new_tokens < 0:
        raise ValueError(
            f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1, max_new_tokens >= 0 and min_new_tokens >= 0; got "
            f"temperature={temperature}, top_k={top_k}, top_p={top_p}, max_new_tokens={max_new_tokens}, "
            f"min_new_tokens={min_new_tokens}"
        )
    if cache not in CACHES:
        raise ValueError(f"cache={cache!r} is not one of: {', '.join(CACHES)}")
    if compile_step and cache != "graph":
        raise ValueError("compile_step=True compiles the fixed-shape step of cache='graph'")
    if cache == "graph":
        _check_graph(model, "cache='graph'")
    device = next(model.parameters()).device
    if isinstance(prompt, torch.Tensor):
        ids = prompt[None] if prompt.dim() == 1 else prompt  # (B, T): one batch
        batches = [(list(range(ids.shape[0])), ids)]
    else:
        rows = [torch.as_tensor(p, dtype=torch.long).view(-1) for p in prompt]
        by_len: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_len.setdefault(len(r), []).append(i)
        batches = [(idx, torch.stack([rows[i] for i in idx])) for idx in by_len.values()]  # (G, T) each
    out: list[list[int]] = [[] for _ in range(sum(len(idx) for idx, _ in batches))]
    sampling = (temperature, top_k, top_p, greedy, generator)
    for idx, ids in batches:
        if ids.shape[1] == 0:
            raise ValueError("generate needs prompts of at least one token (e.g. BOS)")
        ids = ids.to(device)
        new = _generate_batch(model, ids, max_new_tokens, sampling, eos_id, min_new_tokens, cache, compile_step)
        for i, p, n in zip(idx, ids.tolist(), new.tolist(), strict=True):
            if eos_id is not None and eos_id in n:
                n = n[: n.index(eos_id) + 1]
            out[i] = p + n
    return out


def _generate_batch(
    model, ids: torch.Tensor, max_new_tokens: int, sampling: tuple, eos_id: int | None, min_new_tokens: int,
    cache_kind: str, compile_step: bool,
) -> torch.Tensor:
    """ids (G, T) of equal-length prompts -> new tokens (G, N), N <= max_new_tokens."""
    G, T = ids.shape
    if max_new_tokens == 0:
        return ids.new_zeros(G, 0)
    if model.cfg.position == "learned" and T + max_new_tokens - 1 > model.cfg.max_seq_len:  # before any work
        raise ValueError(
            f"prompt {T} + {max_new_tokens} new tokens is longer than the learned position table "
            f"(model.max_seq_len={model.cfg.max_seq_len}): shorten the prompt or ask for fewer new tokens"
        )
    if cache_kind == "dynamic":
        cache = model.new_cache()
    else:
        cache = StaticKVCache(model.cfg.n_dec_layers, T + max_new_tokens)
    logits = model(ids, cache=cache)[:, -1]  # (G, V) prefill: the whole prompt in one call
    step = DecodeStep.lm(model, cache, G, compile_step) if cache_kind == "graph" and max_new_tokens > 1 else None
    done = torch.zeros(G, dtype=torch.bool, device=ids.device)  # (G,)
    steps: list[torch.Tensor] = []
    for i in range(max_new_tokens):
        if eos_id is not None and i < min_new_tokens:
            logits = logits.float().index_fill(-1, torch.tensor([eos_id], device=ids.device), NEG_INF)  # (G, V)
        nxt = sample_next(logits, *sampling)  # (G,)
        if eos_id is not None:
            nxt = nxt.masked_fill(done, eos_id)  # finished rows idle on EOS (cut off by the caller)
            done |= nxt.eq(eos_id)
        steps.append(nxt)
        if i == max_new_tokens - 1 or (eos_id is not None and done.all()):  # no host sync without EOS
            break
        # the sampled ids come from the vocabulary's logits: no check of them against it
        logits = step(nxt[:, None]) if step is not None else model(nxt[:, None], cache=cache, check=False)[:, -1]
    return torch.stack(steps, 1)  # (G, N)


__all__ = ["beam_search", "generate", "greedy_search", "length_penalty", "max_lengths", "sample_next"]
