"""Reading a study: tables, significance, main effects, transfer between studies, plots and scaling fits, computed
only from what its trials stored. The running half (ablate/: spec, runner, workers, final evaluation, SLURM) writes
a study; this package reads it through ablate.study and ablate.spec and never imports the runner.

    columns.py         what an ablation file says about its results: metric, columns, significance settings
    hypotheses.py      a trial's stored hypotheses and references
    report.py          the table (markdown, CSV, LaTeX)
    stats.py           sacreBLEU's paired bootstrap, Welch's t-test, Holm, rank correlations
    effects.py         main effects, interactions, transfer between studies (`ablate effects`, `ablate compare`)
    figures.py         curves.png, metric.png
    scaling.py         power-law fits of loss against compute; scaling_report.py: `ablate scaling`
"""
