"""Ablation studies: variants x seeds of a recipe, run by workers, compared in tables and plots.

    attnlab ablate run ablations/block_variants.yaml --workers 2     # runs what is missing
    attnlab ablate status ablations/block_variants.yaml              # done / running / failed / pending
    attnlab ablate table ablations/block_variants.yaml               # markdown; also CSV and LaTeX
    attnlab ablate plot ablations/block_variants.yaml                # curves.png, metric.png
    attnlab ablate submit ablations/block_variants.yaml --launcher slurm --gpus-per-task 1 --workers 8
                                                                     # an array job of workers (submit.py)

A trial is the same `attnlab.train.fit` a user runs by hand, in its own run directory. The modules:
spec.py (the ablation file), study.py (the study in its optuna storage, the state of every point), runner.py
(workers claiming and running points), submit.py (SLURM array jobs), report.py (tables and plots),
commands.py (the `attnlab ablate` subcommands).
"""
