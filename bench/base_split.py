"""Build the data cache (tokenizer, token caches, the valid/test split) of an experiment, and print its folder.

    python bench/base_split.py -c experiments/wmt14_en_de_base.yaml --data.data_dir DIR [--section.key value ...]

`bench/gpu_run.sh`'s part 4 runs it when the peer is to be tested on attnlab's split and part 3 did not leave that
split in the same --out (a fresh machine): the split is the datamodule's own (`attnlab.train.prepare`), so it is the
one part 3's run trains and tests on, for the same config and overrides.
"""

from __future__ import annotations

import argparse

from attnlab.cli import parse_overrides
from attnlab.experiment import load_experiment
from attnlab.train import prepare


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config", required=True, action="append", help="recipe YAML (repeatable)")
    args, rest = p.parse_known_args(argv)
    dm, _ = prepare(load_experiment(args.config, parse_overrides(rest)))
    print(dm.cache_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
