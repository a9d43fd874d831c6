"""Ablation studies: variants x seeds of a recipe, run by workers, evaluated as their recipe says, compared in tables,
significance tests, main effects and plots.

    attnlab ablate run ablations/block_variants.yaml --workers 2     # runs what is missing
    attnlab ablate status ablations/block_variants.yaml              # done / running / failed / pending
    attnlab ablate evaluate ablations/block_variants.yaml            # final scores of finished trials lacking them
    attnlab ablate table ablations/block_variants.yaml               # markdown; also CSV and LaTeX
    attnlab ablate plot ablations/block_variants.yaml                # curves.png, metric.png
    attnlab ablate effects ablations/block_variants.yaml             # main effects, a two-way interaction
    attnlab ablate compare A.yaml B.yaml                             # shared variants, rank correlation
    attnlab ablate submit ablations/block_variants.yaml --launcher slurm --gpus-per-task 1 --workers 8
                                                                     # an array job of workers (submit.py)

A trial is the same `attnlab.train.fit` a user runs by hand, in its own run directory, then its final evaluation.
The modules: spec.py (the ablation file; its metric, columns and significance settings are parsed by
attnlab.analysis.columns; its seeds, or rounds of seeds until decided, by seeds.py), study.py (the study in its
optuna storage, the state of every point, a trial's stored values), runner.py (workers claiming and running points)
with params.py (a trial's optuna params), budget.py (equal-FLOPs budgets), final.py (the final evaluation),
submit.py (SLURM array jobs), commands.py (the `attnlab ablate` subcommands). Reading a finished study (tables,
significance, effects, plots, scaling fits) is attnlab.analysis, which never imports the runner.
"""
