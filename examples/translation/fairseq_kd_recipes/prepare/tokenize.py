"""Moses tokenisation (via sacremoses, no Perl) and the ``clean-corpus-n`` length filter.

:class:`MosesPreprocessor` reproduces the chain fairseq's recipes build from the Moses scripts:
``normalize-punctuation.perl`` (optional), ``remove-non-printing-char.perl`` (optional),
``tokenizer.perl -l LANG [-a]`` with XML escaping, and ``lowercase.perl`` (optional).

sacremoses follows ``tokenizer.perl`` except for one rule: the Perl script always splits the full
stop off the *last* word of a line ("split last words independently as they are unlikely to be
non-breaking prefixes"), whereas sacremoses applies the non-breaking-prefix exceptions to it too,
so ``... in the u.s.`` or German ``... usw.`` keep their final period attached.
:class:`PerlCompatibleMosesTokenizer` adds that rule; with it the IWSLT'14 test sets are
reproduced line for line (see ``tests/test_prepare_iwslt.py``).

Design notes: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import regex
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from .parallel import map_lines
from .textio import parallel_pairs

_NON_PRINTING = regex.compile(r"\p{C}")
_ENDS_WITH_PERIOD = re.compile(r"^(\S+)\.$")


class PerlCompatibleMosesTokenizer(MosesTokenizer):
    """sacremoses' tokenizer plus ``tokenizer.perl``'s rule for the final word of a line."""

    def handles_nonbreaking_prefixes(self, text: str) -> str:
        tokens = super().handles_nonbreaking_prefixes(text).split()
        # The parent left "X." attached only if a non-breaking-prefix exception applied; for the
        # last token the Perl script splits regardless.
        if tokens:
            match = _ENDS_WITH_PERIOD.match(tokens[-1])
            if match:
                tokens[-1] = match.group(1) + " ."
        return " ".join(tokens)


@dataclass(frozen=True)
class MosesConfig:
    """Settings of the Moses chain; every field is a flag of one of the Perl scripts."""

    lang: str
    lowercase: bool = False  # lowercase.perl
    aggressive_dash_splits: bool = False  # tokenizer.perl -a
    normalize_punctuation: bool = False  # normalize-punctuation.perl -l LANG
    remove_non_printing: bool = False  # remove-non-printing-char.perl
    escape: bool = True  # tokenizer.perl escapes & | < > ' " [ ] unless -no-escape


class MosesPreprocessor:
    """Callable turning one raw line into its Moses-tokenised form under a :class:`MosesConfig`."""

    def __init__(self, config: MosesConfig) -> None:
        self.config = config
        self.tokenizer = PerlCompatibleMosesTokenizer(lang=config.lang)
        self.normalizer = MosesPunctNormalizer(lang=config.lang) if config.normalize_punctuation else None

    def __call__(self, line: str) -> str:
        if self.normalizer is not None:
            line = self.normalizer.normalize(line)
        if self.config.remove_non_printing:
            # remove-non-printing-char.perl replaces each \p{C} character with a space.
            line = _NON_PRINTING.sub(" ", line)
        line = self.tokenizer.tokenize(
            line,
            aggressive_dash_splits=self.config.aggressive_dash_splits,
            return_str=True,
            escape=self.config.escape,
        )
        return line.lower() if self.config.lowercase else line


def moses_preprocess(lines: Iterable[str], config: MosesConfig, workers: int = 1) -> Iterator[str]:
    """Yield the :class:`MosesPreprocessor` output of every line, in order, using ``workers`` processes."""
    return map_lines(lines, functools.partial(MosesPreprocessor, config), workers)


@dataclass(frozen=True)
class CleanRule:
    """``clean-corpus-n.perl -ratio RATIO CORPUS L1 L2 OUT MIN MAX`` as a predicate.

    ``ratio=None`` disables the length-ratio test.
    """

    min_tokens: int = 1
    max_tokens: int = 175
    ratio: float | None = 1.5
    max_word_length: int = 1000

    def __post_init__(self) -> None:
        if self.min_tokens < 1 or self.max_tokens < self.min_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        if self.ratio is not None and self.ratio < 1:
            raise ValueError(f"ratio must be >= 1 (or None), got {self.ratio}")


def keep_pair(source_tokens: Sequence[str], target_tokens: Sequence[str], rule: CleanRule) -> bool:
    """Whether ``clean-corpus-n.perl`` keeps a pair given as whitespace-token lists."""
    source_count, target_count = len(source_tokens), len(target_tokens)
    if not (rule.min_tokens <= source_count <= rule.max_tokens and rule.min_tokens <= target_count <= rule.max_tokens):
        return False
    if rule.ratio is not None and (source_count / target_count > rule.ratio or target_count / source_count > rule.ratio):
        return False
    longest = max(len(token) for token in (*source_tokens, *target_tokens))
    return longest <= rule.max_word_length


def clean_indices(source_lines: Iterable[str], target_lines: Iterable[str], rule: CleanRule) -> list[int]:
    """Indices of the pairs :func:`keep_pair` keeps (token = whitespace-separated word)."""
    return [
        index
        for index, (source, target) in enumerate(parallel_pairs(source_lines, target_lines))
        if keep_pair(source.split(), target.split(), rule)
    ]
