"""Results table for several systems on one test set, as papers print it: BLEU with its 95%
bootstrap interval, difference to a baseline with sacreBLEU's paired bootstrap and approximate
randomisation p-values, parameter count and decoding speed.

Example::

    fairseq-kd-report --system teacher=scores/teacher.json --system no_kd=scores/no_kd.json \\
        --system word_kd=gen/word_kd.txt --detok-moses en --baseline no_kd --teacher teacher \\
        --params teacher=31500000 --speed teacher=41.2 --sidecar sizes.json --out-prefix results/iwslt14_3layer
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

from fairseq_kd.cli.score import (add_completeness_arguments, add_scoring_arguments, check_outputs_are_not_inputs,
                                  expected_sentence_count, scoring_settings, split_name_and_path)
from fairseq_kd.errors import FILE, OUTPUT_FILE, FileAccessError, InputError, UserError, message_of, require_path
from fairseq_kd.cli.flags import add_overwrite_flag
from fairseq_kd.cli.user_errors import exits_on_user_error
from fairseq_kd.scoring.report import (build_report, check_outputs_free, check_teacher, load_system, read_sidecar,
                                       report_markdown, report_paths, write_report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairseq-kd-report", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--system", action="append", required=True, metavar="NAME=FILE",
                        help="a system and its score record JSON or fairseq-generate output; repeat per system "
                             "(table rows keep this order)")
    parser.add_argument(
        "--baseline", metavar="NAME", default=None,
        help="system that every other one is compared with (difference and sacreBLEU's paired p-values)")
    parser.add_argument(
        "--teacher", metavar="NAME", default=None,
        help="with --baseline: add each other system's share of this system's BLEU lead over the baseline "
             "((BLEU - baseline's) / (teacher's - baseline's))")
    parser.add_argument("--params", action="append", default=[], metavar="NAME=N",
                        help="parameter count of a system (shipped model, without training-only modules); repeat")
    parser.add_argument("--speed", action="append", default=[], metavar="NAME=SENTS_PER_SEC",
                        help="decoding speed of a system in sentences per second; repeat")
    parser.add_argument("--sidecar", type=Path, metavar="FILE",
                        help='JSON {"NAME": {"params": N, "sents_per_sec": X}, ...}; --params/--speed flags '
                             "override its values")
    parser.add_argument("--title", metavar="TEXT", help="what the table measures, printed above it (e.g. which "
                        "BLEU a paper used)")
    parser.add_argument("--ref", type=Path, metavar="FILE",
                        help="score fairseq-generate outputs against this reference file (line i for sentence id i, "
                             "e.g. a preparation's untouched raw/test.LANG) instead of their T- lines")
    add_scoring_arguments(parser)
    add_completeness_arguments(parser)
    parser.add_argument("--out-prefix", type=Path, metavar="PATH", help="also write PATH.md, PATH.csv and PATH.json")
    add_overwrite_flag(parser, "existing --out-prefix files")
    return parser


def parse_named_numbers(values: List[str], flag: str, convert) -> Dict:
    parsed = {}
    for value in values:
        name, separator, number = value.partition("=")
        if not separator or not name:
            raise InputError(f"{flag} expects NAME=NUMBER, got {value!r}")
        try:
            parsed[name] = convert(number)
        except ValueError:
            raise InputError(f"{flag} {value!r}: {number!r} is not a number") from None
        if parsed[name] < 0:
            raise InputError(f"{flag} {value!r}: must not be negative")
    return parsed


def parameter_count(text: str) -> int:
    """An integer count; scientific notation (``3.15e7``) is accepted if it is whole."""
    number = float(text)
    if number != int(number):
        raise ValueError(text)
    return int(number)


@exits_on_user_error("fairseq-kd-report")
def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        named_paths = [split_name_and_path(value, "--system") for value in args.system]
        for name, path in named_paths:
            require_path(path, f"--system {name}", FILE)
        processing, settings = scoring_settings(args)
        if args.ref is not None:
            require_path(args.ref, "--ref", FILE)
        names = [name for name, _ in named_paths]
        # A sidecar may describe more systems than this table shows; only the shown ones count.
        extras = read_sidecar(args.sidecar) if args.sidecar is not None else {}
        extras = {name: values for name, values in extras.items() if name in names}
        params = {name: values["params"] for name, values in extras.items() if "params" in values}
        speeds = {name: values["sents_per_sec"] for name, values in extras.items() if "sents_per_sec" in values}
        params.update(parse_named_numbers(args.params, "--params", parameter_count))
        speeds.update(parse_named_numbers(args.speed, "--speed", float))
        if args.baseline is not None and args.baseline not in names:
            raise InputError(f"--baseline {args.baseline!r} is not one of the --system names {names}")
        check_teacher(args.teacher, args.baseline, names)
        expected = expected_sentence_count(args)
        if args.out_prefix is not None:
            inputs = [(f"--system {name}", path) for name, path in named_paths]
            inputs += [("--sidecar", args.sidecar), ("--expected-from", args.expected_from), ("--ref", args.ref)]
            outputs = report_paths(args.out_prefix).values()
            check_outputs_are_not_inputs([("--out-prefix", path) for path in outputs], inputs)
            for path in outputs:
                require_path(path, "--out-prefix", OUTPUT_FILE)
            check_outputs_free(outputs, args.overwrite, "--out-prefix")
        systems = [
            load_system(name, path, processing, settings, 0, args.seed, expected, args.allow_partial,
                        args.ref, args.ref_is_plain)
            for name, path in named_paths
        ]
        report = build_report(systems, args.baseline, params, speeds, args.bootstrap, args.seed, args.ar_trials,
                              args.teacher)
        report.title = args.title
    except (argparse.ArgumentTypeError, UserError) as error:
        parser.error(str(error))
    for name, info in report.partial.items():
        print(f"warning: {name} is a PARTIAL score: {info['n_sentences']} of {info['n_expected']} "
              "expected sentences", file=sys.stderr)
    print(report_markdown(report), end="")
    if args.out_prefix is not None:
        try:
            write_report(report, args.out_prefix, overwrite=args.overwrite)
        except OSError as error:  # the folder or files of --out-prefix
            raise FileAccessError(message_of(error)) from None


if __name__ == "__main__":
    cli_main()
