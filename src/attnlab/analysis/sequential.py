"""Seeds until decided: a group-sequential design over rounds of seeds, whose error rates survive looking after
every round and stopping when the answer is clear.

A study runs every variant at `min` seeds (round 1), then adds `step` seeds per round only to the variants whose
comparison with the baseline is still undecided; the baseline keeps up with them (it has as many seeds as the
undecided variants). After each round the table's own test (inference.against_baseline: metric ~ variant + seed
pooled over the study's rows, Welch's fallback, the test set's sampling) gives each comparison a t statistic, its
degrees of freedom and its unadjusted p. Stopping when that p falls below 0.05 would star a null variant far more
often than 5% of the time (issue 43; tests/test_ablate_sequential.py measures it), so the boundaries are those of a
group-sequential test:

- Alpha spending (Lan & DeMets 1983, "Discrete sequential boundaries for clinical trials", Biometrika
  70:659-663): a test of level a spends alpha(t) of it by information fraction t, here the planned seeds of the
  look over `max` (n / max), whatever the data: the O'Brien-Fleming type alpha(t) = 2 (1 - Phi(z_{1-a/2} /
  sqrt t)) (the default: it keeps almost all of a for the later looks) or the Pocock type alpha(t) = a ln(1 +
  (e - 1) t). Look k's boundary c_k solves P(|Z_j| < c_j for j < k, |Z_k| >= c_k) = alpha(t_k) - alpha(t_{k-1})
  for the canonical joint distribution (Z_k = S_k / sqrt t_k, S with independent increments), integrated by the
  recursive quadrature of Armitage, McPherson & Rowe 1969 (Jennison & Turnbull 2000, "Group Sequential Methods
  with Applications to Clinical Trials", ch. 19). Stopping for another reason (equivalence, `max`) only gives up
  looks, so it never raises the error rate.
- With seed variances estimated from few seeds, each look's t statistic is compared at the boundary's nominal
  significance level 2 (1 - Phi(c_k)) (the significance level approach, Jennison & Turnbull 2000, sec. 3.8).
- The p of a comparison is its repeated p-value (Jennison & Turnbull 2000, sec. 9.1): the smallest level a at
  which its group-sequential test has rejected by now. Over the m comparisons the levels are Holm's (Holm 1979),
  applied to the repeated p-values: the graphical approach of Maurer & Bretz 2013 ("Multiple testing in group
  sequential trials using graphical approaches", Stat. Biopharm. Res. 5:311-320) with Holm's graph, which passes
  the level of a rejected comparison on to the others and keeps the family-wise error rate strongly.
- The interval is the repeated confidence interval (Jennison & Turnbull 1989, "Interim analyses: the repeated
  confidence interval approach", JRSS B 51:305-361) at level a / m for each comparison (Bonferroni): it covers the
  true difference at every look at once, so the interval printed at the look a row stopped at is valid.
- Equivalence (`significance.equivalence: eps`): two one-sided tests (TOST, Schuirmann 1987, "A comparison of
  the two one-sided tests procedure and the power approach for assessing the equivalence of average
  bioavailability", J. Pharmacokinet. Biopharm. 15:657-680), each a one-sided group-sequential test at level
  `significance.level` of the same spending: a comparison is equivalent when its one-sided repeated interval on
  both sides, Delta +- c'_k se, lies inside (-eps, eps). Per comparison, not adjusted over the family.

A comparison is decided when it is significant (better or worse), equivalent, or has reached `max` (stopped at
max); decided comparisons keep the estimate, p and interval of the look they stopped at. Everything here is
vectorised over a leading batch of studies, so the simulations (sequential_power.py) run the functions the table
runs (rounds.py) on thousands of studies at once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from . import inference, multiple, testset

SPENDING = ("obrien_fleming", "pocock", "none")  # none: the fixed-sample test after every round, which optional
# stopping inflates (the simulations' and the tests' point of comparison; no ablation file can choose it)
UNDECIDED, BETTER, WORSE, EQUIVALENT, AT_MAX, UNTESTED = 0, 1, 2, 3, 4, 5
STATES = {UNDECIDED: "undecided", BETTER: "better", WORSE: "worse", EQUIVALENT: "equivalent",
          AT_MAX: "stopped at max", UNTESTED: "no test"}
_GRID = 201  # quadrature nodes over the continuation region (Simpson's rule): |error| of a boundary < 1e-6
_LEVELS = np.unique(np.r_[np.logspace(-10, -4, 13), np.logspace(-4, 0, 65)])  # the levels a tabulated to invert
# repeated p-values (within 1% of the exact level at 1e-4 to 0.9)


def spent(t: np.ndarray | float, alpha: np.ndarray | float, spending: str, sides: int = 2) -> np.ndarray:
    """alpha(t): the part of level alpha spent by information fraction t (Lan & DeMets 1983). A two-sided test
    spends alpha / 2 on each side (Jennison & Turnbull 2000, ch. 7): the O'Brien-Fleming type's two-sided boundary
    at level 0.05 is its one-sided boundary at 0.025."""
    t = np.clip(np.asarray(t, float), 0.0, 1.0)
    alpha = np.asarray(alpha, float)
    if spending == "pocock":
        return alpha * np.log1p((math.e - 1) * t)
    with np.errstate(divide="ignore"):
        side = 2 * stats.norm.sf(stats.norm.isf(alpha / (2 * sides)) / np.sqrt(np.where(t > 0, t, 1.0)))
    return np.where(t > 0, sides * side, 0.0)


def _simpson(half: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nodes (L, G) on [lo, half] for each of L regions and their Simpson weights (L, G)."""
    x = np.linspace(0.0, 1.0, _GRID)
    u = lo[:, None] + (half - lo)[:, None] * x
    w = np.full(_GRID, 2.0)
    w[1::2] = 4.0
    w[0] = w[-1] = 1.0
    return u, w * ((half - lo)[:, None] / (3 * (_GRID - 1)))


