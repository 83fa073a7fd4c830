"""Run a language pair's recipe: prepare the corpus, train the teacher and each student, decode the
test set, score, report and plot.

Examples::

    fairseq-kd-recipe iwslt14_de_en                                  # every method, profile auto
    fairseq-kd-recipe iwslt14_de_en --methods no_kd,word_kd,a2d_kd_4h --archives ~/corpora
    fairseq-kd-recipe wmt14_en_de --profile gpu --gpus 8 --methods no_kd,a2d_kd_8h
    fairseq-kd-recipe iwslt14_de_en --list-methods
    fairseq-kd-recipe iwslt14_de_en --dry-run                        # steps, their state, commands

(or ``python -m fairseq_kd_recipes.recipe``, or ``examples/translation/<pair>/run.sh``). Re-running the
same command skips every finished step; an interrupted training resumes from its last checkpoint.
Outputs, under ``--workdir``: ``report/results.{md,csv,json}`` (the table), ``plots/`` (training
curves, A2D alignment and ALP-KD weights), ``models/`` (every model as a stock fairseq checkpoint),
``generate/``, ``scores/``, ``train/<system>/`` (checkpoints, ``train.log``), ``logs/<step>.log``.
See ``examples/translation/fairseq_kd_recipes/plan.py`` for the steps and ``examples/translation/README.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from fairseq_kd.progress import progress_to_stderr

from .execute import RecipeError, describe_plan, run_plan
from .methods import TEACHER
from .pairs import PAIRS
from .plan import DEFAULT_PREPARE_WORKERS, RecipeOptions, build_plan
from .profiles import PROFILES


def _split_list(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairseq-kd-recipe", description=__doc__.split("\n\n")[0],
        epilog="Pairs: " + "; ".join(f"{name} ({pair.title})" for name, pair in PAIRS.items()),
    )
    parser.add_argument("pair", choices=list(PAIRS), metavar="PAIR",
                        help=f"language pair recipe: {', '.join(PAIRS)}")
    parser.add_argument("--methods", type=_split_list, metavar="NAME[,NAME...]",
                        help="students to train, by method name (see --list-methods); default: all of the pair's. "
                        f"The {TEACHER} is always trained")
    parser.add_argument("--list-methods", action="store_true",
                        help="print the pair's methods (student, criterion and flags, data) and exit")
    parser.add_argument("--profile", default="auto", choices=["auto", *PROFILES],
                        help="gpu: the papers' schedule, fp16, all visible GPUs through fairseq's distributed "
                        "training; cpu: the same models, 4,000 updates each; smoke: tiny models, a few updates "
                        "(checks the pipeline on a small archive); auto (default): gpu when "
                        "torch.cuda.device_count() > 0, else cpu")
    parser.add_argument("--gpus", type=int, metavar="N",
                        help="number of GPUs of the gpu profile (default: every visible one)")
    parser.add_argument("--archives", type=Path, metavar="DIR",
                        help="folder holding the corpus files under their release names (nothing is downloaded); "
                        "see examples/translation/README.md for the names")
    parser.add_argument("--data", type=Path, metavar="DIR",
                        help="an already binarised corpus (the --dest of the pair's prepare.py): skip preparation")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="working folder of this recipe (default: work_dirs/recipes/PAIR/PROFILE); "
                        "re-running with the same folder skips finished steps")
    parser.add_argument("--max-update", type=int, metavar="N",
                        help="train every model for N updates instead of the profile's schedule")
    parser.add_argument("--prepare-args", type=shlex.split, default=[], metavar="'FLAGS'",
                        help="extra flags for the pair's prepare.py, one quoted string "
                        "(e.g. --prepare-args='--bpe-merges 40000')")
    parser.add_argument("--train-args", type=shlex.split, default=[], metavar="'FLAGS'",
                        help="extra fairseq-train flags for every model, one quoted string "
                        "(e.g. --train-args='--keep-last-epochs 5')")
    parser.add_argument("--workers", type=int, default=DEFAULT_PREPARE_WORKERS, metavar="N",
                        help="worker processes of the preparation (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="seed of training and decoding (default: %(default)s)")
    parser.add_argument("--teacher", type=Path, metavar="CKPT",
                        help="distil from this already trained teacher checkpoint (trained on the same "
                        "binarised --data) instead of training one; it is scored like a trained teacher")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the steps, whether each is done, and their command lines; run nothing")
    return parser


def methods_table(pair_name: str) -> str:
    pair = PAIRS[pair_name]
    lines = [f"{pair.name}: {pair.title}", f"  {TEACHER:<13} {shlex.join(pair.teacher)}  (label-smoothed CE)"]
    for method in pair.methods():
        criterion = shlex.join(["--criterion", method.criterion, *pair.criterion_args(method)])
        data = "  (trains on the teacher's beam outputs)" if method.data == "seqkd" else ""
        lines.append(f"  {method.name:<13} {shlex.join(pair.students[method.student])}  {criterion}{data}")
        lines.append(f"  {'':<13} {method.description}")
    return "\n".join(lines) + "\n"


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_methods:
        sys.stdout.write(methods_table(args.pair))
        return 0
    options = RecipeOptions(
        pair=args.pair, methods=args.methods, profile=args.profile, workdir=args.workdir,
        archives=args.archives, data=args.data, gpus=args.gpus, max_update=args.max_update,
        prepare_args=args.prepare_args, train_args=args.train_args, workers=args.workers, seed=args.seed,
        teacher=args.teacher,
    )
    # the recipe's own progress and that of the plugin's commands it runs in-process
    with contextlib.ExitStack() as logs:
        for logger_name in ("fairseq_kd_recipes", "fairseq_kd"):
            logs.enter_context(progress_to_stderr(logger_name))
        try:
            plan = build_plan(options)
            if args.dry_run:
                sys.stdout.write(describe_plan(plan))
                return 0
            result = run_plan(plan)
        except RecipeError as error:
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
            return 2
    print(f"ran {len(result.executed)} step(s), {len(result.skipped)} already done; results in {plan.workdir}")
    for markdown in result.report_markdowns:
        sys.stdout.write(markdown.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
