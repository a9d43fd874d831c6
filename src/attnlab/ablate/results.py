"""What a finished trial reports to its study: the metric and its curve, the curves the tables and plots read,
size, steps, tokens, speed and the resolved config (ablate/runner.py records it as the trial's user attrs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..analysis.columns import kept_curve
from ..checkpoints import checkpoint_step, latest_checkpoint
from ..config import ModelConfig, load_yaml
from ..experiment import Experiment
from ..models.accounting import count_parameters
from ..rundir import run_metrics
from .budget import StepCost, step_cost


def collect(run_dir: Path, exp: Experiment, metric: str, cost: StepCost | None = None) -> dict[str, Any]:
    """What a finished run reports: the metric's last value and its curve (a logged metric), every val/ and test/
    curve and train/loss, params, steps, tokens trained, FLOPs per token, median tokens/s, the resolved config.
    `cost`: the trial's StepCost when it was already measured (trial_setup), else it is computed here."""
    curves = run_metrics(run_dir)
    csv_path = run_dir / "logs" / "metrics.csv"
    out: dict[str, Any] = {"metric_name": metric}
    if not metric.startswith("final/"):
        if not curves.get(metric):
            raise ValueError(f"{metric} was never logged in {csv_path} (columns: {sorted(curves)}); "
                             f"does trainer.val_every={exp.trainer.val_every} fit in the budget?")
        out["metric"] = curves[metric][-1][1]
        out["curve"] = {"step": [s for s, _ in curves[metric]], "value": [v for _, v in curves[metric]]}
    config = exp.to_dict()
    resolved = run_dir / "config.yaml"
    if resolved.exists():  # the vocabulary the tokenizer gave the run
        config = load_yaml(resolved)
    speeds = sorted(v for _, v in curves.get("train/tokens_per_s", []))
    ckpt = latest_checkpoint(run_dir)
    steps = checkpoint_step(ckpt) if ckpt is not None else None
    cost = step_cost(exp) if cost is None else cost
    return {
        **out,
        "n_params": count_parameters(ModelConfig.from_dict(config["model"]))["total"],
        "tokens_per_s": speeds[len(speeds) // 2] if speeds else None,  # median: robust to the first step
        "steps": steps if isinstance(steps, int) else None,
        "tokens": curves["train/tokens"][-1][1] if curves.get("train/tokens") else None,
        "flops_per_token": cost.flops_per_token,
        "curves": {k: [[s, v] for s, v in c] for k, c in curves.items() if kept_curve(k)},
        "config": config,
    }
