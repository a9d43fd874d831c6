"""An ablation file's `seeds:`: a list, a count, or rounds of seeds until every comparison is decided.

    seeds: [1, 2, 3]                  # these seeds for every variant
    seeds: 3                          # the same: [1, 2, 3]
    seeds: {min: 2, max: 10}          # rounds (attnlab.analysis.sequential): every variant at 2 seeds, then one more
                                      # seed a round (step: N for more) only for the variants whose comparison with
                                      # the baseline is undecided, at most 10; the seeds are 1..max
    seeds: {min: 2, max: 10, list: [7, 11, 13, ...]}   # rounds over these seeds, in this order (max of them)

`attnlab ablate run --until-decided` runs a file that lists its seeds in rounds too (`until_decided`): its seeds
first, then the next integers up to `--max-seeds`. A study records its rounds (`Rounds.to_dict`, the study's
`rounds` user attr), so that a worker, `status` or `table` given the file without them runs and reads it as it
was run (`adopt`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError

DEFAULT_MIN, DEFAULT_MAX = 2, 10


@dataclass(frozen=True)
class Rounds:
    min: int
    max: int
    step: int = 1

    def to_dict(self, seeds: tuple[int, ...]) -> dict[str, Any]:
        return {"min": self.min, "max": self.max, "step": self.step, "seeds": list(seeds)}


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_seeds(raw: Any, src: str) -> tuple[tuple[int, ...], Rounds | None]:
    """The seeds of a file's `seeds:` and its rounds (None: a fixed list)."""
    if isinstance(raw, dict):
        bad = sorted(set(raw) - {"min", "max", "step", "list"})
        if bad or "max" not in raw:
            raise ConfigError(f"{src}: seeds: expected {{min: 2, max: 10}} (optional step: 1, list: [...]), got "
                              f"{raw!r}")
        lo, hi, step = raw.get("min", DEFAULT_MIN), raw["max"], raw.get("step", 1)
        if not (all(_int(x) for x in (lo, hi, step)) and 2 <= lo <= hi and step >= 1):
            raise ConfigError(f"{src}: seeds: min={lo!r}, max={hi!r}, step={step!r}: need integers with 2 <= min <= "
                              "max and step >= 1 (a round tests against the seeds' variance: 2 seeds at least)")
        listed = raw.get("list", list(range(1, hi + 1)))
        seeds = _checked(listed, src)
        if len(seeds) < hi:
            raise ConfigError(f"{src}: seeds.list has {len(seeds)} seeds for max {hi}")
        return seeds[:hi], Rounds(lo, hi, step)
    if _int(raw):
        if raw < 1:
            raise ConfigError(f"{src}: seeds={raw} must be >= 1 (a count) or a list")
        raw = list(range(1, raw + 1))
    return _checked(raw, src), None


def _checked(seeds: Any, src: str) -> tuple[int, ...]:
    if not (isinstance(seeds, list) and seeds and all(_int(s) for s in seeds) and len(set(seeds)) == len(seeds)):
        raise ConfigError(f"{src}: seeds must be a count, a list of distinct ints or {{min: 2, max: 10}}, got "
                          f"{seeds!r}")
    return tuple(seeds)


def until_decided(spec: Any, min_seeds: int | None = None, max_seeds: int | None = None,
                  step: int | None = None) -> Any:
    """The spec run in rounds (`ablate run --until-decided`): its own `seeds: {min, max}` when it has them (the
    options override them), else min 2 and max 10 over its listed seeds followed by the next integers."""
    have = spec.rounds
    lo = min_seeds if min_seeds is not None else have.min if have else DEFAULT_MIN
    hi = max_seeds if max_seeds is not None else have.max if have else max(DEFAULT_MAX, lo)
    step = step if step is not None else have.step if have else 1
    if spec.is_search:
        raise ConfigError(f"{spec.path}: --until-decided: a search has no baseline to decide against")
    if not (2 <= lo <= hi and step >= 1):
        raise ConfigError(f"--until-decided: --min-seeds {lo}, --max-seeds {hi}, --seed-step {step}: need 2 <= min "
                          "<= max and step >= 1")
    seeds = list(spec.seeds)
    extra = (s for s in range(1, 10 * hi + max(seeds) + 1) if s not in seeds)
    seeds = (seeds + [next(extra) for _ in range(max(0, hi - len(seeds)))])[:hi]
    return dataclasses.replace(spec, seeds=tuple(seeds), rounds=Rounds(lo, hi, step))


def adopt(spec: Any, recorded: dict[str, Any] | None) -> Any:
    """The spec as its study was run: a study recorded with rounds gives a file without them those rounds and seeds
    (a file that gives other rounds is an error)."""
    if not recorded:
        return spec
    rounds, seeds = Rounds(recorded["min"], recorded["max"], recorded["step"]), tuple(recorded["seeds"])
    if spec.rounds is not None and (spec.rounds != rounds or spec.seeds != seeds):
        raise ConfigError(f"{spec.path}: seeds: {spec.rounds.to_dict(spec.seeds)} differ from the rounds the study "
                          f"{spec.name} was run with ({recorded}); give the study its own directory (--dir) to run "
                          "other rounds")
    return dataclasses.replace(spec, seeds=seeds, rounds=rounds)
