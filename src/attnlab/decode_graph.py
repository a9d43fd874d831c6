"""Decoding steps of fixed shape, captured as CUDA graphs: the decoder step of an LM or a translation model
(`DecodeStep`), and a whole beam-search step, decoder and bookkeeping (`BeamGraph`), for decode.py's `graph=True`.

Every tensor such a step reads or writes keeps its shape and address from one step to the next, and the step
never reads a value back to the host; the step index lives on the device (the StaticKVCache's position). On CUDA
a step is captured once and replayed; elsewhere it runs eagerly, the same code, which is how a CPU checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .models.attention import StaticKVCache
from .models.transformer import DecoderOnly

NEG_INF = float("-inf")


def force_eos(lprobs: torch.Tensor, forced: torch.Tensor, too_short: bool | torch.Tensor, eos_id: int) -> None:
    """In place on a step's log-probs (n, w, V): a sentence at its max length (forced (n,)) may only end, and one too
    short to end (`too_short`, a bool or a 0-d tensor) may not, unless forced."""
    eos_lp = lprobs[..., eos_id].masked_fill(too_short & ~forced[:, None], NEG_INF)  # (n, w)
    lprobs.masked_fill_(forced[:, None, None], NEG_INF)
    lprobs[..., eos_id] = eos_lp


class BeamChoice(NamedTuple):
    fin_scores: torch.Tensor  # (n, K) float64 the K best finished hypotheses' scores, best first (-inf: none)
    fin_len: torch.Tensor  # (n, K) long their lengths
    order: torch.Tensor  # (n, K) which of [the K kept, the K new] each is: to move their tokens alike
    top_beam: torch.Tensor  # (n, 2K) the beam each of the 2K best candidates extends
    scores: torch.Tensor  # (n, K) the log-probs of the K live beams
    beam: torch.Tensor  # (n, K) the beam each live one extends
    tok: torch.Tensor  # (n, K) its new token
    done: torch.Tensor  # (n,) bool the sentence is done (or forced to be)


def choose_beams(lprobs: torch.Tensor, scores: torch.Tensor, fin_scores: torch.Tensor, fin_len: torch.Tensor,
                 lp: float | torch.Tensor, t: int | torch.Tensor, forced: torch.Tensor, bound_lp: torch.Tensor,
                 eos_id: int, early_stop: bool, nbest: int) -> BeamChoice:
    """The bookkeeping of one beam-search step (fairseq's SequenceGenerator) from its log-probs (n, w, V) of the w
    beams a sentence has (1 at the first step), the live beams' scores (n, K) and the K best finished so far.

    The 2K best continuations: an EOS among the K best finishes a hypothesis of t tokens + EOS, scored
    log-prob / lp and merged into the K best finished by a stable sort (on a tie the earlier finished, then the
    better-ranked, stays first); the K best non-EOS ones stay live (there are >= K: a beam gives at most one EOS).
    Done: K finished (early_stop), else the nbest-th finished beats every live beam's best reachable score
    (log-prob / bound_lp, exact for alpha >= 0). `lp` and `t` are numbers, or on the device (0-d or (1,))."""
    n, w, V = lprobs.shape
    K = scores.shape[1]
    cand = lprobs.add_(scores[:, :w, None])  # (n, w, V) in place; -inf + finite stays -inf, never NaN
    top_scores, top_idx = cand.view(n, w * V).topk(2 * K, dim=1)  # (n, 2K), sorted best first
    top_beam, top_tok = top_idx // V, top_idx % V  # (n, 2K)
    is_eos = top_tok.eq(eos_id)  # (n, 2K)
    fin = is_eos[:, :K] & top_scores[:, :K].isfinite()  # (n, K)
    new_scores = (top_scores[:, :K].double() / lp).masked_fill(~fin, NEG_INF)  # (n, K), float64 like Python's
    both = torch.cat((fin_scores, new_scores), 1)  # (n, 2K): the kept ones first
    order = both.sort(dim=1, descending=True, stable=True).indices[:, :K]  # (n, K)
    fin_scores = both.gather(1, order)  # (n, K)
    new_len = t.expand_as(fin_len) if isinstance(t, torch.Tensor) else torch.full_like(fin_len, t)  # (n, K)
    fin_len = torch.cat((fin_len, new_len), 1).gather(1, order)  # (n, K)
    rank = torch.arange(2 * K, device=lprobs.device)  # (2K,)
    keep = (rank + is_eos * 2 * K).topk(K, dim=1, largest=False).indices  # (n, K), best first
    scores = top_scores.gather(1, keep)  # (n, K)
    if early_stop:
        done = fin_scores[:, K - 1].isfinite()  # (n,) K finished
    else:  # the nbest-th finished score (-inf while fewer) beats every live beam's best reachable one
        done = fin_scores[:, nbest - 1] >= scores[:, 0].double() / bound_lp  # -inf live beams end it too
    return BeamChoice(fin_scores, fin_len, order, top_beam, scores, top_beam.gather(1, keep), top_tok.gather(1, keep),
                      done | forced)


class DecodeStep:
    """One decoding step over a StaticKVCache with its position on the device: new tokens (G, 1) -> last
    logits (G, V) by `forward`. Nothing in it changes shape, so on CUDA it is captured once as a CUDA graph and
    replayed (the input is copied into a fixed tensor, the output is a fixed tensor overwritten by each replay).
    `forward` calls the decoder stack directly: the model's id check reads the ids back to the host, which a
    graph cannot capture, and generated ids come from the vocabulary anyway. Every tensor it reads (the
    cache's buffers, a source mask) must keep its address from one step to the next. A step that changes more
    than the cache's position and its keys at that position (a whole beam-search step) names what it changes in
    `state`: the warm-up before the capture runs the step and puts those tensors back as they were."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], cache: StaticKVCache, batch: int,
                 device: torch.device, compile_step: bool = False, state: Sequence[torch.Tensor] = ()) -> None:
        self.forward, self.cache, self.state = forward, cache, list(state)
        cache.device_position(device)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)  # (G, 1) the graph's input
        self.fn = torch.compile(self._forward, fullgraph=True, dynamic=False) if compile_step else self._forward
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        if device.type == "cuda":
            self._capture()

    def _forward(self) -> torch.Tensor:
        return self.forward(self.tok)  # (G, V)

    @staticmethod
    def lm(model: DecoderOnly, cache: StaticKVCache, batch: int, compile_step: bool = False) -> DecodeStep:
        def forward(tok: torch.Tensor) -> torch.Tensor:
            return model.logits(model.decoder(tok, cache=cache))[:, -1]  # (G, 1, d) -> (G, V)

        return DecodeStep(forward, cache, batch, next(model.parameters()).device, compile_step)

    @staticmethod
    def translation(model, cache: StaticKVCache, src_pad: torch.Tensor | None, batch: int) -> DecodeStep:
        """Over the cross-attention entries already in `cache` (one row per sentence, src_pad (n, S))."""
        def forward(tok: torch.Tensor) -> torch.Tensor:
            return model.logits(model.decoder(tok, memory_pad=src_pad, cache=cache))[:, -1]  # (G, V)

        return DecodeStep(forward, cache, batch, next(model.parameters()).device)

    def _capture(self) -> None:
        saved = self.cache.pos.clone()
        saved_state = [x.clone() for x in self.state]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (and compile) off the default stream, as capture needs
            for _ in range(3):
                self.fn()  # writes the keys of the next position, which the first real step overwrites
                self.cache.pos.copy_(saved)
        torch.cuda.current_stream().wait_stream(stream)
        for x, before in zip(self.state, saved_state, strict=True):
            x.copy_(before)
        del saved_state
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.fn()  # (G, V)
        self.cache.pos.copy_(saved)

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        self.tok.copy_(tok)
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


