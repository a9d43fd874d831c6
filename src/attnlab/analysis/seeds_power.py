"""Seeds until decided, measured: simulated studies pushed through the rounds the table replays (sequential.replay,
which tests each round with inference.against_baseline and testset.test_set_cov, the table's functions), thousands
at once. `attnlab ablate seeds-power` writes docs/results/seeds_power.md (and .json);
tests/test_ablate_sequential.py runs smaller ones, and tests/test_ablate_sequential_runs.py pushes a few studies
through the runner and the table to show these are the functions they use.

A simulated study is issue 41's (power.simulate): per-sentence scores of a baseline and `variants` compared variants
x `max` seeds x the test sentences, each trial's seed part of SD `seed_sd` (or a part shared by every variant of a
seed plus one of its own), sentence noise of 0.58 points in a corpus score; variant v is better by deltas[v]. Three
questions:

- size: no variant differs; how often is one starred under optional stopping (per comparison, the worst single
  comparison, and family-wise), with the sequential boundaries and with the fixed-sample test after every round
  (spending `none`, what stopping at the first p < 0.05 does);
- wrong equivalence: every variant differs by exactly +-eps; how often is one declared equivalent;
- seeds spent: half the variants better by 3, half not at all; the trainings the rounds take against the fixed
  design of `max` seeds for every row (and its power and equivalence decisions, TOST on its 90% interval), and the
  fewest seeds of a fixed design with the power the rounds reach.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import inference, power, sequential, testset

LEVEL = 0.05


@dataclass(frozen=True)
class Case:
    variants: int  # compared variants (the study has variants + 1 rows with the baseline)
    seed_sd: float  # each trial's own seed part
    deltas: tuple[float, ...]  # each compared variant's true difference to the baseline
    spending: str = "obrien_fleming"
    eps: float | None = None  # significance.equivalence
    shared_sd: float = 0.0  # a seed part every variant of that seed shares
    min_seeds: int = 2
    max_seeds: int = 10

    @property
    def design(self) -> sequential.Design:
        return sequential.Design(self.min_seeds, self.max_seeds, 1, LEVEL, self.spending, self.eps)

    @property
    def sd_label(self) -> str:
        return f"{self.shared_sd:g} + {self.seed_sd:g}" if self.shared_sd else f"{self.seed_sd:g}"


def simulate(rng: np.random.Generator, case: Case, studies: int, sentences: int = 300, sentence_sd: float = 10.0,
             resamples: int = 200, seed: int = 12345) -> tuple[np.ndarray, np.ndarray]:
    """Corpus scores y (studies, rows, max) and their scores on resampled test sentences (studies, B, rows, max)."""
    s = power.Setting(case.max_seeds, case.variants + 1, case.shared_sd, case.seed_sd, sentences=sentences,
                      sentence_sd=sentence_sd)
    x = power.simulate(rng, s, studies)  # (studies, rows, seeds, sentences)
    x += np.array((0.0,) + tuple(case.deltas))[None, :, None, None]
    counts = testset.resample_counts(sentences, resamples, seed).astype(float)  # (B, m)
    ystar = (x.reshape(-1, sentences) @ counts.T / sentences).reshape(x.shape[:3] + (resamples,))
    return x.mean(-1), np.moveaxis(ystar, -1, 1)


def fixed(y: np.ndarray, ystar: np.ndarray | None, n: int, eps: float | None) -> tuple[np.ndarray, np.ndarray]:
    """The fixed design of the first n seeds of every row: starred (Dunnett, the table's test) and equivalent (TOST:
    the comparison's own 90% interval inside +-eps) (studies, variants)."""
    yy = y[..., :n]
    g = testset.test_set_cov(ystar[..., :n]) if ystar is not None else None
    mask = np.ones(yy.shape[-2:], bool)
    tested, *_ = inference.against_baseline(yy, mask, 0, g, level=1 - LEVEL, intervals=False, skip_above=LEVEL)
    starred = np.nan_to_num(tested.p, nan=1.0) < LEVEL
    if eps is None:
        return starred, np.zeros_like(starred)
    tost, *_ = inference.against_baseline(yy, mask, 0, g, correction="none", level=1 - 2 * LEVEL)
    return starred, (tost.low > -eps) & (tost.high < eps)


def rates(case: Case, starred: np.ndarray, equivalent: np.ndarray, right: np.ndarray | None = None) -> dict:
    """Error and decision rates over the comparisons of a batch (studies, variants): size, worst, family-wise over
    the null ones; power (starred the right way) over those with a difference; equivalence decisions."""
    d = np.array(case.deltas)
    null, diff = d == 0, d != 0
    out = {}
    if null.any():
        out.update(size=float(starred[:, null].mean()), worst=float(starred[:, null].mean(0).max()),
                   familywise=float(starred[:, null].any(1).mean()), null_equivalent=float(equivalent[:, null].mean()))
    if diff.any():
        found = starred[:, diff] & (right[:, diff] if right is not None else True)
        out.update(power=float(found.mean()), equivalent_wrongly=float(equivalent[:, diff].mean()),
                   equivalent_wrongly_any=float(equivalent[:, diff].any(1).mean()))
    return out


def run_case(case: Case, studies: int, seed: int = 0, chunk: int = 500, fixed_too: bool = False, **sim) -> dict:
    """The rounds' rates and trainings over `studies` simulated studies (and the fixed design's, with fixed_too)."""
    rng = np.random.default_rng([seed, int(hashlib.sha1(repr(case).encode()).hexdigest()[:8], 16)])
    starred, equivalent, right, trainings, looks, pooled = [], [], [], [], [], []
    fixed_rates: dict[int, list] = {}
    for start in range(0, studies, chunk):
        y, ystar = simulate(rng, case, min(chunk, studies - start), **sim)
        r = sequential.replay(y, ystar, case.design)
        starred.append(np.isin(r.state, (sequential.BETTER, sequential.WORSE)))
        right.append((r.state == sequential.BETTER) == (np.array(case.deltas) > 0))
        equivalent.append(r.state == sequential.EQUIVALENT)
        trainings.append(r.trainings())
        looks.append(1 + sum((b != a).any(-1) for a, b in zip(r.seeds, r.seeds[1:], strict=False)))  # its rounds
        pooled.append(r.pooled)
        for n in range(case.min_seeds, case.max_seeds + 1) if fixed_too else ():
            fixed_rates.setdefault(n, []).append(fixed(y, ystar, n, case.eps))
    cat = np.concatenate
    out = {"case": asdict(case), "studies": studies,
           "rounds": rates(case, cat(starred), cat(equivalent), cat(right)),
           "trainings": float(cat(trainings).mean()), "looks": float(cat(looks).mean()),
           "fixed_trainings": (case.variants + 1) * case.max_seeds, "pooled_share": float(cat(pooled).mean())}
    if fixed_too:
        by_n = {n: rates(case, cat([a for a, _ in v]), cat([b for _, b in v])) for n, v in fixed_rates.items()}
        out["fixed"] = by_n[case.max_seeds]
        if "power" in out["rounds"]:
            same = [n for n, r in sorted(by_n.items()) if r["power"] >= out["rounds"]["power"]]
            out["fixed_same_power_seeds"] = same[0] if same else None
    return out


# ---------------------------------------------------------------------------------------------- the docs' tables
SDS = ((0.0, 0.0), (0.0, 1.3), (0.0, 3.0), (1.2, 0.5))  # (shared, own) seed SDs


def size_cases() -> list[Case]:
    return [Case(v, own, (0.0,) * v, spending, shared_sd=shared) for v in (4, 8) for shared, own in SDS[:3]
            for spending in ("obrien_fleming", "pocock", "none")]


def equivalence_cases() -> list[Case]:
    return [Case(4, own, (eps, -eps, eps, -eps), spending, eps, shared) for eps in (1.0, 2.0)
            for shared, own in SDS[:3] for spending in ("obrien_fleming", "pocock", "none")]


def cost_cases() -> list[Case]:
    half = (3.0, 3.0, 0.0, 0.0)
    out = [Case(4, own, half, spending, eps, shared) for shared, own in SDS for eps in (None, 1.0, 2.0, 3.0)
           for spending in ("obrien_fleming", "pocock")]
    return out + [Case(8, 1.3, half * 2, spending, eps) for eps in (2.0, 3.0) for spending in ("obrien_fleming",
                                                                                               "pocock")]


def pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def spend_name(s: str) -> str:
    return {"obrien_fleming": "O'Brien-Fleming", "pocock": "Pocock", "none": "none (p < 0.05 each round)"}[s]


def markdown(size: list[dict], equiv: list[dict], cost: list[dict], command: str, seconds: float) -> str:
    studies = size[0]["studies"] if size else 0
    out = [f"`{command}`: {studies:,} simulated studies per row, seeds 2 to 10 one a round, α = 0.05, 300 test "
           "sentences (0.58 points of sentence noise in a corpus score; the test set a sample, 200 resamples); "
           f"{seconds / 60:.1f} min. Variants: those compared with the baseline (a study has one row more). Spending "
           "`none` is the "
           "fixed-sample test after every round, stopping at the first star: what optional stopping does without "
           "a sequential correction.", "", "**Size under optional stopping** (no variant differs; no equivalence "
           "margin, so each comparison is looked at until max):", "",
           "| variants | seed SD | spending | size | worst | family-wise | trainings |",
           "|---:|---:|---|---:|---:|---:|---:|"]
    for r in size:
        c, x = r["case"], r["rounds"]
        out.append(f"| {c['variants']} | {sd(c)} | {spend_name(c['spending'])} | {pct(x['size'])} | "
                   f"{pct(x['worst'])} | {pct(x['familywise'])} | {r['trainings']:.1f} |")
    out += ["", "**Equivalence declared wrongly** (every variant differs by exactly ±ε: 2 by +ε, 2 by −ε; per "
            "comparison, and studies with any):", "",
            "| ε | seed SD | spending | equivalent, per comparison | any of 4 | trainings |",
            "|---:|---:|---|---:|---:|---:|"]
    for r in equiv:
        c, x = r["case"], r["rounds"]
        out.append(f"| {c['eps']:g} | {sd(c)} | {spend_name(c['spending'])} | {pct(x['equivalent_wrongly'])} | "
                   f"{pct(x['equivalent_wrongly_any'])} | {r['trainings']:.1f} |")
    out += ["", "**Seeds spent** (half the variants better by 3, half not at all) against the fixed design of 10 seeds "
            "for every row (Dunnett; its equivalence by TOST on its 90% intervals); power: the +3 variants starred; "
            "null ★: studies with a null variant starred; fixed n: the fewest seeds a fixed design needs for the "
            "rounds' power:", "",
            "| variants | seed SD | ε | spending | trainings | of fixed | rounds power | null ★ | nulls equivalent | "
            "fixed power | fixed null ★ | fixed nulls equivalent | fixed n |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in cost:
        c, x, f = r["case"], r["rounds"], r.get("fixed", {})
        eps = "" if c["eps"] is None else f"{c['eps']:g}"
        out.append(f"| {c['variants']} | {sd(c)} | {eps} | {spend_name(c['spending'])} | {r['trainings']:.1f} | "
                   f"{100 * r['trainings'] / r['fixed_trainings']:.0f}% of {r['fixed_trainings']} | "
                   f"{pct(x['power'])} | {pct(x['familywise'])} | {pct(x['null_equivalent']) if eps else ''} | "
                   f"{pct(f.get('power'))} | {pct(f.get('familywise'))} | "
                   f"{pct(f.get('null_equivalent')) if eps else ''} | {same_power(r)} |")
    return "\n".join(out)


def same_power(r: dict) -> str:
    """The fixed n of the rounds' power; '> max' when not even the fixed design of max seeds reaches it."""
    if "fixed_same_power_seeds" not in r:
        return ""
    n = r["fixed_same_power_seeds"]
    return str(n) if n is not None else f"> {r['case']['max_seeds']}"


def sd(c: dict) -> str:
    return f"{c['shared_sd']:g} + {c['seed_sd']:g}" if c["shared_sd"] else f"{c['seed_sd']:g}"


def seeds_power_table(studies: int, out: Path | None, command: str) -> str:
    """Run the docs' three tables and write the markdown and the raw numbers (JSON) beside it."""
    t0 = time.perf_counter()
    size = [run_case(c, studies) for c in size_cases()]
    equiv = [run_case(c, studies) for c in equivalence_cases()]
    cost = [run_case(c, studies, fixed_too=True) for c in cost_cases()]
    text = markdown(size, equiv, cost, command, time.perf_counter() - t0)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")
        raw = {"size": size, "equivalence": equiv, "cost": cost}
        out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=_num) + "\n", encoding="utf-8")
    return text


def _num(x):
    return None if isinstance(x, float) and math.isnan(x) else x
