"""A study run in rounds of seeds (`seeds: {min, max}`, `ablate run --until-decided`), read from what its trials
stored: its rounds replayed (sequential.replay), the points the round under way needs (the runner claims only
those), each comparison's state (`ablate status`) and the table's sequentially valid p, interval and decision.

Nothing of the rounds is stored but the trials: every reader replays them from the trials' scores, so a worker
killed at any moment, a resumed `ablate run` and `ablate table` all see the same rounds. Round r is looked at once
every trial it needs has ended (done, or failed or invalid for good: a cell without a score); the rows are the
baseline first, then the file's variants in order, and a row's seeds are the file's seeds in order, so round r of a
row is its first n_r seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..ablate.study import DONE, FAILED, INVALID, PointState, StudyHandle, final_scores, point_states, trial_value
from . import sequential, testset
from .columns import FINAL_METRIC
from .model import Comparison
from .rows import Row, column_value, hypotheses

SETTLED = (DONE, FAILED, INVALID)
_RESCORED: dict[tuple[str, int, str, int, int], tuple[float, np.ndarray]] = {}  # a process's rescored cells


def design_of(h: StudyHandle) -> sequential.Design | None:
    """The design of a study run in rounds (None: a fixed list of seeds)."""
    spec, sig = h.spec, h.spec.significance
    if spec.rounds is None:
        return None
    return sequential.Design(spec.rounds.min, spec.rounds.max, spec.rounds.step, sig["level"], sig["spending"],
                             sig["equivalence"], sig["correction"] != "none")


@dataclass
class Rounds:
    design: sequential.Design
    keys: list[str]  # the rows, the baseline first
    names: list[str]
    seeds: tuple[int, ...]  # (N,) the file's seeds in order
    replay: sequential.Replay  # a batch of one study
    population: str  # "sample" or "test_set"
    why_fixed: str  # why the test set is held fixed when the file asked for a sample
    refused: dict[str, str]  # rows whose sacreBLEU signature differs from the baseline's: not tested

    def state(self, i: int) -> str:
        """Comparison i's state (row i + 1) in words."""
        return sequential.STATES[int(self.replay.state[0, i])] if self.replay.state is not None else "undecided"

    @property
    def done(self) -> bool:
        return self.replay.state is not None and bool(self.replay.done[0])

    def trainings(self) -> int:
        return int(self.replay.seeds[-1].sum()) if self.replay.seeds else 0


def _rescore(h: StudyHandle, t, split: str, score: str, signature: str) -> tuple[float, np.ndarray] | None:
    """A trial's corpus score and its scores on the study's resampled test sentences, rescored by sacreBLEU from
    its stored hypotheses once per process."""
    sig = h.spec.significance
    key = (str(h.dir), t.number, split + score + signature, sig["resamples"], sig["seed"])
    if key not in _RESCORED:
        texts = hypotheses(t, split, h.study.user_attrs)
        if texts is None:
            return None
        stats = testset.sentence_stats(*texts, score, signature)
        counts = testset.resample_counts(len(texts[1]), sig["resamples"], sig["seed"])
        _RESCORED[key] = (testset.corpus(stats, score, signature), testset.resampled(stats, counts, score, signature))
    return _RESCORED[key]


def replayed(h: StudyHandle, states: dict[str, PointState] | None = None) -> Rounds | None:
    """The study's rounds so far (None for a study with a fixed list of seeds)."""
    design = design_of(h)
    if design is None:
        return None
    spec, attrs = h.spec, h.study.user_attrs
    states = point_states(h) if states is None else states
    variants = spec.variants()
    base = spec.baseline()
    order = [base] + [v for v in variants if v.key != base.key]
    keys, seeds = [v.key for v in order], spec.seeds
    k, n = len(order), len(seeds)
    y, settled = np.full((1, k, n), np.nan), np.zeros((1, k, n), bool)
    trials = {}
    row_of = {v.name: i for i, v in enumerate(order)}
    for s in states.values():
        if s.variant not in row_of or s.seed not in seeds:
            continue  # a point of no row of the grid (an lr: extension)
        i, j = row_of[s.variant], seeds.index(s.seed)
        settled[0, i, j] = s.status in SETTLED
        if s.result is not None:
            value = trial_value(s.result, spec.metric, attrs)
            y[0, i, j] = math.nan if value is None else value
            trials[i, j] = s.result
    ystar, why, refused = None, "", {}
    final = FINAL_METRIC.match(spec.metric)
    score = final.group(2) if final and final.group(2) in ("bleu", "chrf") else ""
    if score:
        sigs = {ij: final_scores(t, attrs).get(f"{score}_signature", "") for ij, t in trials.items()}
        want = {v for (i, _), v in sigs.items() if i == 0}
        for (i, _), v in sigs.items():
            if i and want and {v} != want:
                refused[keys[i]] = f"its sacreBLEU signature {v} differs from the baseline's {' ; '.join(want)}"
        for key in refused:
            y[0, keys.index(key)] = np.nan
    if spec.significance["population"] == "sample":
        if not score:
            why = f"{spec.metric} has no per-sentence scores stored"
        else:
            ystar, y, why = _resampled(h, trials, y, score, final.group(1), refused, keys)
    replay = sequential.replay(y, ystar, design, settled, 1.0 if spec.direction == "max" else -1.0)
    return Rounds(design, keys, [v.name for v in order], seeds, replay, "sample" if ystar is not None else "test_set",
                  why, refused)


