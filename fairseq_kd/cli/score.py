"""Score one system with sacreBLEU: corpus BLEU, its 95% bootstrap interval, and optionally
sacreBLEU's paired tests (bootstrap and approximate randomisation) against a baseline.

Examples::

    fairseq-kd-score --generate-output gen.txt --detok-moses en --system word_kd \\
        --baseline no_kd=scores/no_kd.json --output-json scores/word_kd.json --output-md scores/table.md
    fairseq-kd-score --hyp hyp.bpe.txt --ref test.bpe.en --remove-bpe subword_nmt
    fairseq-kd-score --generate-output gen.txt --detok-hf opus-mt-de-en/ --ref raw/test.en --ref-is-plain
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import List, Optional, Tuple

from sacrebleu.metrics.bleu import BLEU

from fairseq_kd.scoring.bleu import (DEFAULT_N_BOOTSTRAP, DEFAULT_N_TRIALS, DEFAULT_SEED, BleuSettings, check_n_bootstrap,
                                     check_n_trials)
from fairseq_kd.scoring.detok import BPE_SCHEMES, read_lines
from fairseq_kd.errors import FILE, OUTPUT_FILE, FileAccessError, InputError, UserError, message_of, require_path
from fairseq_kd.cli.flags import add_overwrite_flag
from fairseq_kd.cli.user_errors import exits_on_user_error
from fairseq_kd.scoring.report import (TextProcessing, append_score_row, check_outputs_free, check_score_table,
                                       compare_with_baseline, format_mean_ci, format_p_value, load_system,
                                       score_generate_output, score_record, score_text_files, write_json)


def add_scoring_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared with fairseq-kd-report: how text is detokenised and how BLEU is computed."""
    group = parser.add_argument_group("detokenisation and BLEU")
    group.add_argument("--remove-bpe", choices=BPE_SCHEMES, default="none",
                       help="undo subword segmentation before scoring: subword_nmt joins '@@ ' pieces, "
                            "sentencepiece joins pieces at '\u2581'; 'none' if fairseq-generate already ran with "
                            "--remove-bpe/--post-process (default: none)")
    group.add_argument("--detok-moses", metavar="LANG", default=None,
                       help="Moses-detokenise for target language LANG (sacremoses) after removing BPE; only for "
                            "recipes that Moses-tokenised the text (IWSLT'14), never for SentencePiece recipes")
    group.add_argument(
        "--detok-hf", metavar="DIR", default=None,
        help="the output's data was binarised in the vocabulary of the Hugging Face model in DIR "
             "(fairseq-kd-hf-data --teacher DIR): its tokenizer turns the tokens into text (target side; "
             "language tags and </s> dropped), instead of --remove-bpe and --detok-moses. Needs pip install "
             "'fairseq-kd[hf]'")
    group.add_argument("--ref-is-plain", action="store_true",
                       help="the --ref file is already plain detokenised text: apply --remove-bpe and "
                            "--detok-moses to the hypotheses only")
    group.add_argument("--tokenize", choices=sorted(BLEU.TOKENIZERS), default=BLEU.TOKENIZER_DEFAULT,
                       help="sacreBLEU tokenizer: 13a (default) for European languages, zh for Chinese")
    group.add_argument("--lowercase", action="store_true",
                       help="case-insensitive BLEU (sacreBLEU -lc); for corpora lowercased in preparation it "
                            "changes nothing")
    group.add_argument("--bootstrap", type=int, default=DEFAULT_N_BOOTSTRAP, metavar="N",
                       help=f"bootstrap resamples for the 95%% interval and the paired bootstrap test (sacrebleu "
                            f"--confidence-n/--paired-bs-n), 0 to switch off (default: {DEFAULT_N_BOOTSTRAP})")
    group.add_argument("--ar-trials", type=int, default=DEFAULT_N_TRIALS, metavar="N",
                       help=f"shuffles of the paired approximate randomisation test (sacrebleu --paired-ar-n), 0 to "
                            f"skip it (default: {DEFAULT_N_TRIALS})")
    group.add_argument(
        "--seed", type=int, default=DEFAULT_SEED,
        help=f"sacreBLEU's SACREBLEU_SEED for the resampling; the default {DEFAULT_SEED} is sacreBLEU's, "
             "so every number matches the sacrebleu command run on the same text, but for p where a resample "
             "reaches the observed difference exactly (counted here; docs/design/scoring.md)")


