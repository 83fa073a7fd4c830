"""The recipe's ``systems`` step as a command: each system's parameter count and decoding speed into
the sidecar that ``fairseq-kd-report --sidecar`` reads (:func:`.results.write_systems_sidecar`).

The recipe runs that step in its own process; this command is what a printed plan
(``fairseq-kd-recipe --print-commands``) and its SLURM batch scripts (``--sbatch``) run instead::

    python -m fairseq_kd_recipes.systems --data DATA --test-prefix test.de-en.en --output report/systems.json \\
        --system teacher models/teacher.pt generate/teacher/generate-test.txt logs/generate-teacher.log ...
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from .execute import RecipeError
from .results import SystemDecoding, write_systems_sidecar


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fairseq_kd_recipes.systems", description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", nargs=4, action="append", required=True,
                        metavar=("NAME", "MODEL", "GENERATE_OUTPUT", "LOG"),
                        help="a system: its name, exported model (or a Hugging Face teacher's folder), "
                        "fairseq-generate output and the log of that decoding (repeat per system, in the report's order)")
    parser.add_argument("--data", type=Path, required=True, metavar="DIR",
                        help="the binarised corpus the models were trained on (dictionaries, test split)")
    parser.add_argument("--test-prefix", required=True, metavar="PREFIX",
                        help="the binarised test split's target side within --data, e.g. test.de-en.en: every "
                        "system must have translated each of its sentences")
    parser.add_argument("--output", type=Path, required=True, metavar="FILE",
                        help="the sidecar to write (JSON; replaced if present)")
    return parser


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = [name for name, *_ in args.system]
    if len(set(names)) != len(names):
        parser.error(f"--system: a name is given twice in {', '.join(names)}")
    logging.getLogger("fairseq").setLevel(logging.WARNING)  # a line per dictionary and split loaded
    decodings = {name: SystemDecoding(Path(model), Path(output), Path(log)) for name, model, output, log in args.system}
    try:
        write_systems_sidecar(decodings, args.data, args.test_prefix, args.output)
    except RecipeError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
