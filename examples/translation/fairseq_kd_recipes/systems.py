"""The recipe's ``systems`` step as a command: each system's parameter count and decoding speed into
the sidecar that ``fairseq-kd-report --sidecar`` reads (:func:`write_systems_sidecar`).

The recipe runs that step in its own process; this command is what a printed plan
(``fairseq-kd-recipe --print-commands``) and its SLURM batch scripts (``--sbatch``) run instead::

    python -m fairseq_kd_recipes.systems --data DATA --test-prefix test.de-en.en --output report/systems.json \\
        --system teacher models/teacher.pt generate/teacher/generate-test.txt logs/generate-teacher.log ...
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from .execute import RecipeError

SPEED_PATTERN = re.compile(r"Translated [\d,]+ sentences \([\d,]+ tokens\) in [\d.]+s \(([\d.]+) sentences/s")


@dataclass(frozen=True)
class SystemDecoding:
    """A system's exported model, its fairseq-generate output and the log of that step."""

    model: Path
    output: Path
    log: Path


def decoding_speed(*paths: Path) -> float:
    """Sentences per second from fairseq-generate's closing "Translated ..." line: the last one in
    the first of ``paths`` that has one (fairseq logs it to the results file or to stderr, depending
    on how logging was configured when it started)."""
    for path in paths:
        if not path.is_file():
            continue
        matches = SPEED_PATTERN.findall(path.read_text(encoding="utf-8", errors="replace"))
        if matches:
            return float(matches[-1])
    raise RecipeError(f"no 'Translated ... sentences/s' line of fairseq-generate in {', '.join(map(str, paths))}")


def decoded_sentences(generate_output: Path) -> int:
    """Number of distinct sentence ids with a hypothesis (H- line) in a fairseq-generate output."""
    ids = set()
    with open(generate_output, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            kind, _, rest = line.partition("-")
            number = rest.split("\t", 1)[0]
            if kind == "H" and number.isdigit():
                ids.add(int(number))
    return len(ids)


def count_parameters(checkpoint: Path, data: Path) -> int:
    """Parameters of the model in ``checkpoint`` as stock fairseq builds it (shared weights once);
    of a Hugging Face teacher's ``save_pretrained`` folder, as transformers builds it."""
    if Path(checkpoint).is_dir():
        return count_hf_parameters(Path(checkpoint))
    import fairseq_kd

    fairseq_kd.register()
    from fairseq import checkpoint_utils

    models, _ = checkpoint_utils.load_model_ensemble([str(checkpoint)], arg_overrides={"data": str(data)})
    return sum(parameter.numel() for parameter in models[0].parameters())


def count_hf_parameters(folder: Path) -> int:
    """Parameters of a ``save_pretrained`` folder's seq2seq model (tied weights once), read as the
    teacher is read (offline, weights only)."""
    from fairseq_kd.models.hf_teacher import import_transformers, load_model, model_class, read_config

    model = load_model(folder, model_class(import_transformers(), folder, read_config(folder)["model_type"]))
    return sum(parameter.numel() for parameter in model.parameters())


def split_size(data: Path, prefix: str) -> int:
    """Sentences of a binarised split (``prefix`` like ``test.de-en.en``)."""
    from fairseq.data import data_utils

    dataset = data_utils.load_indexed_dataset(str(data / prefix), None)
    if dataset is None:
        raise RecipeError(f"{data / prefix}.bin/.idx: no binarised test split")
    return len(dataset)


def write_systems_sidecar(decodings: Mapping[str, SystemDecoding], data: Path, test_prefix: str, sidecar: Path) -> None:
    """``{"system": {"params": N, "sents_per_sec": X}}`` for fairseq-kd-report's --sidecar, after
    checking that every system translated the whole test set."""
    info = {}
    expected = None
    for system, decoding in decodings.items():
        params = count_parameters(decoding.model, data)  # imports fairseq, which split_size needs
        expected = expected if expected is not None else split_size(data, test_prefix)
        decoded = decoded_sentences(decoding.output)
        if decoded != expected:
            raise RecipeError(f"{decoding.output}: {decoded} of the {expected} test sentences were translated; "
                              f"see {decoding.log}")
        info[system] = {"params": params, "sents_per_sec": decoding_speed(decoding.output, decoding.log)}
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    sidecar.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")


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