def scoring_settings(args: argparse.Namespace) -> Tuple[TextProcessing, BleuSettings]:
    """The flags of :func:`add_scoring_arguments`, checked: how text is processed, how BLEU is computed."""
    if args.ref_is_plain and args.ref is None:
        raise InputError("--ref-is-plain applies to --ref only; fairseq-generate T- lines are "
                         "processed like the hypotheses")
    if args.detok_hf is not None and (args.remove_bpe != "none" or args.detok_moses):
        raise InputError("--detok-hf turns the model's tokens into text itself: drop --remove-bpe and --detok-moses")
    check_n_bootstrap(args.bootstrap)
    check_n_trials(args.ar_trials)
    return (TextProcessing(remove_bpe=args.remove_bpe, moses_lang=args.detok_moses, hf_folder=args.detok_hf),
            BleuSettings(tokenize=args.tokenize, lowercase=args.lowercase))


def add_completeness_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared with fairseq-kd-report: how many sentences a complete output has."""
    group = parser.add_argument_group(
        "completeness (a fairseq-generate output must end with its 'Generate ... with beam=' "
        "summary line and hold every sentence id 0..N-1 exactly once)")
    expected = group.add_mutually_exclusive_group()
    expected.add_argument("--expected-from", type=Path, metavar="FILE",
                          help="the test set's source or reference text file: N is its line count (without it, N is "
                               "the largest sentence id plus one, which cannot see sentences missing at the end)")
    expected.add_argument("--expected-sentences", type=int, metavar="N", help="the test set has N sentences")
    group.add_argument("--allow-partial", action="store_true",
                       help="score an incomplete output anyway; the score record and the report then say it is "
                            "partial, with the number of sentences scored and expected")


def expected_sentence_count(args: argparse.Namespace) -> Optional[int]:
    """N from --expected-sentences or --expected-from (validated), else None."""
    if args.expected_sentences is not None:
        if args.expected_sentences < 1:
            raise InputError(f"--expected-sentences must be a positive count, got {args.expected_sentences}")
        return args.expected_sentences
    if args.expected_from is not None:
        count = len(read_lines(args.expected_from, "--expected-from"))
        if count == 0:
            raise InputError(f"--expected-from file {str(args.expected_from)!r} is empty")
        return count
    return None


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (symlinks and relative paths resolved)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def check_outputs_are_not_inputs(outputs, inputs) -> None:
    """Refuse an output path that is one of the inputs: it would be overwritten before (or
    instead of) being read."""
    for out_flag, out_path in outputs:
        for in_flag, in_path in inputs:
            if out_path is not None and in_path is not None and same_file(out_path, in_path):
                raise InputError(
                    f"{out_flag} {str(out_path)!r} is the {in_flag} input file; writing it would destroy "
                    "the input. Choose another output path.")


def split_name_and_path(value: str, flag: str) -> tuple:
    name, separator, path = value.partition("=")
    if not separator or not name or not path:
        raise argparse.ArgumentTypeError(f"{flag} expects NAME=FILE, got {value!r}")
    return name, Path(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairseq-kd-score", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = parser.add_argument_group(
        "input (--generate-output, with the references of its T- lines or of --ref; or --hyp with --ref)")
    source.add_argument("--generate-output", type=Path, metavar="FILE",
                        help="fairseq-generate output (H-/D-/T- lines); hypotheses from D- lines when present")
    source.add_argument("--hyp", type=Path, metavar="FILE", help="hypotheses, one per line")
    source.add_argument(
        "--ref", type=Path, metavar="FILE",
        help="references, one line per test sentence: line-parallel to --hyp, or, with "
             "--generate-output, line i for sentence id i (e.g. the untouched raw/test.LANG a preparation "
             "keeps), used instead of the T- lines")
    add_scoring_arguments(parser)
    add_completeness_arguments(parser)
    parser.add_argument("--system", default=None,
                        help="system name for the outputs (default: the input file name without extension)")
    parser.add_argument("--baseline", metavar="NAME=FILE", default=None,
                        help="baseline for a paired bootstrap test: a score record JSON from an earlier run, or a "
                             "fairseq-generate output (scored with the same flags)")
    parser.add_argument("--output-json", type=Path, metavar="FILE", help="write the score record (JSON) here")
    parser.add_argument("--output-md", type=Path, metavar="FILE",
                        help="append a row to this Markdown table (header written if the file is new)")
    add_overwrite_flag(parser, "an existing --output-json file")
    return parser


def validate_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """All checks that need no scoring, so that bad input fails before any work."""
    if args.generate_output is not None and args.hyp is not None:
        parser.error("give either --generate-output, or --hyp and --ref, not both")
    if args.generate_output is None and (args.hyp is None or args.ref is None):
        parser.error("give --generate-output FILE, or both --hyp FILE and --ref FILE")
    inputs = [("--generate-output", args.generate_output) if args.generate_output is not None else ("--hyp", args.hyp)]
    if args.ref is not None:
        inputs.append(("--ref", args.ref))
    if args.baseline is not None:
        try:
            args.baseline_name, args.baseline_path = split_name_and_path(args.baseline, "--baseline")
        except argparse.ArgumentTypeError as error:
            parser.error(str(error))
        inputs.append(("--baseline", args.baseline_path))
        if args.bootstrap == 0:
            parser.error("--baseline needs resampling for the paired test; drop --bootstrap 0")
    try:
        for flag, path in inputs:
            require_path(path, flag, FILE)
        if args.expected_from is not None:
            inputs.append(("--expected-from", args.expected_from))
        outputs = [("--output-json", args.output_json), ("--output-md", args.output_md)]
        for flag, path in outputs:
            if path is not None:
                require_path(path, flag, OUTPUT_FILE)
        check_outputs_are_not_inputs(outputs, inputs)
        args.expected = expected_sentence_count(args)
        args.processing, args.settings = scoring_settings(args)
        if args.output_json is not None:
            check_outputs_free([args.output_json], args.overwrite, "--output-json")
        if args.output_md is not None:
            check_score_table(args.output_md)
    except UserError as error:
        parser.error(str(error))
    if args.system is None:
        args.system = (args.generate_output or args.hyp).stem


@exits_on_user_error("fairseq-kd-score")
def cli_main(argv: Optional[List[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    validate_arguments(parser, args)
    processing = args.processing
    # The baseline first: a bad record then fails before the (longer) scoring of the system.
    baseline = None
    if args.baseline is not None:
        # a generate output as baseline is scored against the same references as the system
        baseline = load_system(args.baseline_name, args.baseline_path, processing, args.settings, 0, args.seed,
                               args.expected, args.allow_partial,
                               args.ref if args.generate_output is not None else None, args.ref_is_plain)
    if args.generate_output is not None:
        system = score_generate_output(
            args.system, args.generate_output, processing, args.settings, args.bootstrap, args.seed,
            args.expected, args.allow_partial, args.ref, args.ref_is_plain)
    else:
        system = score_text_files(args.system, args.hyp, args.ref, processing, args.settings, args.bootstrap,
                                  args.seed, ref_is_plain=args.ref_is_plain)
        if args.expected is not None and system.result.n_sentences != args.expected:
            message = f"--hyp/--ref have {system.result.n_sentences} lines but {args.expected} sentences are expected"
            if not args.allow_partial:
                raise InputError(message + "; pass --allow-partial to score them anyway")
            system.partial = {"complete": False, "n_sentences": system.result.n_sentences,
                              "n_expected": args.expected, "problems": [message]}
    paired = None
    if baseline is not None:
        paired = compare_with_baseline(system, baseline, args.bootstrap, args.ar_trials, args.seed)
    record = score_record(system, paired)

    result = system.result
    line = f"{system.name}: BLEU = {result.score:.2f}"
    if result.n_bootstrap:
        line += f" (μ ± 95% CI {format_mean_ci(result.mean, result.ci)}, {result.n_bootstrap} resamples)"
    print(line)
    if system.partial_note():
        print(f"  {system.partial_note()}")
    print(f"  {result.verbose}")
    print(f"  chrF = {record['chrf']:.2f}, chrF++ = {record['chrfpp']:.2f} (sacreBLEU's CHRF, word_order 0 and 2)")
    print(f"  signature: {result.signature}")
    if paired is not None:
        print(f"  vs {paired['baseline']} ({paired['baseline_bleu']:.2f}): "
              f"{paired['difference']:+.2f} BLEU, p = {format_p_value(paired['p_bootstrap'])} (sacreBLEU paired "
              f"bootstrap), p = {format_p_value(paired['p_randomization'])} (paired approximate randomisation)")
    try:
        if args.output_json is not None:
            args.output_json.parent.mkdir(parents=True, exist_ok=True)
            write_json(args.output_json, record)
        if args.output_md is not None:
            args.output_md.parent.mkdir(parents=True, exist_ok=True)
            append_score_row(args.output_md, record)
    except OSError as error:  # the folder or file named by --output-json/--output-md
        raise FileAccessError(message_of(error)) from None


if __name__ == "__main__":
    cli_main()
