"""Turn system output and references back into plain text before scoring, and read
fairseq-generate output.

sacreBLEU must see detokenised text (Post 2018, "A Call for Clarity in Reporting BLEU Scores"):
it applies its own tokeniser (13a, zh, ...) so that scores are comparable across papers. The
recipes of this project segment text in two ways, undone here in reverse order:

1. subword segmentation: subword-nmt BPE (IWSLT'14: ``"inten@@ se"``) or SentencePiece
   (``"▁inten se"``); undone by :func:`remove_bpe`, with exactly the rules of fairseq's
   ``--post-process subword_nmt`` / ``sentencepiece`` (``fairseq.data.data_utils.post_process``);
2. Moses tokenisation (IWSLT'14 tokenises with the Moses tokenizer before BPE); undone by
   :func:`moses_detokenize` through sacremoses. SentencePiece recipes work on raw text and need no
   Moses step.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

BPE_SCHEMES = ("none", "subword_nmt", "sentencepiece")

SENTENCEPIECE_WORD_BOUNDARY = "\u2581"  # "▁", SentencePiece's meta symbol for a preceding space
SUBWORD_NMT_CONTINUATION = "@@ "


def remove_bpe(line: str, scheme: str) -> str:
    """Undo subword segmentation of one line.

    ``subword_nmt``: every ``"@@ "`` joins a piece to the next one; a trailing ``"@@"`` (a
    truncated hypothesis ending inside a word) is dropped as well, which appending a space before
    the replacement achieves (fairseq's rule). ``sentencepiece``: pieces are concatenated and each
    ``"▁"`` becomes a space. ``none`` returns the line unchanged.
    """
    if scheme == "subword_nmt":
        return (line + " ").replace(SUBWORD_NMT_CONTINUATION, "").rstrip()
    if scheme == "sentencepiece":
        return line.replace(" ", "").replace(SENTENCEPIECE_WORD_BOUNDARY, " ").strip()
    if scheme == "none":
        return line
    raise ValueError(f"unknown subword scheme {scheme!r}; expected one of {', '.join(BPE_SCHEMES)}")


def moses_detokenize(lines: Sequence[str], lang: str) -> List[str]:
    """Moses detokenisation (sacremoses, which also unescapes ``&apos;`` and friends) of each line.

    Use only where the recipe tokenised with Moses for ``lang``; on raw text it can join tokens
    that were never split.
    """
    from sacremoses import MosesDetokenizer  # imported here: only Moses recipes pay for it

    detokenizer = MosesDetokenizer(lang=lang)
    return [detokenizer.detokenize(line.split()) for line in lines]


def detokenize_lines(
    lines: Sequence[str], remove_bpe_scheme: str = "none", moses_lang: Optional[str] = None
) -> List[str]:
    """Apply :func:`remove_bpe` and then, if ``moses_lang`` is given, :func:`moses_detokenize`."""
    if remove_bpe_scheme not in BPE_SCHEMES:
        raise ValueError(
            f"unknown subword scheme {remove_bpe_scheme!r}; expected one of {', '.join(BPE_SCHEMES)}"
        )
    plain = [remove_bpe(line, remove_bpe_scheme) for line in lines]
    if moses_lang:
        plain = moses_detokenize(plain, moses_lang)
    return plain


def read_lines(path: Path, what: str) -> List[str]:
    """Lines of a UTF-8 text file without their line ends; ``what`` names the file in errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {str(path)!r} does not exist")
    with open(path, encoding="utf-8", newline="") as handle:
        return [line.rstrip("\r\n") for line in handle]


@dataclass
class GenerateOutput:
    """Hypotheses and references read from a fairseq-generate output file.

    ``ids`` are fairseq's sentence ids (the order of the test set), ascending; ``hypotheses[i]``
    and ``references[i]`` belong to ``ids[i]``. ``hypothesis_source`` is ``"D"`` or ``"H"``: which
    of fairseq's lines the hypotheses came from.
    """

    ids: List[int]
    hypotheses: List[str]
    references: List[str]
    hypothesis_source: str


_GENERATE_LINE = re.compile(r"^([HDTS])-(\d+)\t(.*)$", re.DOTALL)


def read_generate_output(path: Path) -> GenerateOutput:
    """Parse a fairseq-generate output file into id-sorted hypotheses and references.

    fairseq-generate prints, per sentence and in batch order (not in id order):
    ``S-<id>\\t<source>``, ``T-<id>\\t<reference>``, then for each of the n-best
    ``H-<id>\\t<score>\\t<hypothesis>`` (after ``--post-process``/``--remove-bpe``) and
    ``D-<id>\\t<score>\\t<hypothesis>`` (the same, further decoded by ``--bpe``/``--tokenizer``).
    The reference ``T-`` line receives both of those steps too, so ``D-`` lines are the
    hypotheses that match the references; they are used whenever the file has any (fairseq 0.12
    always prints them), and ``H-`` lines only for files without ``D-`` lines. With ``--nbest``
    above 1 the first hypothesis printed for an id (the best one) is used. Every other line
    (``P-``, ``A-``, logging, the final BLEU line) is ignored.
    """
    path = Path(path)
    lines = read_lines(path, "fairseq-generate output")
    hypotheses: Dict[str, Dict[int, str]] = {"H": {}, "D": {}}
    references: Dict[int, str] = {}
    for line_number, line in enumerate(lines, start=1):
        match = _GENERATE_LINE.match(line)
        if match is None:
            continue
        kind, sentence_id, rest = match.group(1), int(match.group(2)), match.group(3)
        if kind == "T":
            if sentence_id in references:
                raise ValueError(
                    f"{path}:{line_number}: a second T- line for sentence id {sentence_id}; "
                    "is this the output of several fairseq-generate runs concatenated?"
                )
            references[sentence_id] = rest
        elif kind in hypotheses:
            fields = rest.split("\t", 1)
            text = fields[1] if len(fields) == 2 else ""
            # n-best lists print the best hypothesis first; keep it.
            hypotheses[kind].setdefault(sentence_id, text)
    source = "D" if hypotheses["D"] else "H"
    chosen = hypotheses[source]
    if not chosen:
        raise ValueError(
            f"{path}: no H- or D- lines found; is this a fairseq-generate output file "
            "(written without --quiet)?"
        )
    missing_refs = sorted(set(chosen) - set(references))
    if missing_refs:
        raise ValueError(
            f"{path}: {len(missing_refs)} hypotheses have no T- reference line (first ids: "
            f"{missing_refs[:5]}); fairseq-generate prints T- lines only when the test set has a "
            "target side"
        )
    missing_hyps = sorted(set(references) - set(chosen))
    if missing_hyps:
        raise ValueError(
            f"{path}: {len(missing_hyps)} references have no {source}- hypothesis line (first ids: "
            f"{missing_hyps[:5]}); the file looks truncated"
        )
    ids = sorted(chosen)
    return GenerateOutput(
        ids=ids,
        hypotheses=[chosen[i] for i in ids],
        references=[references[i] for i in ids],
        hypothesis_source=source,
    )
