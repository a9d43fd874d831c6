"""Reading a study: tables, significance, main effects, transfer between studies, plots and scaling fits, computed
only from what its trials stored. The running half (ablate/: spec, runner, workers, final evaluation, SLURM) writes
a study; this package reads it through ablate.study and ablate.spec and never imports the runner.

    columns.py         what an ablation file says about its results: metric, columns, significance settings
    rows.py            a study's rows (one per variant, its trials and values); hypotheses.py: stored texts
    inference.py       the one inference model: metric ~ variant + seed pooled over the study's rows, Welch's
                       fallback, contrasts and families (vectorised over studies)
    multiple.py        Dunnett (many-to-one), Tukey (all pairs), Holm, the minimum detectable difference
    testset.py         the test set as a sample: sacreBLEU statistics of resampled sentences, their covariance
    model.py           a study's rows in that model: what table, effects and compare all test with
    report.py          the table (markdown, CSV, LaTeX) and its footnote
    effects.py         main effects and interactions (`ablate effects`); transfer.py: `ablate compare`
    ranks.py           Kendall's tau and Spearman's rho with permutation p-values and seed-resampled intervals
    power.py           size and power of the table's test by simulation (`ablate power`)
    sequential.py      seeds until decided: rounds of seeds replayed with group-sequential boundaries (alpha
                       spending, repeated p-values and intervals, TOST); rounds.py: a study's rounds (claims, table,
                       status); seeds_power.py: their size, wrong equivalence and seeds spent (`ablate seeds-power`)
    stats.py           Welch's t-test (the former table's) and a mean's t interval
    figures.py         curves.png, metric.png
    scaling.py         power-law fits of loss against compute, many at once (Hoffmann et al.'s starts), seed draws
    scaling_stats.py   what `ablate scaling` concludes: per-size losses, fits, held-out check, crossings, intervals
    scaling_report.py  `ablate scaling`'s text, CSV, LaTeX (scaling_plot.py: its figure)
    scaling_coverage.py  synthetic studies through scaling_stats: how often its intervals hold
"""
