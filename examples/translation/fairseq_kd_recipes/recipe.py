"""Run a language pair's recipe: prepare the corpus, train the teacher and each student, decode the
test set, score, report and plot.

Design notes: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from fairseq_kd.progress import progress_to_stderr

from .cluster import DEFAULT_PORT, LAUNCHERS, SUBMIT_SCRIPT, shell_commands, write_sbatch
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
                        "(checks the pipeline on a small archive); auto (default): gpu when --gpus is given or "
                        "torch.cuda.device_count() > 0, else cpu")
    parser.add_argument("--gpus", "--gpus-per-node", dest="gpus", type=int, metavar="N",
                        help="GPUs per node of the gpu profile (default: every visible one). With --print-commands, "
                        "--dry-run or --sbatch, the GPUs of each node that will run the commands, which this machine "
                        "need not have; --update-freq keeps the pair's tokens per update on --nodes x N GPUs")
    parser.add_argument("--nodes", type=int, default=1, metavar="M",
                        help="nodes of the gpu profile (default: %(default)s). A recipe runs from one node: more than "
                        "one only with --print-commands, --dry-run or --sbatch (training through srun, or torchrun)")
    parser.add_argument("--launcher", choices=LAUNCHERS,
                        help="how training's workers start: fairseq (fairseq-train spawns one per GPU; one node, the "
                        "default there), srun (one SLURM task per node, fairseq spawns on each; the default on several "
                        "nodes) or torchrun (one process per GPU; on several nodes a line to run on each)")
    parser.add_argument("--master-port", type=int, default=DEFAULT_PORT, metavar="PORT",
                        help="port on the first node where the workers of several nodes meet (fairseq's "
                        "--distributed-port under srun, torchrun's --master-port; default: %(default)s); give each "
                        "job that shares a node its own")
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
    parser.add_argument("--student-seeds", type=seed_list, default=(), metavar="N,N,...",
                        help="train every student once more per seed besides --seed (the teacher and its passes "
                        "once, with --seed; --seed's students keep their names): "
                        "seed N's students are METHOD-seedN, their table report/results_seedN.md, and "
                        "report/seeds.md says what holds on every seed (who beats no KD, the order at the top)")
    parser.add_argument("--teacher", type=Path, metavar="CKPT|DIR",
                        help="distil from this already trained teacher instead of training one; it is scored like "
                        "a trained teacher. A fairseq checkpoint trained on the same binarised --data, or a Hugging "
                        "Face save_pretrained folder (MarianMT, M2M100, NLLB; needs pip install 'fairseq-kd[hf]'): "
                        "then the prepared text is binarised in its vocabulary (step hf-data), every student trains "
                        "on that, and every system is scored after its tokenizer has decoded it")
    parser.add_argument("--teacher-source-lang", metavar="CODE",
                        help="a multilingual Hugging Face --teacher's code of the source language (M2M100: de; "
                        "NLLB: deu_Latn; default: the pair's), for fairseq-kd-hf-data")
    parser.add_argument("--teacher-target-lang", metavar="CODE",
                        help="the same for the target language (M2M100: en; NLLB: eng_Latn)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the steps, whether each is done, and their command lines; run nothing")
    parser.add_argument("--print-commands", action="store_true",
                        help="print every step's command lines as shell commands for --nodes x --gpus-per-node GPUs "
                        "(no GPU needed here), the teacher passes also as a SLURM job array; run nothing")
    parser.add_argument("--sbatch", type=Path, metavar="DIR",
                        help="write the same commands as SLURM batch scripts into DIR (recipe.sbatch: the whole "
                        "recipe as one job on --nodes nodes; teacher-passes.sbatch: the teacher passes as a job array; "
                        "submit.sh: submits them in order) and print how to submit them; run nothing")
    parser.add_argument("--array-tasks", type=int, metavar="N",
                        help="with --print-commands or --sbatch: tasks (one GPU each) of the teacher passes' job "
                        "array (default: the world size, --nodes x --gpus-per-node)")
    return parser


def seed_list(text: str) -> tuple:
    try:
        return tuple(int(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seeds separated by commas (1,2,3), got {text!r}")


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
    if args.array_tasks is not None and args.array_tasks < 1:
        parser.error(f"--array-tasks must be >= 1, got {args.array_tasks}")
    if args.array_tasks is not None and not (args.print_commands or args.sbatch):
        parser.error("--array-tasks sizes the teacher passes' job array of --print-commands or --sbatch DIR; "
                     "give one of them")
    # every option but print_only is the flag of its name
    options = RecipeOptions(**{field.name: getattr(args, field.name) for field in dataclasses.fields(RecipeOptions)
                               if field.name != "print_only"},
                            print_only=args.dry_run or args.print_commands or args.sbatch is not None)
    # the recipe's own progress and that of the plugin's commands it runs in-process
    with contextlib.ExitStack() as logs:
        for logger_name in ("fairseq_kd_recipes", "fairseq_kd"):
            logs.enter_context(progress_to_stderr(logger_name))
        try:
            plan = build_plan(options)
            if args.dry_run:
                sys.stdout.write(describe_plan(plan))
            if args.print_commands:
                sys.stdout.write(shell_commands(plan, args.array_tasks))
            if args.sbatch is not None:
                written = write_sbatch(plan, args.sbatch, shlex.join([parser.prog, *(argv or sys.argv[1:])]),
                                       args.array_tasks)
                submit = next(path for path in written if path.name == SUBMIT_SCRIPT)
                print(f"wrote {', '.join(str(path) for path in written)}; submit with: bash {submit}")
            if options.print_only:
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
