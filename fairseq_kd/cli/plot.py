"""Draw the project's figures as PNG files.

Subcommands::

    fairseq-kd-plot alignment --input aam_weights.json --output figs/a2d_alignment.png
    fairseq-kd-plot alp --input alp_weights.json --output figs/alp_weights.png
    fairseq-kd-plot curves --log checkpoints/word_kd/train.log --output figs/word_kd_curves.png

``alignment``: Align-to-Distill alignment weights, JSON ``{"encoder_self": {"weights": [[...]],
"student_layers": m, "student_heads": hs, "teacher_layers": n, "teacher_heads": ht}, ...}``
(rows = student maps). ``alp``: ALP-KD weights, JSON ``{"encoder": [[...]], "decoder": [[...]]}``
(one row of teacher-layer weights per student layer). ``curves``: every ``*loss`` statistic of a
fairseq-train log (``--log-format json`` or ``simple``) against the update number.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import List, Optional

from fairseq_kd.cli.user_errors import exits_on_user_error



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairseq-kd-plot",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_common(subparser: argparse.ArgumentParser) -> None:
        subparser.add_argument("--output", type=Path, required=True, help="PNG file to write")
        subparser.add_argument("--dpi", type=int, default=150, help="resolution of the PNG")
        subparser.add_argument(
            "--overwrite", action="store_true", help="replace an existing --output file"
        )

    alignment = commands.add_parser(
        "alignment", help="Align-to-Distill alignment weights, one heatmap per attention kind"
    )
    alignment.add_argument(
        "--input", type=Path, required=True, help="JSON with the weights per attention kind"
    )
    add_common(alignment)

    alp = commands.add_parser("alp", help="ALP-KD weights of student layers over teacher layers")
    alp.add_argument("--input", type=Path, required=True, help="JSON with the weights per side")
    add_common(alp)

    curves = commands.add_parser("curves", help="loss curves of a fairseq-train log")
    curves.add_argument("--log", type=Path, required=True, help="fairseq-train log file")
    curves.add_argument(
        "--keys",
        nargs="+",
        default=[],
        metavar="KEY",
        help="statistics to plot besides those ending in 'loss' (e.g. ppl lr gnorm)",
    )
    curves.add_argument(
        "--columns", type=int, default=3, help="panels per row of the figure"
    )
    add_common(curves)
    compare = commands.add_parser(
        "compare", help="one statistic of several runs on one axis (default: every run's validation nll)")
    compare.add_argument("--log", action="append", required=True, metavar="NAME=LOG",
                         help="a run's name and fairseq-train log; repeat per run")
    compare.add_argument("--key", default="nll_loss", help="the statistic (default: %(default)s)")
    compare.add_argument("--split", default="valid", help="the log lines it is read from (default: %(default)s)")
    add_common(compare)
    return parser


@exits_on_user_error("fairseq-kd-plot")
def cli_main(argv: Optional[List[str]] = None) -> None:
    # Importing fairseq (which fairseq_kd/__init__.py does) sets the root logger to DEBUG
    # (fairseq/models/wav2vec/wav2vec2_classification.py); matplotlib's font search would then
    # print hundreds of lines. Hence also the import of matplotlib only after this line.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    from fairseq_kd.scoring.plots import (
        load_json,
        plot_alignment_heatmaps,
        plot_alp_weights,
        plot_run_comparison,
        plot_training_curves,
        read_fairseq_log,
        save_figure,
    )

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output.suffix.lower() != ".png":
        parser.error(f"--output {str(args.output)!r}: the file name must end in .png")
    if args.output.exists() and not args.overwrite:
        parser.error(f"--output {str(args.output)!r} already exists; pass --overwrite to replace it")
    if args.dpi < 10:
        parser.error(f"--dpi {args.dpi}: too small to read (use e.g. 150)")
    try:
        if args.command == "alignment":
            figure = plot_alignment_heatmaps(load_json(args.input, "--input"))
        elif args.command == "alp":
            figure = plot_alp_weights(load_json(args.input, "--input"))
        elif args.command == "compare":
            runs = {}
            for value in args.log:
                name, separator, path = value.partition("=")
                if not separator or not name or not path:
                    raise ValueError(f"--log expects NAME=LOG, got {value!r}")
                if name in runs:
                    raise ValueError(f"--log: the name {name!r} is given twice")
                runs[name] = read_fairseq_log(Path(path))
            figure = plot_run_comparison(runs, args.key, args.split)
        else:
            if args.columns < 1:
                raise ValueError(f"--columns {args.columns}: must be at least 1")
            figure = plot_training_curves(read_fairseq_log(args.log), args.keys, args.columns)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    save_figure(figure, args.output, dpi=args.dpi)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    cli_main()
