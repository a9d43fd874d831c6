"""The test set as a sample: what resampling its sentences says about a table's rows.

A row's score on one seed is sacreBLEU's corpus score of its hypotheses. Part of a variant's advantage can be
per-sentence strengths that repeat on every seed (it is good at this test set's long sentences, say): over the
seeds that part never varies, so a test over seeds alone (conditional on the test set) counts it as real, and
with 5 seeds it stars a variant with no advantage over the sentence population 16-37% of the time (issue 41).
Bouthillier et al. 2021 ("Accounting for variance in machine learning benchmarks") list the test set's sampling
among the sources of variance an interval should cover.

Resampling: B sets of sentence indices drawn as sacreBLEU draws them (`default_rng(seed).choice(m, (B, m))`,
its paired bootstrap's, Koehn 2004), the same indices for every row and seed, each cell rescored from its
sentences' sufficient statistics by sacreBLEU itself (`_compute_score_from_stats`). Then, for rows r and r',

    G[r, r'] = mean over seeds j != j' of Cov_b(y*[b, r, j], y*[b, r', j'])

the covariance that the shared test set gives two cells of different seeds: per-sentence strengths that repeat
across seeds (and the sentences' difficulty, which every row shares and every difference cancels). Noise of one
seed's own decoding does not repeat across seeds and drops out, so G adds to the seed-level variance only what
that variance misses (variance components; Searle, Casella & McCulloch 1992, ch. 1). A row with a single seed
has no pair of seeds: its G uses the cell's own variance, which also holds that seed's sentence noise (wider).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import sacrebleu
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import _compute_p_value


def scorer(metric: str, signature: str = "") -> BLEU | CHRF:
    """sacreBLEU's BLEU or chrF as the final evaluation's `signature` says: BLEU with the tokenizer of its `tok:`
    field (the one the target language picked, bleu.sacrebleu_bleu), so that resampling scores as it did."""
    if metric == "chrf":
        return CHRF()
    tok = dict(f.split(":", 1) for f in signature.split("|") if ":" in f).get("tok")
    return BLEU(tokenize=tok) if tok else BLEU()


def version() -> str:
    return sacrebleu.__version__


def corpus_score(hyps: Sequence[str], refs: Sequence[str], metric: str, signature: str = "") -> float:
    """sacreBLEU's corpus BLEU or chrF of one seed's hypotheses."""
    return float(scorer(metric, signature).corpus_score(list(hyps), [list(refs)]).score)


def sentence_stats(hyps: Sequence[str], refs: Sequence[str], metric: str, signature: str = "") -> np.ndarray:
    """(sentences, d) sacreBLEU's sufficient statistics of each segment (int64: n-gram matches and counts)."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")
    return np.array(scorer(metric, signature)._extract_corpus_statistics(list(hyps), [list(refs)]), dtype=np.int64)


def corpus(stats: np.ndarray, metric: str, signature: str = "") -> float:
    """The corpus score of a cell from its statistics (sacreBLEU's own corpus_score on the texts)."""
    return float(scorer(metric, signature)._compute_score_from_stats(stats.sum(0).tolist()).score)


def resample_counts(sentences: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, sentences) how often each sentence is drawn in each resample: sacreBLEU's indices for `seed`
    (what SACREBLEU_SEED=seed makes its paired bootstrap draw)."""
    idx = np.random.default_rng(seed).choice(sentences, size=(resamples, sentences), replace=True)
    flat = (idx + sentences * np.arange(resamples)[:, None]).ravel()
    return np.bincount(flat, minlength=resamples * sentences).reshape(resamples, sentences)


def resampled(stats: np.ndarray, counts: np.ndarray, metric: str, signature: str = "") -> np.ndarray:
    """(resamples,) the cell's score on each resample of its sentences; the summed statistics as sacreBLEU passes
    them (float32, exact for counts below 2^24), so the scores are bit for bit its bootstrap's."""
    m = scorer(metric, signature)
    sums = (counts.astype(np.float64) @ stats.astype(np.float64)).astype(np.float32)  # (resamples, d)
    return np.array([m._compute_score_from_stats(s).score for s in sums])