def boundaries_many(fractions: tuple[float, ...], alphas: np.ndarray, spending: str, sides: int = 2) -> np.ndarray:
    """(L, looks) the critical values c_k (z scale) of the looks at these information fractions for tests of
    each level in alphas (L,): two-sided (reject at |Z_k| >= c_k) or one-sided (Z_k >= c_k); inf where a look
    spends nothing. The sub-density of S_k = sqrt(t_k) Z_k on the continuation region is carried from look to
    look by Simpson's rule (the recursive integration of Armitage, McPherson & Rowe 1969)."""
    alphas = np.asarray(alphas, float)
    out = np.zeros((len(alphas), len(fractions)))
    prev_t, prev_spent, u, dens = 0.0, np.zeros(len(alphas)), None, None
    for j, t in enumerate(fractions):
        target = spent(t, alphas, spending, sides) - prev_spent  # (L,)
        root = math.sqrt(t)
        if u is None:  # the first look: S_1 ~ N(0, t_1)
            with np.errstate(divide="ignore"):
                c = np.where(target > 0, stats.norm.isf(np.clip(target, 1e-300, None) / sides), np.inf)
        else:
            sd = math.sqrt(t - prev_t)
            lo, hi = np.zeros(len(alphas)), np.full(len(alphas), 40.0)
            for _ in range(60):  # bisection, every level at once: the crossing probability falls as c grows
                mid = (lo + hi) / 2
                above = _crossing(mid * root, u, dens, sd, sides) > target
                lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
            all_cross = _crossing(np.zeros(len(alphas)), u, dens, sd, sides) <= target
            c = np.where(target <= 1e-15, np.inf, np.where(all_cross, 0.0, hi))
        out[:, j] = c
        prev_spent = prev_spent + np.where(np.isfinite(c), target, 0.0)
        b = np.minimum(c, 12.0) * root
        new_u, new_w = _simpson(b, -b if sides == 2 else np.full(len(alphas), -12.0 * root))
        if u is None:
            f = stats.norm.pdf(new_u / root) / root
        else:
            sd = math.sqrt(t - prev_t)
            z = (new_u[:, :, None] - u[:, None, :]) / sd  # (L, G, G)
            f = np.einsum("lgh,lh->lg", np.exp(-0.5 * z * z), dens) / (sd * math.sqrt(2 * math.pi))
        u, dens, prev_t = new_u, f * new_w, t
    return out


def _crossing(b: np.ndarray, u: np.ndarray, dens: np.ndarray, sd: float, sides: int) -> np.ndarray:
    """(L,) P(continue to the last look, then |S_k| >= b) (S_k >= b one-sided) for S_k = S_{k-1} + N(0, sd^2), the
    sub-density of S_{k-1} given at the nodes u (L, G) times their weights (dens)."""
    p = (dens * stats.norm.sf((b[:, None] - u) / sd)).sum(-1)
    return p + ((dens * stats.norm.cdf((-b[:, None] - u) / sd)).sum(-1) if sides == 2 else 0.0)


