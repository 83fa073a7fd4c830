"""Deprecated: use ``fairseq-kd-plot alignment --checkpoint CKPT --output FIG.png --weights-output
aam.json``, which reads the same weights through the same code and draws them.

Kept as an alias (``--checkpoint CKPT --output aam.json [--overwrite]``, JSON only) while the
recipes, scripts/demo.sh and tests still call it; see :mod:`fairseq_kd.cli.plot`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from fairseq_kd.cli.plot import figure_weights_from_checkpoint, write_weights_json
from fairseq_kd.cli.user_errors import exits_on_user_error


def export_weights_main(figure: str, prog: str, argv: Optional[List[str]]) -> None:
    """The deprecated ``--checkpoint CKPT --output JSON`` exporters, for figure ``figure``."""
    replacement = f"fairseq-kd-plot {figure} --checkpoint CKPT --output FIGURE.png --weights-output WEIGHTS.json"
    parser = argparse.ArgumentParser(prog=prog, description=f"Deprecated: use {replacement}")
    parser.add_argument("--checkpoint", type=Path, required=True, help="a fairseq-train checkpoint")
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    args = parser.parse_args(argv)
    sys.stderr.write(f"{prog} is deprecated; use: {replacement}\n")
    if args.output.exists() and not args.overwrite:
        parser.error(f"--output {str(args.output)!r} exists; pass --overwrite to replace it")
    write_weights_json(figure_weights_from_checkpoint(figure, args.checkpoint), args.output)
    print(f"wrote {args.output}")


def export_alignment(checkpoint: Path) -> dict:
    """Deprecated: ``figure_weights_from_checkpoint("alignment", checkpoint)``."""
    return figure_weights_from_checkpoint("alignment", checkpoint)


@exits_on_user_error("python -m fairseq_kd.cli.export_alignment")
def cli_main(argv: Optional[List[str]] = None) -> None:
    export_weights_main("alignment", "python -m fairseq_kd.cli.export_alignment", argv)


if __name__ == "__main__":
    cli_main()
