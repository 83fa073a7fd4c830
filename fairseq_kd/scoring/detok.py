"""Read fairseq-generate output, and turn system output and references back into the plain text
sacreBLEU must see: subword segmentation undone (:func:`remove_bpe`), then Moses tokenisation
(:func:`moses_detokenize`); or, for data in a Hugging Face model's vocabulary, that model's
tokenizer (:class:`HuggingFaceDetokenizer`). Details: ``docs/design/scoring.md``.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..errors import FILE, FOLDER, InputError, MissingDependencyError, require_path
from .files import naming_decode_errors

BPE_SCHEMES = ("none", "subword_nmt", "sentencepiece")

SENTENCEPIECE_WORD_BOUNDARY = "\u2581"  # "▁", SentencePiece's meta symbol for a preceding space
SUBWORD_NMT_CONTINUATION = "@@ "


def remove_bpe(line: str, scheme: str) -> str:
    """Undo subword segmentation of one line: fairseq's ``post_process(line, scheme)`` for the
    three schemes the recipes use, rule for rule (not called: ``docs/design/scoring.md``)."""
    if scheme == "subword_nmt":
        return (line + " ").replace(SUBWORD_NMT_CONTINUATION, "").rstrip()
    if scheme == "sentencepiece":
        return line.replace(" ", "").replace(SENTENCEPIECE_WORD_BOUNDARY, " ").strip()
    if scheme == "none":
        return line
    raise InputError(f"unknown subword scheme {scheme!r}; expected one of {', '.join(BPE_SCHEMES)}")


def moses_detokenize(lines: Sequence[str], lang: str) -> List[str]:
    """Moses detokenisation (sacremoses, which also unescapes ``&apos;`` and friends) of each line."""
    from sacremoses import MosesDetokenizer

    detokenizer = MosesDetokenizer(lang=lang)
    return [detokenizer.detokenize(line.split()) for line in lines]


#: fairseq's special symbols (dictionary indices 0-3) that stand for no text: in data binarised by
#: fairseq-kd-hf-data they are the tokenizer's tokens of those roles (fairseq_kd/models/hf_vocabulary.py),
#: which its decode skips
FAIRSEQ_CONTROL_SYMBOLS = frozenset({"<s>", "<pad>", "</s>"})
#: fairseq's <unk>, and fairseq-generate's escaped <unk> of its T- lines: the tokenizer's unknown token
FAIRSEQ_UNKNOWN_SYMBOLS = frozenset({"<unk>", "<<unk>>"})


@functools.lru_cache(maxsize=4)
def load_hf_tokenizer(folder: str):
    """The tokenizer of a ``save_pretrained`` folder, offline, loaded once per folder."""
    require_path(folder, "--detok-hf", FOLDER, "give the Hugging Face save_pretrained folder the data was "
                 "binarised with (fairseq-kd-hf-data --teacher)")
    try:
        import transformers
    except ImportError as error:
        raise MissingDependencyError(f"--detok-hf needs transformers: pip install 'fairseq-kd[hf]' ({error})") from None
    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    # the libraries under transformers raise no common class for missing or damaged tokenizer files
    except Exception as error:  # noqa: BLE001
        first_line = str(error).splitlines()[0] if str(error) else ""
        raise InputError(f"--detok-hf {folder!r}: its tokenizer cannot be loaded offline ({type(error).__name__}: "
                         f"{first_line}); give the save_pretrained folder the data was binarised with "
                         "(fairseq-kd-hf-data --teacher)") from None


class HuggingFaceDetokenizer:
    """Text of lines of fairseq symbols (fairseq-generate's lines without ``--remove-bpe``) of data
    binarised by ``fairseq-kd-hf-data --teacher DIR``, as that tokenizer decodes its target side."""

    def __init__(self, folder) -> None:
        self.folder = str(folder)
        self.tokenizer = load_hf_tokenizer(self.folder)
        self.language_tags = set((getattr(self.tokenizer, "lang_token_to_id", None) or {}).values())

    def ids(self, line: str) -> List[int]:
        """The tokenizer's ids of one line of fairseq symbols (in target mode: :meth:`__call__`)."""
        tokenizer, ids = self.tokenizer, []
        for piece in line.split():
            if piece in FAIRSEQ_CONTROL_SYMBOLS:
                continue
            if piece in FAIRSEQ_UNKNOWN_SYMBOLS:
                piece = str(tokenizer.unk_token)
            token_id = tokenizer.convert_tokens_to_ids(piece)
            if token_id is None or (token_id == tokenizer.unk_token_id and piece != str(tokenizer.unk_token)):
                raise InputError(f"--detok-hf {self.folder!r}: {piece!r} is not a token of its tokenizer; was this "
                                 f"output decoded from data binarised with fairseq-kd-hf-data --teacher {self.folder}?")
            if token_id not in self.language_tags:
                ids.append(token_id)
        return ids

    def __call__(self, lines: Sequence[str]) -> List[str]:
        tokenizer = self.tokenizer
        to_target, to_input = (getattr(tokenizer, name, None) for name in ("_switch_to_target_mode",
                                                                             "_switch_to_input_mode"))
        if to_target is not None:
            to_target()
        try:
            ids = [self.ids(line) for line in lines]
        finally:
            if to_input is not None:
                to_input()
        return [tokenizer.decode(row, skip_special_tokens=True) for row in ids]


def detokenize_lines(lines: Sequence[str], remove_bpe_scheme: str = "none", moses_lang: Optional[str] = None,
                     hf_folder: Optional[str] = None) -> List[str]:
    """Apply :func:`remove_bpe` and then, if ``moses_lang`` is given, :func:`moses_detokenize`; or,
    with ``hf_folder``, :class:`HuggingFaceDetokenizer` of that folder instead of both."""
    if remove_bpe_scheme not in BPE_SCHEMES:
        raise InputError(f"unknown subword scheme {remove_bpe_scheme!r}; expected one of {', '.join(BPE_SCHEMES)}")
    if hf_folder is not None:
        if remove_bpe_scheme != "none" or moses_lang:
            raise InputError("--detok-hf turns the model's tokens into text itself: drop --remove-bpe and "
                             "--detok-moses")
        return HuggingFaceDetokenizer(hf_folder)(lines)
    plain = [remove_bpe(line, remove_bpe_scheme) for line in lines]
    if moses_lang:
        plain = moses_detokenize(plain, moses_lang)
    return plain


def read_lines(path: Path, what: str) -> List[str]:
    """Lines of a UTF-8 text file without their line ends; ``what`` names the file in errors."""
    path = require_path(path, what, FILE)
    with naming_decode_errors(path, f"{what} file"), open(path, encoding="utf-8", newline="") as handle:
        return [line.rstrip("\r\n") for line in handle]


class IncompleteGenerateOutputError(InputError):
    """A fairseq-generate output does not hold every sentence of the test set exactly once."""


@dataclass
class GenerateOutput:
    """Hypotheses and references of a fairseq-generate output, by ascending sentence id;
    ``hypothesis_source``: ``"D"`` or ``"H"``; ``problems``: why it is not complete (empty if it is)."""

    ids: List[int]
    hypotheses: List[str]
    references: List[str]
    hypothesis_source: str
    n_expected: int = 0
    problems: List[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.problems

    def completeness(self) -> Dict:
        """What a score record says about how much of the test set was scored."""
        return {"complete": self.complete, "n_sentences": len(self.ids), "n_expected": self.n_expected,
                "problems": list(self.problems)}


_GENERATE_LINE = re.compile(r"^([HDTS])-(\d+)\t(.*)$", re.DOTALL)
_SUMMARY_LINE = re.compile(r"^Generate \S+ with beam=\d+: ")  # after the last sentence
_TRANSLATED_LINE = re.compile(r"\| Translated ([\d,]+) sentences")


def _first(ids, count=5) -> str:
    ids = sorted(ids)
    return ", ".join(map(str, ids[:count])) + (", ..." if len(ids) > count else "")


def read_generate_output(path: Path, expected_sentences: Optional[int] = None,
                         allow_partial: bool = False) -> GenerateOutput:
    """A fairseq-generate output file's hypotheses and references, checked complete against
    ``expected_sentences`` (else ids ``0..max``) unless ``allow_partial`` (``docs/design/scoring.md``)."""
    path = Path(path)
    scanned = _scan_generate_lines(read_lines(path, "fairseq-generate output"))
    source, chosen = _paired_sentences(path, scanned)
    ids = sorted(chosen)
    n_expected = expected_sentences if expected_sentences is not None else ids[-1] + 1
    problems = _completeness_problems(scanned, ids, n_expected)
    if problems and not allow_partial:
        how_many = (f"the test set has {n_expected} sentences" if expected_sentences is not None
                    else f"ids 0..{n_expected - 1} imply at least {n_expected} sentences")
        raise IncompleteGenerateOutputError(
            f"{path}: incomplete fairseq-generate output: hypotheses for {len(ids)} sentences, "
            f"{how_many}; " + "; ".join(problems) + ". Decode the whole test set again (fairseq-generate "
            "--required-batch-size-multiple 1, no --skip-invalid-size-inputs-valid-test), or pass "
            "--allow-partial to score only these sentences (the score is then marked partial, with "
            "the counts).")
    return GenerateOutput(ids=ids, hypotheses=[chosen[i] for i in ids],
                          references=[scanned.references[i] for i in ids], hypothesis_source=source,
                          n_expected=n_expected, problems=problems)


@dataclass
class _GenerateLines:
    """Per sentence id the first ``H-`` and ``D-`` hypothesis, the last ``T-`` line and the line of a
    second one; the summary lines, the last sentence line and ``Translated <n> sentences``."""

    hypotheses: Dict[str, Dict[int, str]] = field(default_factory=lambda: {"H": {}, "D": {}})
    references: Dict[int, str] = field(default_factory=dict)
    duplicated: Dict[int, int] = field(default_factory=dict)
    summary_lines: List[int] = field(default_factory=list)
    last_sentence_line: int = 0
    translated: Optional[int] = None


def _scan_generate_lines(lines: Sequence[str]) -> _GenerateLines:
    scanned = _GenerateLines()
    for line_number, line in enumerate(lines, start=1):
        if _SUMMARY_LINE.match(line):
            scanned.summary_lines.append(line_number)
            continue
        translated_match = _TRANSLATED_LINE.search(line)
        if translated_match:
            scanned.translated = int(translated_match.group(1).replace(",", ""))
            continue
        match = _GENERATE_LINE.match(line)
        if match is None:
            continue
        scanned.last_sentence_line = line_number
        kind, sentence_id, rest = match.group(1), int(match.group(2)), match.group(3)
        if kind == "T":
            if sentence_id in scanned.references:
                scanned.duplicated.setdefault(sentence_id, line_number)
            scanned.references[sentence_id] = rest
        elif kind in scanned.hypotheses:
            fields = rest.split("\t", 1)
            text = fields[1] if len(fields) == 2 else ""
            # n-best lists print the best hypothesis first; keep it.
            scanned.hypotheses[kind].setdefault(sentence_id, text)
    return scanned


def _paired_sentences(path: Path, scanned: _GenerateLines):
    """Which hypotheses are scored (``D`` when the file has any, else ``H``) and those hypotheses
    by id; refuses repeated references and a hypothesis or reference without its counterpart."""
    duplicated = scanned.duplicated
    if duplicated:
        first_id = min(duplicated)
        raise IncompleteGenerateOutputError(
            f"{path}:{duplicated[first_id]}: a second T- line for sentence id {first_id} "
            f"({len(duplicated)} sentence ids appear more than once: {_first(duplicated)}); is this "
            "the output of several fairseq-generate runs concatenated? Score one complete run.")
    source = "D" if scanned.hypotheses["D"] else "H"
    chosen = scanned.hypotheses[source]
    if not chosen:
        raise InputError(f"{path}: no H- or D- lines found; is this a fairseq-generate output file "
                         "(written without --quiet)?")
    references = scanned.references
    for present, counterpart, unmatched_what, advice in (
        (chosen, references, "hypotheses have no T- reference line",
         "fairseq-generate prints T- lines only when the test set has a target side"),
        (references, chosen, f"references have no {source}- hypothesis line", "the file looks truncated"),
    ):
        unmatched = sorted(set(present) - set(counterpart))
        if unmatched:
            raise InputError(f"{path}: {len(unmatched)} {unmatched_what} (first ids: {unmatched[:5]}); {advice}")
    return source, chosen


def _completeness_problems(scanned: _GenerateLines, ids: List[int], n_expected: int) -> List[str]:
    """Why the sentences of ``ids`` are not a complete run of ``n_expected`` (empty when they are)."""
    summary_lines = scanned.summary_lines
    problems = []
    if not summary_lines:
        problems.append("it does not end with fairseq-generate's summary line ('Generate <subset> with beam=N: "
                        "...'): the run was cut short or the file was truncated")
    elif len(summary_lines) > 1:
        problems.append(f"it holds {len(summary_lines)} summary lines (lines {_first(summary_lines)}): "
                        "several runs concatenated?")
    elif scanned.last_sentence_line > summary_lines[-1]:
        problems.append(f"sentence lines follow the summary line (line {summary_lines[-1]})")
    missing = set(range(n_expected)) - set(ids)
    if missing:
        problems.append(f"{len(missing)} sentence ids of 0..{n_expected - 1} have no hypothesis "
                        f"(first: {_first(missing)})")
    beyond = [i for i in ids if i >= n_expected]
    if beyond:
        problems.append(f"{len(beyond)} sentence ids are beyond the {n_expected} expected sentences "
                        f"(first: {_first(beyond)}): another test set?")
    if scanned.translated is not None and scanned.translated != len(ids):
        problems.append(f"fairseq-generate logged 'Translated {scanned.translated} sentences' but the file "
                        f"holds {len(ids)}")
    return problems
