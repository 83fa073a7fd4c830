"""Command-line flags: :func:`add_config_flags` turns a config dataclass into argparse flags
(``--field-name`` per field, help and metavar from ``field(metadata=...)``); :func:`cli_main` lists
the plugin's fairseq-train flags, which ``fairseq-train --help`` cannot
(``python -m fairseq_kd.cli.flags --criterion a2d_kd``). ``docs/design/commands.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import List, Optional

from fairseq_kd.cli.user_errors import exits_on_user_error


def add_config_flags(parser: argparse.ArgumentParser, config_class) -> None:
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        kind = hints[field.name]
        if typing.get_origin(kind) is typing.Union:  # Optional[T]
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        flag = "--" + field.name.replace("_", "-")
        options = {"help": field.metadata.get("help")}
        if field.default is dataclasses.MISSING:
            options["required"] = True
        else:
            options["default"] = field.default
            if options["help"] is not None and field.default is not None and kind is not bool:
                options["help"] += " (default: %(default)s)"
        if kind is bool:
            if field.default is not False:
                raise TypeError(f"{config_class.__name__}.{field.name}: a bool flag must default to False")
            options["action"] = "store_true"
        else:
            options["type"] = kind
            if "metavar" in field.metadata:
                options["metavar"] = field.metadata["metavar"]
        parser.add_argument(flag, **options)


def add_overwrite_flag(parser: argparse.ArgumentParser, replaces: str) -> None:
    """``--overwrite``, the permission to replace ``replaces`` (as its help says)."""
    parser.add_argument("--overwrite", action="store_true", help=f"replace {replaces}")


@exits_on_user_error("python -m fairseq_kd.cli.flags")
def cli_main(argv: Optional[List[str]] = None) -> None:
    import fairseq_kd

    fairseq_kd.register()
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.tasks import TASK_REGISTRY

    from fairseq_kd.criterions.base import KDCriterionBase

    names = sorted(n for n, c in CRITERION_REGISTRY.items() if isinstance(c, type) and issubclass(c, KDCriterionBase))
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_kd.cli.flags",
        description="List the flags of the ``translation_kd`` task and of a distillation criterion, with their help.")
    parser.add_argument("--criterion", choices=names, help="the criterion whose flags to list (default: "
                        "only the task's flags)")
    args = parser.parse_args(argv)
    shown = argparse.ArgumentParser(
        prog=f"fairseq-train DATA --user-dir fairseq_kd --task translation_kd"
             + (f" --criterion {args.criterion}" if args.criterion else ""),
        add_help=False, usage=argparse.SUPPRESS, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    TASK_REGISTRY["translation_kd"].add_args(shown)
    if args.criterion:
        CRITERION_REGISTRY[args.criterion].add_args(shown)
    shown.print_help()


if __name__ == "__main__":
    cli_main()
