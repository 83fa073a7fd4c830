"""Draw the project's figures as PNG files.

Subcommands::

    fairseq-kd-plot alignment --checkpoint checkpoints/a2d_kd/checkpoint_best.pt --output figs/a2d_alignment.png
    fairseq-kd-plot alp --checkpoint checkpoints/alp_kd/checkpoint_last.pt --output figs/alp_weights.png \\
        --weights-output figs/alp_weights.json
    fairseq-kd-plot alp --input figs/alp_weights.json --output figs/alp_weights.png
    fairseq-kd-plot curves --log checkpoints/word_kd/train.log --output figs/word_kd_curves.png
    fairseq-kd-plot compare --log no_kd=no_kd/train.log --log word_kd=word_kd/train.log --output figs/nll.png

``alignment`` (Align-to-Distill's alignment weights, Jin et al. 2024, Figure 2) and ``alp`` (ALP-KD's
layer weights, Passban et al. 2021) read a fairseq-train checkpoint of that criterion
(``--checkpoint``, loaded with ``weights_only=True``) or its JSON (``--input``, as
``--weights-output`` writes it); ``curves``: every ``*loss`` statistic of a fairseq-train log
against the update number; ``compare``: one statistic of several runs. Formats: ``docs/design/figures.md``.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import List, Optional

from fairseq_kd.cli.flags import add_overwrite_flag
from fairseq_kd.cli.user_errors import exits_on_user_error
from fairseq_kd.errors import FILE, OUTPUT_FILE, FileAccessError, InputError, message_of, path_problem, require_path

#: figures whose weights a training checkpoint holds, by sub-command
CHECKPOINT_FIGURES = ("alignment", "alp")


def figure_weights_from_checkpoint(figure: str, checkpoint: Path) -> dict:
    """The weights ``fairseq-kd-plot FIGURE`` draws (the JSON ``--input`` format; ``figure`` one of
    :data:`CHECKPOINT_FIGURES`), read from a fairseq-train checkpoint (torch and fairseq imported here only)."""
    checkpoint = require_path(checkpoint, "--checkpoint", FILE)
    import fairseq_kd

    fairseq_kd.register()  # the criterions and the allow-list of classes fairseq checkpoints hold
    if figure == "alp":
        from fairseq_kd.figures.alp_weights import layer_weights_from_checkpoint

        try:
            return layer_weights_from_checkpoint(checkpoint)
        except ValueError as error:  # its refusals of the checkpoint
            raise InputError(f"--checkpoint {error}") from None
    from fairseq_kd.checkpoints import load_fairseq_checkpoint
    from fairseq_kd.modules.attention_alignment import AlignmentShapeError, alignment_weights_from_state

    criterion_state = load_fairseq_checkpoint(checkpoint).get("criterion")
    if not criterion_state:
        raise InputError(
            f"--checkpoint {str(checkpoint)!r} has no criterion parameters; alignment weights exist only "
            "in checkpoints written by fairseq-train --criterion a2d_kd (with --a2d-lambda > 0), not "
            "in exported students or teachers")
    try:
        return alignment_weights_from_state(criterion_state)
    except AlignmentShapeError as error:
        raise InputError(f"--checkpoint {str(checkpoint)!r}: {error}") from None


FIGURE_NAMES = {"alignment": "Align-to-Distill alignment weights", "alp": "ALP-KD layer weights"}


def run_name(log: Path) -> str:
    """The run a fairseq-train log belongs to: its folder (the run's --save-dir), else its name."""
    log = Path(log)
    return log.parent.name or log.stem


def run_file(path: Path) -> str:
    """A file named by its run, ``RUN/NAME``, never by where it lies on this machine."""
    path = Path(path)
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def default_title(args) -> str:
    """What the figure shows: the checkpoint or weights file, the run, or the runs; no absolute path."""
    if args.command in CHECKPOINT_FIGURES:
        return f"{FIGURE_NAMES[args.command]}: {run_file(args.checkpoint if args.checkpoint is not None else args.input)}"
    if args.command == "curves":
        return f"Training curves of {run_name(args.log)}"
    names = [value.partition("=")[0] for value in args.log]
    return f"{args.split} {args.key}: {', '.join(names)}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairseq-kd-plot", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_common(subparser: argparse.ArgumentParser) -> None:
        subparser.add_argument("--output", type=Path, required=True, help="PNG file to write")
        subparser.add_argument("--dpi", type=int, default=150, help="resolution of the PNG")
        subparser.add_argument("--title", help="the figure's title (default: the run or runs it shows, a file as "
                               "RUN/NAME)")
        add_overwrite_flag(subparser, "existing output files (--output, --weights-output)")

    def add_weight_sources(subparser: argparse.ArgumentParser, criterion: str) -> None:
        source = subparser.add_mutually_exclusive_group(required=True)
        source.add_argument("--checkpoint", type=Path,
                            help=f"a fairseq-train checkpoint of a --criterion {criterion} run")
        source.add_argument("--input", type=Path, help="the weights as JSON (written by --weights-output)")
        subparser.add_argument("--weights-output", type=Path, metavar="JSON",
                               help="with --checkpoint: also write the weights read from it as JSON")
        add_common(subparser)

    add_weight_sources(commands.add_parser(
        "alignment", help="Align-to-Distill alignment weights, one heatmap per attention kind"), "a2d_kd")
    add_weight_sources(commands.add_parser(
        "alp", help="ALP-KD weights of student layers over teacher layers"), "alp_kd")

    curves = commands.add_parser("curves", help="loss curves of a fairseq-train log")
    curves.add_argument("--log", type=Path, required=True, help="fairseq-train log file")
    curves.add_argument("--keys", nargs="+", default=[], metavar="KEY",
                        help="statistics to plot besides those ending in 'loss' (e.g. ppl lr gnorm)")
    curves.add_argument("--columns", type=int, default=3, help="panels per row of the figure")
    add_common(curves)
    compare = commands.add_parser(
        "compare", help="one statistic of several runs on one axis (default: every run's validation nll)")
    compare.add_argument("--log", action="append", required=True, metavar="NAME=LOG",
                         help="a run's name and fairseq-train log; repeat per run")
    compare.add_argument("--key", default="nll_loss", help="the statistic (default: %(default)s)")
    compare.add_argument("--split", default="valid", help="the log lines it is read from (default: %(default)s)")
    add_common(compare)
    return parser


def check_output(parser: argparse.ArgumentParser, flag: str, path: Path, overwrite: bool) -> None:
    problem = path_problem(path, OUTPUT_FILE)
    if problem is not None:
        parser.error(f"{flag} {str(path)!r}: {problem}")
    if path.exists() and not overwrite:
        parser.error(f"{flag} {str(path)!r} already exists; pass --overwrite to replace it")


@exits_on_user_error("fairseq-kd-plot")
def cli_main(argv: Optional[List[str]] = None) -> None:
    # importing fairseq sets the root logger to DEBUG: matplotlib's font search (imported only
    # after this line) would print hundreds of lines
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    from fairseq_kd.scoring.files import load_json
    from fairseq_kd.figures.draw import (plot_alignment_heatmaps, plot_alp_weights, plot_run_comparison,
                                         plot_training_curves, save_figure)
    from fairseq_kd.figures.training_log import read_fairseq_log

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output.suffix.lower() != ".png":
        parser.error(f"--output {str(args.output)!r}: the file name must end in .png")
    check_output(parser, "--output", args.output, args.overwrite)
    if args.dpi < 10:
        parser.error(f"--dpi {args.dpi}: too small to read (use e.g. 150)")
    weights_output = getattr(args, "weights_output", None)
    if weights_output is not None:
        if args.checkpoint is None:
            parser.error("--weights-output writes the weights read from --checkpoint; with --input they are "
                         "already in that file")
        check_output(parser, "--weights-output", weights_output, args.overwrite)
    title = args.title if args.title is not None else default_title(args)
    try:
        if args.command in CHECKPOINT_FIGURES:
            if args.checkpoint is not None:
                weights = figure_weights_from_checkpoint(args.command, args.checkpoint)
            else:
                weights = load_json(args.input, "--input file")
            draw = plot_alignment_heatmaps if args.command == "alignment" else plot_alp_weights
            figure = draw(weights, title=title)  # checks the weights before anything is written
            if weights_output is not None:
                try:
                    weights_output.parent.mkdir(parents=True, exist_ok=True)
                    weights_output.write_text(json.dumps(weights, indent=1) + "\n", encoding="utf-8")
                except OSError as error:
                    raise FileAccessError(message_of(error)) from None
                print(f"wrote {weights_output}")
        elif args.command == "compare":
            runs = {}
            for value in args.log:
                name, separator, path = value.partition("=")
                if not separator or not name or not path:
                    raise InputError(f"--log expects NAME=LOG, got {value!r}")
                if name in runs:
                    raise InputError(f"--log: the name {name!r} is given twice")
                runs[name] = read_fairseq_log(Path(path))
            figure = plot_run_comparison(runs, args.key, args.split, title=title)
        else:
            if args.columns < 1:
                raise InputError(f"--columns {args.columns}: must be at least 1")
            figure = plot_training_curves(read_fairseq_log(args.log), args.keys, args.columns, title=title)
    except InputError as error:
        parser.error(str(error))
    try:
        save_figure(figure, args.output, dpi=args.dpi)
    except OSError as error:
        raise FileAccessError(message_of(error)) from None
    print(f"wrote {args.output}")


if __name__ == "__main__":
    cli_main()