def test_set_cov(ystar: np.ndarray) -> np.ndarray:
    """G (..., k, k) from the resampled scores ystar (..., B, k, n), NaN where a cell is absent: the mean over
    pairs of cells of different seeds of their covariance over the resamples (the module docstring)."""
    present = np.isfinite(ystar[..., 0, :, :])  # (..., k, n)
    k, n = ystar.shape[-2:]
    if present.all():
        d = ystar - ystar.mean(-3, keepdims=True)
    else:
        with warnings.catch_warnings():  # an absent cell is NaN on every resample: its mean is NaN, then 0
            warnings.simplefilter("ignore", RuntimeWarning)
            d = np.nan_to_num(ystar - np.nanmean(ystar, -3, keepdims=True))
    d = d.reshape(ystar.shape[:-2] + (k * n,))  # (..., B, cells)
    cov = np.einsum("...bi,...bj->...ij", d, d) / (ystar.shape[-3] - 1)  # (..., cells, cells)
    cov = cov.reshape(ystar.shape[:-3] + (k, n, k, n))
    both = present[..., :, :, None, None] & present[..., None, None, :, :]  # (..., k, n, k, n)
    other = both & ~np.eye(n, dtype=bool)[:, None, :]  # different seeds
    same = both & np.eye(n, dtype=bool)[:, None, :]
    pairs = other.sum((-1, -3))  # (..., k, k)
    with np.errstate(invalid="ignore", divide="ignore"):
        g_other = (cov * other).sum((-1, -3)) / pairs
        g_same = (cov * same).sum((-1, -3)) / same.sum((-1, -3))
    return np.where(pairs > 0, g_other, g_same)


def paired_p(base: np.ndarray, row: np.ndarray, base_score: float, row_score: float) -> tuple[float, float, float]:
    """sacreBLEU's paired bootstrap of one seed from the two cells' resampled scores (B,) each: its p-value (the
    count of |resampled difference| - its mean above the observed |difference|, (c + 1) / (B + 1)) and the 95%
    percentile interval of row - base (Efron & Tibshirani 1993, ch. 13; sacreBLEU's own gives mean ± half the
    distance between two order statistics)."""
    diffs = row - base
    if not diffs.any():  # the two score alike on every resample (the same hypotheses): no difference at all
        return 1.0, 0.0, 0.0  # sacreBLEU's count would give 1 / (B + 1), "significant"
    spread = np.abs(diffs)
    p = _compute_p_value(spread - spread.mean(), abs(base_score - row_score))
    low, high = np.quantile(diffs, [0.025, 0.975])
    return float(p), float(low), float(high)


def paired_bootstrap(base_hyps: Sequence[str], hyps: Sequence[str], refs: Sequence[str], metric: str,
                     resamples: int, seed: int, signature: str = "") -> tuple[float, float, float]:
    """(p-value, CI low, CI high) of metric(hyps) - metric(base_hyps) by sacreBLEU's paired bootstrap: the p-value
    `SACREBLEU_SEED=seed sacrebleu REFS -i BASE HYPS --paired-bs --paired-bs-n resamples` prints (tested), and the
    percentile interval of the resampled differences (paired_p)."""
    if not len(base_hyps) == len(hyps) == len(refs):
        raise ValueError(f"paired bootstrap needs as many segments in each: baseline {len(base_hyps)}, "
                         f"system {len(hyps)}, references {len(refs)}")
    cells = [sentence_stats(h, refs, metric, signature) for h in (base_hyps, hyps)]
    counts = resample_counts(len(refs), resamples, seed)
    base, row = (resampled(c, counts, metric, signature) for c in cells)
    return paired_p(base, row, *(corpus(c, metric, signature) for c in cells))
