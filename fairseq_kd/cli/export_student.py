"""Export a trained student as a plain fairseq ``transformer`` checkpoint.

    fairseq-kd-export checkpoints/student/checkpoint_best.pt student.pt

The output has no distillation-only parameters or options and loads in stock fairseq
(``fairseq-generate DATA --path student.pt``) without ``--user-dir``.
"""
import argparse
import json
import sys

from fairseq_kd.cli.user_errors import exits_on_user_error


@exits_on_user_error("fairseq-kd-export")
def cli_main(argv=None):
    parser = argparse.ArgumentParser(prog="fairseq-kd-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="student checkpoint written by fairseq-train --user-dir fairseq_kd")
    parser.add_argument("output", help="path of the exported checkpoint (.pt), or an existing folder (or a path ending in /) to write a file named like CHECKPOINT into")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    args = parser.parse_args(argv)

    import fairseq_kd

    fairseq_kd.register()
    from fairseq_kd.checkpoint_safety import UnsafeCheckpointError
    from fairseq_kd.models.export import ExportError, export_student

    try:
        summary = export_student(args.checkpoint, args.output, overwrite=args.overwrite)
    except (ExportError, UnsafeCheckpointError) as err:
        parser.error(str(err))
    json.dump(summary, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    cli_main()
