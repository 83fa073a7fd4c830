"""Collect a recipe's results beyond the scores: each system's parameter count (of its exported
model) and decoding speed (from fairseq-generate's closing line), checked against the test set's
size, into the sidecar that ``fairseq-kd-report --sidecar`` reads.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

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


