"""The `attnlab` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ConfigError, ModelConfig, load_yaml


def load_model_config(path: str) -> ModelConfig:
    """A model config from a YAML file: a bare ModelConfig, or an experiment with a `model:` section."""
    data = load_yaml(Path(path))
    section = data.get("model", data) if isinstance(data.get("model"), dict) else data
    return ModelConfig.from_dict(section)


def cmd_info(args: argparse.Namespace) -> int:
    from .models.accounting import count_parameters, training_flops

    cfg = load_model_config(args.config)
    counts = count_parameters(cfg)
    total = counts.pop("total")
    print(f"{args.config}: arch={cfg.arch} d_model={cfg.d_model} heads={cfg.n_heads}/{cfg.kv_heads} "
          f"ffn={cfg.ffn}({cfg.ffn_dim}) norm={cfg.norm}/{cfg.norm_position} block={cfg.block} position={cfg.position}")
    width = max(len(k) for k in counts)
    for name, n in counts.items():
        if n:
            print(f"  {name:<{width}}  {n:>15,}  {100 * n / total:5.1f}%")
    print(f"  {'total':<{width}}  {total:>15,}  ({total / 1e6:.2f}M)")
    src_len = args.src_len if cfg.arch == "encoder_decoder" else None
    flops = training_flops(cfg, args.seq_len, src_len)
    what = f"target token (source {src_len}, target {args.seq_len})" if src_len else f"token (length {args.seq_len})"
    print(f"training FLOPs per {what}: {flops['per_token']:.4g}  (6N + attention; see attnlab.models.accounting)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnlab", description="Transformer research: train, evaluate, ablate.")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="parameter breakdown and training FLOPs of a config, without building it")
    info.add_argument("config", help="YAML: a model config, or an experiment with a model: section")
    info.add_argument("--seq-len", type=int, default=128, help="(target) sequence length for FLOPs")
    info.add_argument("--src-len", type=int, default=128, help="source length for encoder-decoder FLOPs")
    info.set_defaults(fn=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"attnlab: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
