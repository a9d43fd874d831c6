"""What makes `attnlab`'s argparse follow LightningCLI's habits: one flag style with the other spelling accepted
(`Parser`), unknown options answered with the closest one (`check_options`), and `fit --help` listing every config
field with its type, default and description (`config_help`, from the comment on each field's line)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
import typing

from .config import CHOICES, ConfigError, field_docs, type_name
from .experiment import SECTIONS


class Parser(argparse.ArgumentParser):
    """argparse with one flag style. Options are registered with dashes (`--ckpt-path`, `--tasks-per-node`, as
    sbatch and POSIX tools spell them); every option is also accepted with underscores (`--ckpt_path`, the
    LightningCLI spelling and attnlab's before), for options added later too. `--section.key` overrides are
    config keys, not options: they keep their field names (`--trainer.max_steps`)."""

    def long_options(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        args = sys.argv[1:] if args is None else list(args)
        known = set(self.long_options())
        out: list[str] = []
        for i, arg in enumerate(args):
            if arg == "--":
                out += args[i:]
                break
            name, eq, value = arg.partition("=")
            dashed = "--" + name[2:].replace("_", "-")
            out.append(dashed + eq + value if name.startswith("--") and name not in known and dashed in known else arg)
        ns, rest = super().parse_known_args(out, namespace)
        if not hasattr(ns, "parser"):  # the innermost (sub)command's parser: it knows the options of the command
            ns.parser = self
        return ns, rest


def check_options(parser: Parser, rest: list[str]) -> None:
    """An unknown `--option` (not a dotted config key) is an error with the closest known option."""
    for arg in rest:
        name = arg.partition("=")[0]
        if name.startswith("--") and "." not in name:
            close = difflib.get_close_matches("--" + name[2:].replace("_", "-"), parser.long_options(), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unknown option {name}{hint}; config overrides look like --model.norm rmsnorm")


def config_help() -> str:
    """Every config field with its type, default and description (the comment on its line in the source)."""
    lines = ["config fields: -c FILE (several merge in order), then --section.key VALUE overrides any of these:"]
    for section, cls in SECTIONS.items():
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        lines.append(f"\n{section}: {(cls.__doc__ or '').strip().splitlines()[0]}")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            kind = type_name(hints[f.name])
            if section == "model" and f.name in CHOICES:
                kind = "{" + ",".join(CHOICES[f.name]) + "}"
            lines.append(f"  --{section}.{f.name} {kind} = {json.dumps(default)}\n      {docs.get(f.name, '')}")
    return "\n".join(lines)