@functools.lru_cache(maxsize=4096)
def boundaries(fractions: tuple[float, ...], alpha: float, spending: str, sides: int = 2) -> np.ndarray:
    """The critical values c_k of one test of level alpha (boundaries_many)."""
    return boundaries_many(fractions, np.array([alpha]), spending, sides)[0]


@dataclass(frozen=True)
class Design:
    """Rounds of seeds and the decisions made after each (the module docstring)."""

    min_seeds: int
    max_seeds: int
    step: int = 1
    level: float = 0.05
    spending: str = "obrien_fleming"
    equivalence: float | None = None  # eps of "equivalent": |Delta| < eps (None: no equivalence decisions)
    family: bool = True  # Holm over the comparisons, intervals at level / m (significance.correction: none: each alone)

    def __post_init__(self) -> None:
        if not 1 <= self.min_seeds <= self.max_seeds or self.step < 1:
            raise ValueError(f"seeds: min {self.min_seeds}, max {self.max_seeds}, step {self.step}: need "
                             "1 <= min <= max and step >= 1")
        if self.spending not in SPENDING:
            raise ValueError(f"spending {self.spending!r}: expected one of {', '.join(SPENDING)}")

    @property
    def schedule(self) -> tuple[int, ...]:
        """The seeds of each round: min, min + step, ..., max."""
        return tuple(range(self.min_seeds, self.max_seeds, self.step)) + (self.max_seeds,)

    @property
    def fractions(self) -> tuple[float, ...]:
        return tuple(n / self.max_seeds for n in self.schedule)

    def critical(self, look: int, alpha: float, sides: int = 2) -> float:
        """c of round `look` (1-based) for a test of level alpha."""
        if self.spending == "none":
            return float(stats.norm.isf(alpha / sides))
        return float(boundaries(self.fractions, float(alpha), self.spending, sides)[look - 1])

    def nominal(self, look: int, alpha: float, sides: int = 2) -> float:
        """The nominal p-value a t statistic of round `look` is compared with (two-sided p for sides=2)."""
        return float(sides * stats.norm.sf(self.critical(look, alpha, sides)))

    def repeated_p(self, p_raw: np.ndarray, look: int) -> np.ndarray:
        """The repeated p-value of each comparison's round-`look` unadjusted two-sided p: the smallest level whose
        boundary at that look it crosses (1 where it crosses none; NaN stays NaN)."""
        c = _table(self.fractions, self.spending)[:, look - 1]  # (levels,) decreasing in the level
        p_raw = np.asarray(p_raw, float)
        if self.spending == "none":
            return p_raw
        z = stats.norm.isf(p_raw / 2)
        ok = np.isfinite(c) & (c > 0)
        # log a - log 2(1 - Phi(c)) (what the looks before cost) is smooth in c: interpolated, not log a itself
        excess = np.log(_LEVELS[ok]) - stats.norm.logsf(c[ok]) - math.log(2)
        log_a = np.interp(-z, -c[ok], excess) + np.log(p_raw)
        return np.where(np.isnan(p_raw), np.nan, np.clip(np.exp(log_a), _LEVELS[0], 1.0))

    def describe(self) -> str:
        kind = {"obrien_fleming": "O'Brien-Fleming-type", "pocock": "Pocock-type", "none": "no"}[self.spending]
        return f"seeds {self.min_seeds} to {self.max_seeds} in steps of {self.step}, {kind} alpha spending"

    def to_dict(self) -> dict:
        return {"min": self.min_seeds, "max": self.max_seeds, "step": self.step, "level": self.level,
                "spending": self.spending, "equivalence": self.equivalence, "family": self.family}


@functools.lru_cache(maxsize=256)
def _table(fractions: tuple[float, ...], spending: str) -> np.ndarray:
    """(levels, looks) the two-sided boundaries at each tabulated level a (a look's boundary depends only on the
    looks before it, so one table serves every look)."""
    return boundaries_many(fractions, _LEVELS, spending)


