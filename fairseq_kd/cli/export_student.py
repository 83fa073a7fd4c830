"""Export a trained model as a plain fairseq ``transformer`` checkpoint, a CTranslate2 model or a
Hugging Face model folder.

    fairseq-kd-export checkpoints/student/checkpoint_best.pt student.pt
    fairseq-kd-export checkpoints/student/checkpoint_best.pt student-int8 --format ctranslate2 --quantization int8
    fairseq-kd-export checkpoints/student/checkpoint_best.pt student-hf --format hf

The fairseq output loads in stock fairseq without ``--user-dir``; the others: ``docs/design/commands.md``.
"""
import argparse
import json
import sys

from fairseq_kd.cli.flags import add_overwrite_flag
from fairseq_kd.cli.user_errors import exits_on_user_error
from fairseq_kd.errors import FileAccessError, message_of

FORMATS = ("fairseq", "ctranslate2", "hf")


@exits_on_user_error("fairseq-kd-export")
def cli_main(argv=None):
    from fairseq_kd.deploy.export_ctranslate2 import DEFAULT_INT8_WEIGHT_BITS, INT8_WEIGHT_BITS, QUANTIZATIONS

    parser = argparse.ArgumentParser(prog="fairseq-kd-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint written by fairseq-train (a student, a teacher, an averaged "
                                           "or exported one)")
    parser.add_argument("output", help="fairseq: path of the exported checkpoint (.pt), or an existing folder (or a "
                                       "path ending in /) to write a file named like CHECKPOINT into; ctranslate2: "
                                       "the model folder to create; hf: the Hugging Face folder to create")
    parser.add_argument("--format", choices=FORMATS, default="fairseq",
                        help="fairseq: a plain transformer checkpoint; ctranslate2: a CTranslate2 model folder; "
                             "hf: a Hugging Face save_pretrained folder (MarianMT or M2M100) (default: %(default)s)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="CTranslate2 weight type (--format ctranslate2 only; default: int8)")
    parser.add_argument("--int8-weight-bits", type=int, choices=INT8_WEIGHT_BITS, default=None,
                        help="--quantization int8*: bits of each weight (one scale per output row). "
                             f"{DEFAULT_INT8_WEIGHT_BITS} (the default): exact integer products on every x86 CPU, "
                             "also those without VNNI, whose int8 kernels can overflow with 8-bit weights "
                             "(docs/design/deploy.md); 8: CTranslate2's own rounding, for CPUs with VNNI "
                             "and for GPUs")
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="--format ctranslate2 or hf: the binarised data folder holding the model's "
                             "dictionaries (default: the folder the checkpoint records)")
    parser.add_argument("--spm-model", default=None, metavar="FILE",
                        help="--format hf: the SentencePiece model the data was encoded with, for the tokenizer "
                             "(default: the one *.model file in the data folder; none: a whitespace tokenizer "
                             "of the dictionary, for pre-tokenised BPE text)")
    add_overwrite_flag(parser, "OUTPUT if it exists (ctranslate2, hf: only a folder that is wholly an unchanged "
                               "earlier export of that format; never a symbolic link)")
    args = parser.parse_args(argv)
    if args.format == "fairseq" and (args.quantization is not None or args.data is not None):
        parser.error("--quantization and --data apply to --format ctranslate2 and hf only")
    if args.format != "ctranslate2" and (args.quantization is not None or args.int8_weight_bits is not None):
        parser.error("--quantization and --int8-weight-bits apply to --format ctranslate2 only")
    if args.format != "hf" and args.spm_model is not None:
        parser.error("--spm-model applies to --format hf only")

    import fairseq_kd

    fairseq_kd.register()
    from fairseq_kd.checkpoints import UnsafeCheckpointError
    from fairseq_kd.deploy.export_fairseq import ExportError, export_student

    try:
        if args.format == "hf":
            from fairseq_kd.deploy.export_hf import export_hf

            summary = export_hf(args.checkpoint, args.output, data=args.data, spm_model=args.spm_model,
                                overwrite=args.overwrite)
            print(f"fairseq-kd-export: the tokenizer reads {summary['tokenizer']}", file=sys.stderr)
        elif args.format == "ctranslate2":
            from fairseq_kd.deploy.export_ctranslate2 import export_ctranslate2

            summary = export_ctranslate2(args.checkpoint, args.output, quantization=args.quantization or "int8",
                                         data=args.data, overwrite=args.overwrite,
                                         int8_weight_bits=args.int8_weight_bits)
        else:
            summary = export_student(args.checkpoint, args.output, overwrite=args.overwrite)
    except (ExportError, UnsafeCheckpointError) as err:
        parser.error(str(err))
    except FileAccessError:
        raise
    except OSError as err:  # CHECKPOINT, --data or OUTPUT cannot be read or written
        raise FileAccessError(message_of(err)) from None
    json.dump(summary, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    cli_main()
