"""Command-line flags made from a dataclass of a command's settings, so that each setting's name,
default and help are written once, beside the code that uses it.

``add_config_flags(parser, SeqKDConfig)`` adds ``--field-name`` for every field: its help from
``field(metadata={"help": ...})`` (fairseq's convention; ``"metavar"`` too), its default from the
field (a field without one is a required flag), ``store_true`` for a ``bool`` that defaults to
False, and the type of ``Optional[T]`` fields as ``T``. Then ``Config(**vars(parser.parse_args()))``.

Not fairseq's ``gen_parser_from_dataclass``: it turns a field named ``data`` into a positional
argument (fairseq-train's ``DATA``), which would change these commands' ``--data`` flag, and it
needs a ``FairseqDataclass``, whose import loads fairseq even for fairseq-free commands.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing


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