def _resampled(h, trials, y, score, split, refused, keys):
    """ystar (1, B, k, N) of the done cells (NaN elsewhere) and y rescored by sacreBLEU; None and why when some
    trial's hypotheses are not stored."""
    sig = h.spec.significance
    ystar = np.full((1, sig["resamples"]) + y.shape[1:], np.nan)
    y = y.copy()
    for (i, j), t in trials.items():
        if keys[i] in refused or not np.isfinite(y[0, i, j]):
            continue
        got = _rescore(h, t, split, score, final_scores(t, h.study.user_attrs).get(f"{score}_signature", ""))
        if got is None:
            return None, y, "some trials' hypotheses are not stored"
        y[0, i, j], ystar[0, :, i, j] = got
    return ystar, y, ""


def points_wanted(h: StudyHandle, states: dict[str, PointState], max_round: int | None = None) -> set[str] | None:
    """The point ids the round under way still needs (None: not a study in rounds): what a worker may claim; none
    once the round under way is past max_round (a SLURM array runs one round; the next one is its own array)."""
    r = replayed(h, states)
    if r is None:
        return None
    if max_round is not None and r.replay.rounds + 1 > max_round:
        return set()
    want = {(r.names[i], int(r.seeds[j])) for i, j in zip(*np.nonzero(r.replay.waiting[0]), strict=True)}
    return {s.point_id for s in states.values() if (s.variant, s.seed) in want}


def unneeded(h: StudyHandle, grace_s: float = 120.0) -> set[str]:
    """The pending points no round needs (yet, or at all once every comparison is decided): `ablate status` counts
    them apart."""
    states = point_states(h, grace_s=grace_s)
    wanted = points_wanted(h, states)
    if wanted is None:
        return set()
    return {s.point_id for s in states.values() if s.status == "pending" and s.point_id not in wanted}


def round_counts(h: StudyHandle, grace_s: float = 120.0) -> dict[str, int] | None:
    """Points by status, the points no round needs (yet, or at all once every comparison is decided) counted as
    `not needed` instead of pending (None: not a study in rounds)."""
    if h.spec.rounds is None:
        return None
    states = point_states(h, grace_s=grace_s)
    wanted = points_wanted(h, states) or set()
    out: dict[str, int] = {}
    for s in states.values():
        status = "not needed" if s.status == "pending" and s.point_id not in wanted else s.status
        out[status] = out.get(status, 0) + 1
    return out


def describe(r: Rounds) -> list[str]:
    """Each round: its seeds, the rows it ran, its trainings; then each comparison's state (`ablate status`)."""
    d, rep = r.design, r.replay
    lines = [f"rounds: {d.describe()}" + (f", equivalent within ±{d.equivalence:g}" if d.equivalence else "")]
    prev = np.zeros(len(r.keys), int)
    for look, seeds in enumerate(rep.seeds, start=1):
        added = seeds[0] - prev
        rows = [r.names[i] for i in np.nonzero(added)[0]]
        lines.append(f"  round {look}: {d.schedule[look - 1]} seeds; {int(added.sum())} trainings "
                     f"({', '.join(rows)})")
        prev = seeds[0]
    total, fixed = r.trainings(), len(r.keys) * d.max_seeds
    if r.done:
        lines.append(f"  decided after {rep.rounds} round(s): {total} trainings, {100 * total / fixed:.0f}% of the "
                     f"{fixed} of {d.max_seeds} seeds for every row")
    else:
        waiting = int(rep.waiting[0].sum())
        lines.append(f"  round {rep.rounds + 1} under way: {waiting} trial(s) to finish" if rep.rounds or waiting
                     else "  round 1 under way")
    for i, name in enumerate(r.names[1:]):
        lines.append(f"  {name}: {comparison_text(r, i)}")
    return lines


def comparison_text(r: Rounds, i: int) -> str:
    rep = r.replay
    state = r.state(i)
    if r.keys[i + 1] in r.refused:
        return f"no test: {r.refused[r.keys[i + 1]]}"
    if rep.state is None or not np.isfinite(rep.estimate[0, i]):
        return state
    at = int(rep.stopped[0, i]) or rep.rounds
    numbers = (f"Δ {rep.estimate[0, i]:+.3g}, p {rep.p_adjusted[0, i]:.3g}, CI [{rep.low[0, i]:+.3g}, "
               f"{rep.high[0, i]:+.3g}]")
    if state == "undecided":
        return f"undecided after round {at} ({numbers})"
    when = f" at round {int(rep.decided[0, i])}" if rep.decided[0, i] != rep.stopped[0, i] else ""
    return f"{state}{when} (stopped at round {at}, {r.design.schedule[at - 1]} seeds; {numbers})"


