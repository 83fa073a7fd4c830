"""SentencePiece (Kudo and Richardson, 2018) training and encoding for the joint vocabulary.

One model is trained on the raw (untokenised) training text of both languages, so source and
target share the pieces, and every split is encoded into space-separated pieces for
fairseq-preprocess.  Decoding (``--bpe sentencepiece --sentencepiece-model MODEL`` at generation
time, or :meth:`sentencepiece.SentencePieceProcessor.decode`) gives back detokenised text, which
is what sacreBLEU scores.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import sentencepiece

from .errors import PrepareError
from .parallel import map_lines
from .textio import iter_lines, write_lines


@dataclass(frozen=True)
class SentencePieceConfig:
    """Training settings; each maps to the SentencePiece trainer option of the same name."""

    vocab_size: int
    model_type: str = "unigram"  # unigram | bpe | char | word
    character_coverage: float = 1.0  # 0.9995 is SentencePiece's advice for Chinese/Japanese
    input_sentence_size: int = 0  # 0: train on every sentence; N: a random sample of N
    seed: int = 1  # sampling seed (only used when input_sentence_size samples)
    num_threads: int = 1

    def __post_init__(self) -> None:
        if self.vocab_size < 8:
            raise PrepareError(f"--spm-vocab-size must be at least 8, got {self.vocab_size}")
        if self.model_type not in ("unigram", "bpe", "char", "word"):
            raise PrepareError(f"--spm-model-type must be unigram, bpe, char or word, got {self.model_type!r}")
        if not 0.0 < self.character_coverage <= 1.0:
            raise PrepareError(f"--spm-character-coverage must be in (0, 1], got {self.character_coverage}")

    def model_settings(self) -> dict:
        """The settings that determine the model (the thread count does not)."""
        return {key: value for key, value in dataclasses.asdict(self).items() if key != "num_threads"}


def train_sentencepiece(inputs: Sequence[Path], model_path: Path, config: SentencePieceConfig) -> None:
    """Train a model on the lines of ``inputs`` and write it to ``model_path`` (``.model``)."""
    model_path = Path(model_path)
    if model_path.suffix != ".model":
        raise ValueError(f"model_path must end in .model, got {model_path}")
    model_path.parent.mkdir(parents=True, exist_ok=True)
    prefix = model_path.with_name(model_path.stem + ".training")
    sentencepiece.set_random_generator_seed(config.seed)
    try:
        sentencepiece.SentencePieceTrainer.train(
            input=",".join(str(path) for path in inputs),
            model_prefix=str(prefix),
            vocab_size=config.vocab_size,
            model_type=config.model_type,
            character_coverage=config.character_coverage,
            input_sentence_size=config.input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=config.num_threads,
            minloglevel=1,
        )
    except RuntimeError as error:
        # e.g. "Vocabulary size too high (32000). Please set it to a value <= 2101."
        raise PrepareError(f"SentencePiece training on {', '.join(map(str, inputs))} failed: {error} "
                           "(adjust --spm-vocab-size)") from None
    os.replace(f"{prefix}.model", model_path)
    os.replace(f"{prefix}.vocab", model_path.with_suffix(".vocab"))


class SentencePieceEncoder:
    """Encodes one raw line per call into space-separated pieces."""

    def __init__(self, model_path: Path) -> None:
        self._processor = sentencepiece.SentencePieceProcessor(model_file=str(model_path))

    def __call__(self, line: str) -> str:
        return " ".join(self._processor.encode(line, out_type=str))


def encode_lines(model_path: Path, lines: Iterable[str], workers: int = 1) -> Iterator[str]:
    """Encode ``lines`` with the model, in order."""
    return map_lines(lines, functools.partial(SentencePieceEncoder, model_path), workers)


def encode_file(model_path: Path, source: Path, destination: Path, workers: int = 1) -> int:
    """Encode every line of ``source`` into ``destination``; return the number of lines."""
    lines = iter_lines(source, progress=f"encode {Path(source).name}")
    return write_lines(destination, encode_lines(model_path, lines, workers))