@dataclass
class Replay:
    """The rounds of a batch of studies (S,) with k rows (the baseline first) and m = k - 1 comparisons."""

    design: Design
    rounds: int  # looks made (the largest over the batch)
    seeds: list[np.ndarray] = field(default_factory=list)  # per look (S, k) the seeds each row had planned
    states: list[np.ndarray] = field(default_factory=list)  # per look (S, m) each comparison's state after it
    state: np.ndarray | None = None  # (S, m) now
    estimate: np.ndarray | None = None  # (S, m) at the look each comparison stopped at (or the latest)
    se: np.ndarray | None = None
    df: np.ndarray | None = None
    p_raw: np.ndarray | None = None  # that look's unadjusted p
    p_repeated: np.ndarray | None = None  # the repeated p-value (the smallest over its looks)
    p_adjusted: np.ndarray | None = None  # Holm over the m repeated p-values: the table's p
    low: np.ndarray | None = None  # the repeated confidence interval at level / m
    high: np.ndarray | None = None
    eq_low: np.ndarray | None = None  # the one-sided repeated intervals of the TOST, each at level
    eq_high: np.ndarray | None = None
    stopped: np.ndarray | None = None  # (S, m) the round each comparison stopped at (0: still running)
    decided: np.ndarray | None = None  # (S, m) the round its decision was made (a later one when Holm's levels grew)
    pooled: np.ndarray | None = None  # (S,) whether the last look used the pooled model
    waiting: np.ndarray | None = None  # (S, k, n) the cells the next round needs (nothing once every one is decided)

    @property
    def done(self) -> np.ndarray:
        return ~(self.state == UNDECIDED).any(-1)

    def trainings(self) -> np.ndarray:
        """(S,) the (row, seed) trials the rounds so far ran."""
        return self.seeds[-1].sum(-1)


def plan(design: Design, look: int, state: np.ndarray, last: np.ndarray) -> np.ndarray:
    """(S, k) the seeds each row has at round `look`: every row min at round 1; after that the rows with an undecided
    comparison, and the baseline while any is, the round's seeds; the others what they had."""
    n = design.schedule[look - 1]
    if look == 1:
        return np.full(last.shape, n)
    open_ = state == UNDECIDED  # (S, m)
    out = last.copy()
    out[..., 1:] = np.where(open_, n, last[..., 1:])
    out[..., 0] = np.where(open_.any(-1), n, last[..., 0])
    return out