def compare_rounds(h: StudyHandle, rows: list[Row], base: Row) -> Rounds | None:
    """The table's rows of a study in rounds: each row keeps the seeds its rounds gave it, and its comparison is the
    one of the round it stopped at (sequential p, repeated interval, decision); returns the rounds (footnote)."""
    r = replayed(h)
    if r is None:
        return None
    rep, attrs = r.replay, h.study.user_attrs
    given = dict(zip(r.keys, rep.seeds[-1][0], strict=True)) if rep.seeds else {}
    for row in rows:
        n = given.get(row.key, 0)
        keep = [(t, v) for t, v in zip(row.trials, row.values, strict=True)
                if int(t.user_attrs.get("seed", 0)) in r.seeds[:n]]
        if keep and len(keep) < len(row.trials):
            row.trials, row.values = [t for t, _ in keep], [v for _, v in keep]
            row.cells = {c.source: column_value(row, c, attrs) for c in h.spec.columns if c.source != "metric"}
        row.baseline_seeds = list(r.seeds[:given.get(r.keys[0], 0)])
        row.significant, row.comparison = False, None
        if row is base or row.key not in r.keys:
            continue
        i = r.keys.index(row.key) - 1
        row.decision = decision_text(r, i)
        if row.key in r.refused:
            row.refused = r.refused[row.key]
            continue
        if not np.isfinite(rep.estimate[0, i]):
            row.untested = "no test yet" if r.state(i) == "undecided" else r.state(i)
            continue
        row.delta = float(rep.estimate[0, i])
        row.comparison = Comparison("sequential", row.delta, float(rep.p_raw[0, i]), float(rep.p_adjusted[0, i]),
                                    float(rep.low[0, i]), float(rep.high[0, i]), float(rep.se[0, i]),
                                    float(rep.df[0, i]), tuple(row.seeds), "holm" if r.design.family else "none")
        row.significant = r.state(i) in ("better", "worse")
    return r


def decision_text(r: Rounds, i: int) -> str:
    """The table's decision cell: the state and the round (and seeds) the row stopped at."""
    state, rep = r.state(i), r.replay
    if state == "undecided":
        return f"undecided ({r.design.schedule[rep.rounds - 1]} seeds)" if rep.rounds else "undecided"
    at = int(rep.stopped[0, i]) or rep.rounds
    return f"{state}, round {at} ({r.design.schedule[at - 1]} seeds)"


def footnote(h: StudyHandle, r: Rounds, q: int) -> str:
    """What the sequential p, interval and decisions are, and how many trainings the rounds took."""
    d, sig = r.design, h.spec.significance
    kind = "O'Brien-Fleming" if d.spending == "obrien_fleming" else "Pocock"
    adjusted = d.family and q > 1
    pooled = "pooled" if r.replay.pooled[0] else "Welch's unpooled"
    parts = [f"Seeds until decided: every row at {d.min_seeds} seeds, then {d.step} more a round for the rows whose "
             f"comparison is undecided (and the baseline), at most {d.max_seeds}; after each round the table's "
             f"model ({h.spec.metric} ~ variant + seed, {pooled} at the last round) tests every open comparison at "
             f"the boundary of a group-sequential design with {kind}-type alpha spending over the rounds "
             "(Lan & DeMets 1983; information fraction: seeds / max).",
             "p: the repeated p-value (the smallest level whose boundary the comparison has crossed; Jennison & "
             "Turnbull 2000)" + (f", Holm-adjusted over the {q} comparisons (Maurer & Bretz 2013's graphical "
                                 "procedure)" if adjusted else "") +
             "; 95% CI of Δ: the repeated confidence interval" + (f" at level {sig['level']:g} / {q}" if adjusted
                                                                  else "") +
             " (Jennison & Turnbull 1989), valid at every round at once; both from the round the row stopped at."]
    if d.equivalence:
        parts.append(f"Equivalent: both one-sided repeated {100 * (1 - d.level):g}% bounds of Δ within "
                     f"±{d.equivalence:g} (TOST, Schuirmann 1987; each comparison at level {d.level:g}).")
    if r.population == "sample":
        parts.append(f"The intervals cover seed-to-seed variation and the test set's sampling ({sig['resamples']} "
                     "resamples of its sentences).")
    else:
        parts.append("The intervals cover seed-to-seed variation on this test set only" +
                     (f" ({r.why_fixed})." if r.why_fixed else " (significance.population: test_set)."))
    stops = [f"{name}: {decision_text(r, i)}" for i, name in enumerate(r.names[1:])]
    total, fixed = r.trainings(), len(r.keys) * d.max_seeds
    parts.append("Stopped: " + "; ".join(stops) + f". {r.replay.rounds} round(s), {total} trainings ({fixed} for "
                 f"{d.max_seeds} seeds of every row).")
    parts.append(f"* adjusted p < {sig['level']:g}" + (" (Holm passes the level of a starred row on to the others, so "
                                                         "a row can be starred while its interval at level / "
                                                         f"{q} still covers 0)." if adjusted else "."))
    return " ".join(parts)