@dataclass
class BeamGraph:
    """The state of a beam search over n sentences x K beams once every sentence has K live beams, all of fixed
    shape (L = the longest output): the search from step 1 on runs as `step()` calls, one CUDA graph each on CUDA.
    Sentences that are done stay, idle; their hypotheses were stored (res_*) when they were first done."""

    seqs: torch.Tensor  # (n*K, L+2) long: BOS, the tokens so far, then pad_id (one column a step; the last
    # is written by step L, whose tokens nothing reads)
    scores: torch.Tensor  # (n, K) float: log-prob of each live beam
    fin_scores: torch.Tensor  # (n, K) float64: the K best finished of each sentence, best first (-inf = none)
    fin_len: torch.Tensor  # (n, K) long: their lengths (EOS not counted)
    fin_seqs: torch.Tensor  # (n, K, L) long: their tokens
    res_scores: torch.Tensor  # (n, K) float64: fin_scores as they were when the sentence was done
    res_len: torch.Tensor  # (n, K) long
    res_seqs: torch.Tensor  # (n, K, L) long
    stored: torch.Tensor  # (n,) bool: done (its res_* hold its results)
    limit: torch.Tensor  # (n,) long: each sentence's max length
    bound_lp: torch.Tensor  # (n,) float64: the length penalty of its longest hypothesis
    lp: torch.Tensor  # (L+2,) float64: lp[t] = the length penalty of a hypothesis ending at step t (t + 1 tokens)

    def tensors(self) -> list[torch.Tensor]:
        """What a step changes (besides the cache)."""
        return [self.seqs, self.scores, self.fin_scores, self.fin_len, self.fin_seqs, self.res_scores, self.res_len,
                self.res_seqs, self.stored]

    def run(self, model, cache: StaticKVCache, src_pad: torch.Tensor | None, steps: int, eos_id: int, pad_id: int,
            min_len: int, early_stop: bool, nbest: int, check_every: int = 4) -> None:
        """Steps 1..steps (cache.pos = 1 on entry); every `check_every` steps one host read: is every sentence done?
        The steps after the last one is done change nothing stored."""
        n, K = self.scores.shape
        V, L, dev = model.cfg.vocab_size, self.fin_seqs.shape[2], self.seqs.device
        base = torch.arange(n, device=dev)[:, None] * K  # (n, 1) first row of each sentence

        def step(_: torch.Tensor) -> torch.Tensor:  # one step of decode.beam_search, every shape fixed
            t = cache.pos.clone()  # () the step, on the device
            tok = self.seqs.gather(1, t.expand(n * K, 1))  # (n*K, 1) the last token of each beam
            logits = model.logits(model.decoder(tok, memory_pad=src_pad, cache=cache))[:, -1]  # (n*K, V)
            lprobs = logits.float().log_softmax(-1).view(n, K, V)  # (n, K, V)
            lprobs[..., pad_id] = NEG_INF
            forced = self.limit <= t  # (n,) at max length only EOS may follow
            force_eos(lprobs, forced, t < min_len, eos_id)
            lp = self.lp.index_select(0, t.view(1))  # (1,) not lp[t]: a 0-d index tensor is read back to the host
            c = choose_beams(lprobs, self.scores, self.fin_scores, self.fin_len, lp, t, forced, self.bound_lp, eos_id,
                             early_stop, nbest)
            self.fin_scores.copy_(c.fin_scores)
            self.fin_len.copy_(c.fin_len)
            parents = (base + c.top_beam[:, :K]).view(-1)  # (n*K,)
            new_seqs = self.seqs.index_select(0, parents)[:, 1:L + 1].reshape(n, K, L)  # (n, K, L) pad after t tokens
            both_seqs = torch.cat((self.fin_seqs, new_seqs), 1)  # (n, 2K, L)
            self.fin_seqs.copy_(both_seqs.gather(1, c.order[..., None].expand(-1, -1, L)))
            new = (c.done & ~self.stored)[:, None]  # (n, 1) done at this step: store its hypotheses
            self.res_scores.copy_(torch.where(new, self.fin_scores, self.res_scores))
            self.res_len.copy_(torch.where(new, self.fin_len, self.res_len))
            self.res_seqs.copy_(torch.where(new[..., None], self.fin_seqs, self.res_seqs))
            self.stored.logical_or_(c.done)
            index = (base + c.beam).view(-1)  # (n*K,) parent row of each new beam
            self.seqs.copy_(self.seqs.index_select(0, index))
            self.seqs.scatter_(1, (t + 1).expand(n * K, 1), c.tok.view(-1, 1))
            self.scores.copy_(c.scores)
            cache.reorder(index, self_only=True)
            return self.stored.all()  # ()

        buffers = [b for b in cache.keys + cache.values if b is not None]  # the reorder permutes them
        graph_step = DecodeStep(step, cache, 1, dev, state=self.tensors() + buffers)
        dummy = torch.zeros(1, 1, dtype=torch.long, device=dev)
        for i in range(1, steps + 1):
            all_done = graph_step(dummy)
            if (i % check_every == 0 or i == steps) and bool(all_done):
                break