def replay(y: np.ndarray, ystar: np.ndarray | None, design: Design, settled: np.ndarray | None = None,
           sign: float = 1.0, resample_df: float = math.inf) -> Replay:
    """The rounds of studies y (S, k, N), the baseline row first, seeds in order (N >= max; NaN where a trial has no
    score), ystar (S, B, k, N) the scores on resampled test sentences (None: the test set held fixed). settled
    (S, k, N): the cells whose trial has ended (done or failed for good); a round whose cells are not all settled is
    not looked at: replay.waiting says which cells it needs. sign -1 when a lower metric is better."""
    s, k, big_n = y.shape
    m = k - 1
    settled = np.ones(y.shape, bool) if settled is None else np.broadcast_to(settled, y.shape)
    out = Replay(design, 0)
    nan = np.full((s, m), np.nan)
    state = np.full((s, m), UNDECIDED)
    out.estimate, out.se, out.df, out.p_raw = nan.copy(), nan.copy(), nan.copy(), nan.copy()
    out.p_repeated, out.low, out.high, out.eq_low, out.eq_high = (nan.copy() for _ in range(5))
    out.stopped, out.decided = np.zeros((s, m), int), np.zeros((s, m), int)
    out.pooled, out.waiting = np.zeros(s, bool), np.zeros(y.shape, bool)
    seeds = np.zeros((s, k), int)
    alive = np.ones(s, bool)  # studies whose next round can be looked at
    level = design.level
    idx = np.arange(big_n)
    for look in range(1, len(design.schedule) + 1):
        want = plan(design, look, state, seeds)
        go = alive & ((state == UNDECIDED).any(-1) | (look == 1))
        need = (idx < want[..., None]) & go[:, None, None]  # (S, k, N)
        ready = ~(need & ~settled).any((-1, -2))
        out.waiting = np.where((go & ~ready)[:, None, None], need & ~settled, out.waiting)
        go &= ready
        alive &= ready | ~((state == UNDECIDED).any(-1) | (look == 1))
        if not go.any():
            break
        seeds = np.where(go[:, None], want, seeds)
        open_before = (state == UNDECIDED) & go[:, None]
        cells = need & np.isfinite(y)
        est, se, df, p, use = _look(y, ystar, cells, go, resample_df)
        out.pooled = np.where(go, use, out.pooled)
        p = np.where(np.isfinite(p), p, np.where(np.isfinite(est) & (se == 0), 1.0, np.nan))
        rep = design.repeated_p(np.where(np.isfinite(p), p, 1.0), look)
        rep = np.where(np.isfinite(out.p_repeated), np.fmin(out.p_repeated, rep), rep)
        upd = open_before
        for name, new in (("estimate", est), ("se", se), ("df", df), ("p_raw", p), ("p_repeated", rep)):
            setattr(out, name, np.where(upd, new, getattr(out, name)))
        crit = stats.t.isf(design.nominal(look, level / max(m, 1) if design.family else level) / 2, df)
        half = crit * se
        eq_half = stats.t.isf(design.nominal(look, level, sides=1), df) * se
        out.low, out.high = np.where(upd, est - half, out.low), np.where(upd, est + half, out.high)
        out.eq_low, out.eq_high = np.where(upd, est - eq_half, out.eq_low), np.where(upd, est + eq_half, out.eq_high)
        adjusted = multiple.holm(out.p_repeated) if design.family else out.p_repeated
        significant = (adjusted < level) & go[:, None]
        direction = np.where(sign * out.estimate > 0, BETTER, WORSE)
        no_trial = ~(np.isfinite(y) & need)[:, 1:].any(-1)  # (S, m) the row has no score in this round
        eps = design.equivalence
        equivalent = (out.eq_low > -eps) & (out.eq_high < eps) if eps is not None else np.zeros_like(significant)
        at_max = want[..., 1:] >= design.max_seeds
        new_state = np.select([significant, equivalent, no_trial, at_max], [direction, EQUIVALENT, UNTESTED, AT_MAX],
                              UNDECIDED)
        # a comparison decided before keeps its state, unless Holm's levels, grown by later rejections, star it
        kept = np.where(significant & ~np.isin(state, (BETTER, WORSE)), direction, state)
        state_next = np.where(open_before, new_state, np.where(go[:, None], kept, state))
        out.decided = np.where((state_next != state) & (state_next != UNDECIDED), look, out.decided)
        out.stopped = np.where(open_before & (state_next != UNDECIDED), look, out.stopped)
        state = state_next
        out.p_adjusted = adjusted
        out.seeds.append(seeds.copy())
        out.states.append(state.copy())
        out.rounds = look
    out.state = state
    if out.p_adjusted is None:
        out.p_adjusted = nan.copy()
    return out


def _look(y: np.ndarray, ystar: np.ndarray | None, cells: np.ndarray, go: np.ndarray, resample_df: float):
    """One round's test of every comparison (S, m) in the studies `go`, studies with the same cells fitted
    together: estimate, se, degrees of freedom, unadjusted p, and (S,) whether the pooled model was used."""
    s, k, _ = y.shape
    est, se, df, p = (np.full((s, k - 1), np.nan) for _ in range(4))
    use = np.zeros(s, bool)
    if not go.any():
        return est, se, df, p, use
    keys = np.packbits(cells.reshape(s, -1), -1)
    groups: dict[bytes, list[int]] = {}
    for i in np.nonzero(go)[0]:
        groups.setdefault(keys[i].tobytes(), []).append(i)
    for members in groups.values():
        i = np.array(members)
        mask = cells[i[0]]
        if (mask.sum(-1) == 0).any():  # a row without any trial: the others are tested without it
            rows = np.nonzero(mask.sum(-1) > 0)[0]
            if rows[0] != 0 or len(rows) < 2:
                continue
        else:
            rows = np.arange(k)
        sub = mask[rows]
        yy = np.where(sub, y[i][:, rows], np.nan)
        g = None
        if ystar is not None:
            g = testset.test_set_cov(np.where(sub, ystar[i][:, :, rows], np.nan))
        tested, used, _, _ = inference.against_baseline(yy, sub, 0, g, correction="none", intervals=False)
        cols = rows[1:] - 1
        for name, arr in (("estimate", est), ("se", se), ("df", df), ("p_raw", p)):
            arr[np.ix_(i, cols)] = getattr(tested, name)
        use[i] = used
    return est, se, df, p, use
