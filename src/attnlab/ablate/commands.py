"""The `attnlab ablate` subcommands (added to the attnlab CLI): run, worker, submit, move, status, evaluate, table,
plot, effects, scaling, compare, power, seeds-power, scaling-coverage."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path
from typing import Any

from ..analysis.effects import effects_report
from ..analysis.figures import plot
from ..analysis.power import power_table
from ..analysis.report import write_table
from ..analysis.rounds import describe, replayed, unneeded
from ..analysis.scaling_coverage import write_coverage
from ..analysis.scaling_report import collect, scaling_report, size_transfer
from ..analysis.scaling_stats import EMode
from ..analysis.seeds_power import seeds_power_table
from ..analysis.transfer import compare_studies
from ..config import ConfigError
from ..launch.job import DEFAULT_FIT, StepFit, install_worker_signals, resolve_fit, stop_status, worker_signals
from ..launch.slurm import add_slurm_args, slurm_status
from .budget import budget_warnings
from .devices import default_workers, trial_devices, visible_gpus
from .final import DEFAULT_EVALUATE, evaluate_study
from .runner import options_from, run_study, work
from .spec import load_spec
from .study import format_status, move_study, open_study, prepare_study
from .submit import load_run_spec, submit_study

log = logging.getLogger("attnlab.ablate")


def _worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="the ablation file, e.g. ablations/block_variants.yaml")
    p.add_argument("--dir", default=None, help="study directory (default: <base runs_dir>/ablations/<name>)")
    p.add_argument("--storage", default=None,
                   help="optuna storage URL (postgresql://..., sqlite:///...) or a journal file path "
                        "(default: the one the study directory records, else <study dir>/journal.log)")
    p.add_argument("--heartbeat", type=int, default=30, help="seconds between a running trial's heartbeats")
    p.add_argument("--grace", type=int, default=120,
                   help="seconds without a heartbeat after which a trial's worker is taken as dead")
    p.add_argument("--poll", type=float, default=10.0, help="seconds an idle worker waits before looking again")
    p.add_argument("--fit", default=DEFAULT_FIT, help="module:function that trains (tests use a fake)")
    p.add_argument("--evaluate", default=DEFAULT_EVALUATE,
                   help="module:function (exp, run_dir) -> final scores, run after each fit (tests use a fake)")


def add_ablate_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `ablate` subcommands to an argparse subparsers object (attnlab's CLI)."""
    ab = subparsers.add_parser("ablate", help="ablation studies: run, worker, submit, move, status, evaluate, table, "
                                              "plot, effects, scaling, compare, power, seeds-power, scaling-coverage")
    sub = ab.add_subparsers(dest="ablate_command", required=True)
    run = sub.add_parser("run", help="run the missing points of a study with N local workers")
    _worker_args(run)
    run.add_argument("--workers", type=int, default=None,
                     help="local worker processes (1: in this process; default: with GPUs, every GPU slice times "
                          "--workers-per-gpu, else 1)")
    run.add_argument("--gpus", default=None,
                     help="GPUs the workers share out, e.g. 0,1,2,3 (default: every visible GPU); each worker gets "
                          "its own resources.devices of them through CUDA_VISIBLE_DEVICES")
    run.add_argument("--workers-per-gpu", type=int, default=1,
                     help="workers sharing one GPU slice (default 1: two workers never share a GPU)")
    _rounds_args(run)
    worker = sub.add_parser("worker", help="one worker: claim points and run them until none is left")
    _worker_args(worker)
    worker.add_argument("--max-trials", type=int, default=None, help="stop after this many trials")
    worker.add_argument("--max-round", type=int, default=None,
                        help="a study in rounds: claim no point of a later round (each SLURM array is one round)")
    worker.add_argument("--srun", action="store_true",
                        help="inside a SLURM job: run each trial as an srun step, one task per device")
    worker.add_argument("--no-linger", action="store_true",
                        help="exit when no point is pending, instead of waiting for other workers' points")
    submit = sub.add_parser("submit", help="submit the study's workers as a SLURM array job")
    _worker_args(submit)
    submit.add_argument("--launcher", choices=("slurm",), default="slurm")
    submit.add_argument("--workers", type=int, default=None,
                        help="array tasks, one worker each (default: one per point still to run)")
    submit.add_argument("--array-parallelism", type=int, default=None, help="at most this many run at once")
    add_slurm_args(submit, "study")
    _rounds_args(submit)
    submit.add_argument("--wait", action="store_true",
                        help="a study in rounds: wait here for each round's array job, then submit the next round")
    submit.add_argument("--no-chain", action="store_true",
                        help="a study in rounds: submit this round only (default: with a job that submits the next "
                             "round when this round's array ends)")
    submit.add_argument("--after", default=None, help=argparse.SUPPRESS)  # the chained job: the array just ended
    move = sub.add_parser("move", help="copy a study into another storage and record it there")
    move.add_argument("study", help="the ablation file, or its study directory")
    move.add_argument("--dir", default=None, help="study directory when it is not the default")
    move.add_argument("--to", required=True, help="the new storage: a journal file path or an optuna storage URL")
    for name, text in (("status", "which points are done, running, failed, invalid, pending"),
                       ("evaluate", "the final evaluation of every finished trial that has none, without retraining"),
                       ("table", "markdown table (and table.csv, table.tex) from the stored trials"),
                       ("plot", "curves.png and metric.png from the stored trials"),
                       ("effects", "main effects of each factor and a two-way interaction (effects.csv, .png)"),
                       ("scaling", "fit each variant's validation loss against compute over the scale: ladder "
                                   "(scaling.md, .csv, .tex, .png)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("study", help="the ablation file, or its study directory")
        p.add_argument("--dir", default=None, help="study directory when it is not the default")
        p.add_argument("--storage", default=None, help="storage URL or journal file, when not the one recorded")
        if name == "status":
            p.add_argument("--grace", type=int, default=120, help="seconds without heartbeat shown as stale")
        elif name == "evaluate":
            p.add_argument("--force", action="store_true", help="evaluate the trials already evaluated again")
            p.add_argument("--evaluate", default=DEFAULT_EVALUATE, help="module:function (exp, run_dir) -> scores")
        else:
            p.add_argument("--out", default=None, help="output directory (default: the study directory)")
        if name == "scaling":
            p.add_argument("--resamples", type=int, default=200,
                           help="random draws of the seeds when there are more than 6 (up to 6: every multiset)")
            p.add_argument("--e", choices=("free", "shared"), default="free",
                           help="the irreducible loss E: fitted per variant (default) or one E shared by all")
            p.add_argument("--e-prior", default=None, metavar="MEAN[:SD]",
                           help="E held near MEAN (a Gaussian prior of sd SD; without SD, or SD 0, fixed at MEAN); "
                                "every figure that depends on it is labelled")
        if name == "effects":
            p.add_argument("--pair", nargs=2, default=None, metavar=("A", "B"),
                           help="the two factors of the interaction (default: the first two)")
    power = sub.add_parser("power", help="simulate null and effect studies through the table's test: its size and "
                                         "power (the table of docs/ablations.md)")
    power.add_argument("--studies", type=int, default=10_000, help="simulated studies per setting")
    power.add_argument("--out", default="docs/significance_power.md",
                       help="the markdown table (and the raw numbers as .json beside it)")
    seeds_power = sub.add_parser("seeds-power", help="simulate studies run in rounds of seeds until decided: "
                                                     "size, wrong equivalence and seeds spent (docs/seeds.md)")
    seeds_power.add_argument("--studies", type=int, default=2000, help="simulated studies per setting")
    seeds_power.add_argument("--out", default="docs/results/seeds_power.md",
                             help="the markdown tables (and the raw numbers as .json beside it)")
    compare = sub.add_parser("compare", help="the variants two studies share, side by side, and the rank "
                                             "correlation of their scores (Kendall's tau, Spearman's rho)")
    compare.add_argument("study_a", help="an ablation file or study directory")
    compare.add_argument("study_b", nargs="?", default=None,
                         help="another one; without it, a study with a scale: ladder compares its smallest and "
                              "largest sizes")
    compare.add_argument("--dirs", nargs="+", default=None, metavar="DIR",
                         help="their study directories when they are not the default (one per study)")
    coverage = sub.add_parser("scaling-coverage", help="synthetic studies with known laws through ablate scaling's "
                                                       "statistics: how often each interval holds (docs/scaling.md)")
    for flag, default, text in (("--studies", 400, "simulated studies per regime and truth"),
                                ("--out", "docs/scaling_coverage.json", "the raw numbers (JSON)")):
        coverage.add_argument(flag, type=type(default), default=default, help=text)
    return ab


def _rounds_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--until-decided", action="store_true",
                   help="run in rounds of seeds: every variant at --min-seeds, then a seed a round only for the "
                        "variants whose comparison with the baseline is undecided (the file's seeds: {min, max} "
                        "does this without the option)")
    p.add_argument("--min-seeds", type=int, default=None, help="with --until-decided: the first round's seeds "
                                                                  "(default: the file's min, else 2)")
    p.add_argument("--max-seeds", type=int, default=None, help="with --until-decided: at most this many seeds "
                                                                  "(default: the file's max, else 10)")
    p.add_argument("--seed-step", type=int, default=None, help="with --until-decided: seeds added a round (1)")


def stopped(e: BaseException, who: str) -> int:
    """The exit status of `ablate run` or a worker stopped by SIGINT (130) or SIGTERM (143); any other exit
    goes on."""
    code = stop_status(e)
    if code is None:
        raise e
    log.warning("%s stopped by %s: its trials are recorded as interrupted; the next `ablate run` resumes them", who,
                signal.Signals(code - 128).name)
    return code


def cmd_ablate(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> int:
    if overrides:
        raise ConfigError(f"attnlab ablate takes no --section.key overrides (put them in the file): {list(overrides)}")
    sub = args.ablate_command
    if sub == "run":
        if args.workers is not None and args.workers < 1:
            raise ConfigError(f"--workers {args.workers} must be >= 1")
        spec = load_run_spec(args)
        for warning in budget_warnings(spec):
            log.warning(warning)
        gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus is not None else None
        workers = args.workers
        if workers is None:  # pack every GPU: --workers-per-gpu alone must not leave one worker on one GPU
            listed = visible_gpus() if gpus is None else gpus
            workers = default_workers(listed, trial_devices(spec) if listed else 0, args.workers_per_gpu)
            log.info("%d local worker(s) (--workers to choose)", workers)
        with worker_signals():  # SIGINT, SIGTERM: trials recorded as interrupted (passed on to the workers)
            try:
                counts = run_study(spec, Path(args.dir) if args.dir else None, args.storage, workers,
                                   options_from(args), gpus=gpus, workers_per_gpu=args.workers_per_gpu)
            except (KeyboardInterrupt, SystemExit) as e:
                return stopped(e, "ablate run")
        print(f"{spec.name}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        print(f"see `attnlab ablate status {args.spec}` and `attnlab ablate table {args.spec}`")
        return 0 if set(counts) <= {"done", "invalid", "not needed"} else 1
    if sub == "submit":
        return submit_study(args)
    if sub == "worker":
        install_worker_signals()  # SIGTERM: the trial is recorded as interrupted; USR1: to the trial
        spec = load_spec(args.spec)
        h = prepare_study(spec, Path(args.dir) if args.dir else None, args.storage)
        try:
            n = work(h, options_from(args), StepFit(args.fit, srun=True) if args.srun else None)
        except (KeyboardInterrupt, SystemExit) as e:
            return stopped(e, "worker")
        logging.getLogger("attnlab.ablate").info("worker done: %d trial(s)", n)
        return 0
    if sub == "move":
        h = move_study(open_study(args.study, None, args.dir), args.to)
        print(f"{h.spec.name}: {len(h.study.get_trials(deepcopy=False))} trial(s) copied to {h.url}, now recorded "
              f"in {h.dir / 'study.yaml'}")
        return 0
    if sub == "seeds-power":
        command = f"attnlab ablate seeds-power --studies {args.studies}"
        print(seeds_power_table(args.studies, Path(args.out), command))
        print(f"\nwritten: {args.out}, {Path(args.out).with_suffix('.json')}")
        return 0
    if sub == "scaling-coverage":  # the table, then what it wrote
        print(write_coverage(args.studies, Path(args.out), f"attnlab ablate scaling-coverage --studies {args.studies}"))
        return 0
    if sub == "power":
        command = f"attnlab ablate power --studies {args.studies}"
        print(power_table(args.studies, Path(args.out), command))
        print(f"\nwritten: {args.out}, {Path(args.out).with_suffix('.json')}")
        return 0
    if sub == "compare":
        dirs = list(args.dirs or []) + [None, None]
        if len(args.dirs or []) > 1 + (args.study_b is not None):
            raise ConfigError(f"--dirs: one directory per study, got {len(args.dirs)}")
        if args.study_b is None:
            h = open_study(args.study_a, None, dirs[0])
            if not h.spec.sizes:
                raise ConfigError(f"ablate compare {args.study_a}: one study is compared across its sizes, which "
                                  f"needs a scale: ladder ({h.spec.name} has none); give a second study to compare "
                                  "it with: ablate compare A B")
            print(size_transfer(h, collect(h)))
            return 0
        print(compare_studies(open_study(args.study_a, None, dirs[0]), open_study(args.study_b, None, dirs[1])))
        return 0
    h = open_study(args.study, args.storage, args.dir)
    if sub == "evaluate":
        for line in evaluate_study(h, resolve_fit(args.evaluate), args.force):
            print(line)
        print(f"see `attnlab ablate table {args.study}`")
        return 0
    if sub == "status":
        print(format_status(h, args.grace, unneeded(h, args.grace)))
        rounds = replayed(h)
        if rounds is not None:
            print("\n" + "\n".join(describe(rounds)))
        jobs = h.dir / "slurm" / "jobs.jsonl"
        if jobs.exists():
            print("\n" + slurm_status(jobs))
        return 0
    out = Path(args.out) if args.out else None
    if sub == "table":
        md, paths = write_table(h, out)
        print(md)
        print(f"\nwritten: {', '.join(str(p) for p in paths)}")
        return 0
    if sub == "plot":
        paths = plot(h, out)
        print(f"written: {', '.join(str(p) for p in paths)}")
        return 0
    if sub == "scaling":
        text, paths = scaling_report(h, out, args.resamples, e_mode(args))
        print(text)
        print(f"\nwritten: {', '.join(str(p) for p in paths)}")
        return 0
    if sub == "effects":
        text, paths = effects_report(h, tuple(args.pair) if args.pair else None, out)
        print(text)
        print(f"\nwritten: {', '.join(str(p) for p in paths)}")
        return 0
    raise ConfigError(f"unknown ablate command {sub!r}")


def e_mode(args: argparse.Namespace) -> EMode:
    """`ablate scaling`'s --e and --e-prior as the fit's EMode (scaling_stats.py)."""
    if args.e_prior is None:
        return EMode(args.e)
    if args.e != "free":
        raise ConfigError("ablate scaling: give --e shared or --e-prior, not both")
    mean, _, sd = args.e_prior.partition(":")
    try:
        mode = EMode("prior", float(mean), float(sd or 0))
    except ValueError:
        raise ConfigError(f"--e-prior {args.e_prior!r}: expected MEAN or MEAN:SD, e.g. 1.5:0.2") from None
    if mode.mean <= 0 or mode.sd < 0:
        raise ConfigError(f"--e-prior {args.e_prior!r}: the mean must be > 0 and the sd >= 0")
    return mode
