"""Score records (what ``fairseq-kd-score`` writes) and the paper-style results table (what
``fairseq-kd-report`` writes). A score record keeps the scored text itself, so that a report runs
sacreBLEU's paired tests on exactly what was scored; its format: ``docs/design/scoring.md``.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .bleu import (DEFAULT_N_BOOTSTRAP, DEFAULT_N_TRIALS, DEFAULT_SEED, INTERVAL_DEFINITION, PAIRED_TESTS_DEFINITION,
                   BleuResult, BleuSettings, check_n_bootstrap, check_n_trials, chrf_scores, compare_systems,
                   score_corpus)
from .detok import detokenize_lines, read_generate_output, read_lines
from ..errors import FILE, InputError, require_path
from .files import load_json, naming_decode_errors

SCORE_FORMAT = "fairseq-kd-score/2"
REPORT_FORMAT = "fairseq-kd-report/1"


@dataclass(frozen=True)
class TextProcessing:
    """How system output and references are turned into plain text before scoring."""

    remove_bpe: str = "none"
    moses_lang: Optional[str] = None
    #: a Hugging Face model folder whose tokenizer decodes the text (data binarised in its
    #: vocabulary by fairseq-kd-hf-data), instead of ``remove_bpe`` and ``moses_lang``
    hf_folder: Optional[str] = None

    def apply(self, lines: Sequence[str]) -> List[str]:
        return detokenize_lines(lines, self.remove_bpe, self.moses_lang, self.hf_folder)

    def to_dict(self) -> Dict:
        described = {"remove_bpe": self.remove_bpe, "detok_moses": self.moses_lang}
        if self.hf_folder is not None:
            described["detok_hf"] = self.hf_folder
        return described


def references_fingerprint(references: Sequence[str]) -> str:
    """SHA-256 of the scored references, one per line: equal only for the same test set."""
    return hashlib.sha256("\n".join(references).encode("utf-8")).hexdigest()


@dataclass
class SystemScore:
    """One system's BLEU on a test set, from text just scored or from a stored score record."""

    name: str
    result: BleuResult
    hypotheses: List[str]
    references: List[str]
    references_sha256: str
    inputs: Dict = field(default_factory=dict)
    # None when every sentence of the test set was scored; else GenerateOutput.completeness()
    partial: Optional[Dict] = None

    def chrf(self) -> Dict[str, float]:
        return chrf_scores(self.hypotheses, self.references, self.result.settings.lowercase)

    def length_ratio(self) -> float:
        """Hypothesis length over reference length in BLEU's tokens (its brevity penalty's ratio)."""
        bleu = self.result.settings.make_metric().corpus_score(self.hypotheses, [self.references])
        return bleu.sys_len / bleu.ref_len if bleu.ref_len else float("nan")

    def partial_note(self) -> Optional[str]:
        if not self.partial:
            return None
        return (f"PARTIAL: {self.name} scored {self.partial['n_sentences']} of "
                f"{self.partial['n_expected']} expected sentences ({'; '.join(self.partial['problems'])})")


def score_texts(name: str, hypotheses: List[str], references: List[str], settings: BleuSettings, n_bootstrap: int,
                seed: int, inputs: Dict) -> SystemScore:
    result = score_corpus(hypotheses, references, settings, n_bootstrap, seed)
    return SystemScore(name, result, hypotheses, references, references_fingerprint(references), inputs)


def score_generate_output(
    name: str, path: Path, processing: TextProcessing, settings: BleuSettings, n_bootstrap: int, seed: int,
    expected_sentences: Optional[int] = None, allow_partial: bool = False, ref_path: Optional[Path] = None,
    ref_is_plain: bool = False) -> SystemScore:
    """Score a fairseq-generate output file (incomplete: refused unless ``allow_partial``) against
    its ``T-`` lines, or against ``ref_path``, one line per sentence id, whose line count is then the
    expected count (processed like the hypotheses unless ``ref_is_plain``)."""
    reference_lines = None
    if ref_path is not None:
        reference_lines = read_lines(ref_path, "--ref")
        if expected_sentences is not None and expected_sentences != len(reference_lines):
            raise InputError(f"--ref file {str(ref_path)!r} has {len(reference_lines)} lines but "
                             f"{expected_sentences} sentences are expected")
        expected_sentences = len(reference_lines)
    generated = read_generate_output(path, expected_sentences, allow_partial)
    inputs = {"generate_output": str(path), "hypothesis_lines": generated.hypothesis_source + "-",
              **processing.to_dict()}
    if reference_lines is None:
        references = processing.apply(generated.references)
    else:
        chosen = [reference_lines[i] for i in generated.ids]
        references = chosen if ref_is_plain else processing.apply(chosen)
        inputs.update(ref=str(ref_path), ref_is_plain=ref_is_plain)
    system = score_texts(name, processing.apply(generated.hypotheses), references, settings, n_bootstrap, seed,
                         inputs)
    system.partial = None if generated.complete else generated.completeness()
    return system


def score_text_files(name: str, hyp_path: Path, ref_path: Path, processing: TextProcessing,
                     settings: BleuSettings, n_bootstrap: int, seed: int, ref_is_plain: bool = False) -> SystemScore:
    """Score a hypothesis file against a reference file, line by line, both processed by
    ``processing`` unless ``ref_is_plain`` says the reference is already plain text."""
    hypotheses = read_lines(hyp_path, "--hyp")
    references = read_lines(ref_path, "--ref")
    if not hypotheses:
        raise InputError(f"--hyp file {str(hyp_path)!r} is empty")
    if not references:
        raise InputError(f"--ref file {str(ref_path)!r} is empty")
    if len(hypotheses) != len(references):
        raise InputError(f"--hyp file {str(hyp_path)!r} has {len(hypotheses)} lines but --ref file "
                         f"{str(ref_path)!r} has {len(references)}; they must be line-parallel")
    inputs = {"hyp": str(hyp_path), "ref": str(ref_path), "ref_is_plain": ref_is_plain, **processing.to_dict()}
    references = references if ref_is_plain else processing.apply(references)
    return score_texts(name, processing.apply(hypotheses), references, settings, n_bootstrap, seed, inputs)


# --------------------------------------------------------------------------- score records


def score_record(system: SystemScore, paired: Optional[Dict] = None) -> Dict:
    """The JSON-serialisable score record of ``system``."""
    result = system.result
    return {"format": SCORE_FORMAT, "system": system.name, "bleu": result.score, **system.chrf(), "mean": result.mean,
            "ci": result.ci, "n_bootstrap": result.n_bootstrap, "seed": result.seed, "signature": result.signature,
            "verbose": result.verbose, "n_sentences": result.n_sentences, "settings": result.settings.to_dict(),
            "references_sha256": system.references_sha256, "inputs": system.inputs, "paired": paired,
            "partial": system.partial, "hypotheses": system.hypotheses, "references": system.references}


def is_score_record_file(path: Path) -> bool:
    """Whether ``path`` holds a JSON object (a score record) rather than fairseq-generate text."""
    with naming_decode_errors(path), open(path, encoding="utf-8", errors="ignore") as handle:
        head = handle.read(4096).lstrip()
    return head.startswith("{")


def _text_list(record: Dict, key: str, path: Path) -> List[str]:
    values = record.get(key)
    if not isinstance(values, list) or not values or not all(isinstance(value, str) for value in values):
        raise InputError(f"{path}: {key} must be a non-empty list of strings (one scored line each)")
    return values


def load_score_record(path: Path, name: Optional[str] = None) -> SystemScore:
    """Read a score record written by ``fairseq-kd-score --output-json`` (``name`` overrides its
    system name). The BLEU is recomputed from the stored text and the references from their
    fingerprint: a record edited by hand or truncated fails here."""
    path = Path(path)
    record = load_json(path, "score record")
    if not isinstance(record, dict) or record.get("format") != SCORE_FORMAT:
        raise InputError(f"{path}: not a score record (expected \"format\": \"{SCORE_FORMAT}\"); write one "
                         "with fairseq-kd-score --output-json")
    missing = [key for key in ("system", "bleu", "signature", "settings", "references_sha256", "hypotheses",
                               "references") if key not in record]
    if missing:
        raise InputError(f"{path}: score record lacks {', '.join(missing)}")
    hypotheses, references = _text_list(record, "hypotheses", path), _text_list(record, "references", path)
    if len(hypotheses) != len(references):
        raise InputError(f"{path}: {len(hypotheses)} hypotheses but {len(references)} references")
    if references_fingerprint(references) != record["references_sha256"]:
        raise InputError(f"{path}: the stored references do not match references_sha256; the record "
                         "was changed after it was written")
    try:
        settings = BleuSettings(**record["settings"])
    except TypeError as error:
        raise InputError(f"{path}: bad settings {record['settings']} ({error})") from None
    recomputed = score_corpus(hypotheses, references, settings, n_bootstrap=0).score
    if recomputed != record["bleu"]:
        raise InputError(f"{path}: stored BLEU {record['bleu']} is not the BLEU of its text ({recomputed}); the "
                         "record was changed after it was written")
    result = BleuResult(score=record["bleu"], signature=record["signature"], verbose=record.get("verbose", ""),
                        n_sentences=len(hypotheses), settings=settings, n_bootstrap=record.get("n_bootstrap") or 0,
                        seed=record.get("seed"), mean=record.get("mean"), ci=record.get("ci"))
    inputs = dict(record.get("inputs") or {}, score_record=str(path))
    return SystemScore(name or record["system"], result, hypotheses, references, record["references_sha256"],
                       inputs, record.get("partial") or None)


def load_system(name: str, path: Path, processing: TextProcessing, settings: BleuSettings, n_bootstrap: int,
                seed: int, expected_sentences: Optional[int] = None, allow_partial: bool = False,
                ref_path: Optional[Path] = None, ref_is_plain: bool = False) -> SystemScore:
    """A system from a score record (JSON) or a fairseq-generate output file (anything else); partial
    scores and records of another sentence count than ``expected_sentences`` are refused unless
    ``allow_partial``."""
    path = require_path(path, f"system {name!r} file", FILE)
    if not is_score_record_file(path):
        return score_generate_output(name, path, processing, settings, n_bootstrap, seed,
                                     expected_sentences, allow_partial, ref_path, ref_is_plain)
    system = load_score_record(path, name)
    if not allow_partial:
        if system.partial:
            raise InputError(f"system {name!r}: score record {str(path)!r} is a partial score "
                             f"({system.partial['n_sentences']} of {system.partial['n_expected']} sentences); "
                             "score a complete output, or pass --allow-partial")
        if expected_sentences is not None and system.result.n_sentences != expected_sentences:
            raise InputError(f"system {name!r}: score record {str(path)!r} has {system.result.n_sentences} "
                             f"sentences but {expected_sentences} are expected; pass --allow-partial to use it anyway"
            )
    return system


def check_comparable(systems: Sequence[SystemScore]) -> None:
    """Raise unless all systems were scored on the same references with the same settings."""
    first = systems[0]
    for other in systems[1:]:
        if other.result.settings != first.result.settings:
            raise InputError(f"systems {first.name!r} and {other.name!r} were scored with different sacreBLEU "
                             f"settings ({first.result.settings.to_dict()} vs {other.result.settings.to_dict()}); "
                             "score them with the same --tokenize/--lowercase")
        if other.result.n_sentences != first.result.n_sentences:
            raise InputError(f"systems {first.name!r} and {other.name!r} have {first.result.n_sentences} and "
                             f"{other.result.n_sentences} sentences: not the same test set")
        if other.references_sha256 != first.references_sha256:
            raise InputError(f"systems {first.name!r} and {other.name!r} were scored against different "
                             "references (after detokenisation): not the same test set, or different "
                             "--remove-bpe/--detok-moses settings")


def compare_with_baseline(system: SystemScore, baseline: SystemScore, n_bootstrap: int = DEFAULT_N_BOOTSTRAP,
                          n_trials: int = DEFAULT_N_TRIALS, seed: int = DEFAULT_SEED) -> Dict:
    """sacreBLEU's paired tests of ``system`` against ``baseline``, as a score record's ``paired``."""
    check_comparable([system, baseline])
    comparison = compare_systems([(baseline.name, baseline.hypotheses), (system.name, system.hypotheses)],
                                 system.references, system.result.settings, n_bootstrap, n_trials, seed)
    base, row = comparison.rows
    return {"baseline": baseline.name, "baseline_bleu": base.score, "difference": row.score - base.score,
            "p_bootstrap": row.p_bootstrap, "p_randomization": row.p_randomization, "n_bootstrap": n_bootstrap,
            "n_trials": n_trials, "seed": seed, "signature": comparison.signature,
            "definition": PAIRED_TESTS_DEFINITION}


# --------------------------------------------------------------------------- formatting


def _or_dash(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_p_value(p_value: Optional[float]) -> str:
    """``p`` with four decimals, as sacreBLEU prints it."""
    return _or_dash(p_value, ".4f")


def format_mean_ci(mean: Optional[float], ci: Optional[float]) -> str:
    """sacreBLEU's ``mu +- half-width`` (its --confidence output, the A2D paper's tables)."""
    return "-" if mean is None else f"{mean:.2f} ± {ci:.2f}"


CHRF_DEFINITION = ("chrF and chrF++: sacreBLEU's CHRF of the same text (character 6-grams, beta 2; chrF++ adds word "
                   "2-grams: word_order 0 and 2).")
LENGTH_DEFINITION = ("Length: the hypotheses' length over the references' in BLEU's tokens (the brevity penalty's "
                     "ratio; above 1, BLEU's precisions pay for every extra word).")
SCORE_TABLE_HEADER = ("| System | BLEU | μ ± 95% CI | Baseline | Δ BLEU | p (bs) | p (ar) | Sentences | Signature "
                      "| chrF | chrF++ |")
SCORE_TABLE_RULE = "|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|"


def _cell(text: str) -> str:
    """A Markdown table cell: a literal "|" would end the cell (sacreBLEU signatures have many)."""
    return text.replace("|", "\\|")


def score_table_row(record: Dict) -> str:
    """One Markdown row of the running score table for a score record."""
    paired = record.get("paired")
    if paired:
        baseline = paired["baseline"]
        difference = f"{paired['difference']:+.2f}"
        p_bootstrap, p_randomization = format_p_value(paired["p_bootstrap"]), format_p_value(paired["p_randomization"])
    else:
        baseline = difference = p_bootstrap = p_randomization = "-"
    sentences = str(record["n_sentences"])
    if record.get("partial"):
        sentences = f"{record['n_sentences']} of {record['partial']['n_expected']} (partial)"
    cells = [record["system"], f"{record['bleu']:.2f}", format_mean_ci(record.get("mean"), record.get("ci")), baseline,
             difference, p_bootstrap, p_randomization, sentences, f"`{record['signature']}`", f"{record['chrf']:.2f}",
             f"{record['chrfpp']:.2f}"]
    return "| " + " | ".join(_cell(cell) for cell in cells) + " |"


def check_score_table(path: Path) -> bool:
    """Whether ``path`` needs a header (new or empty); raises if it is an unrelated file, so that
    rows are never appended to a document this command did not start."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return True
    with open(path, encoding="utf-8") as handle:
        first_line = handle.readline().rstrip("\n")
    if first_line != SCORE_TABLE_HEADER:
        raise InputError(f"--output-md {str(path)!r} exists but is not a score table written by this "
                         "command (its first line differs); choose another file")
    return False


def append_score_row(path: Path, record: Dict) -> None:
    """Append ``record`` to a Markdown score table, writing the header if the file is new."""
    needs_header = check_score_table(path)
    with open(path, "a", encoding="utf-8") as handle:
        if needs_header:
            handle.write(SCORE_TABLE_HEADER + "\n" + SCORE_TABLE_RULE + "\n")
        handle.write(score_table_row(record) + "\n")


def write_json(path: Path, data: Dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, ensure_ascii=False)
        handle.write("\n")


# --------------------------------------------------------------------------- the report


@dataclass
class ReportRow:
    """One system's line of the results table; ``None`` where not applicable or not given."""

    system: str
    is_baseline: bool
    bleu: float
    mean: Optional[float] = None
    ci: Optional[float] = None
    difference: Optional[float] = None
    p_bootstrap: Optional[float] = None
    p_randomization: Optional[float] = None
    #: (bleu - baseline's) / (teacher's - baseline's): the share of the teacher's lead this system closes
    lead_closed: Optional[float] = None
    params: Optional[int] = None
    sents_per_sec: Optional[float] = None
    chrf: Optional[float] = None
    chrfpp: Optional[float] = None
    #: hypothesis over reference length in BLEU's tokens: a short student's BLEU differences are often this
    length_ratio: Optional[float] = None


@dataclass
class Report:
    rows: List[ReportRow]
    baseline: Optional[str]
    n_bootstrap: int
    n_trials: int
    seed: int
    n_sentences: int
    signature: str
    # system name -> GenerateOutput.completeness() for systems scored on part of the test set
    partial: Dict[str, Dict] = field(default_factory=dict)
    #: what the table measures (printed above it), e.g. which BLEU a paper used
    title: Optional[str] = None
    #: the system whose lead over the baseline the others' ``lead_closed`` is a share of
    teacher: Optional[str] = None

    def to_dict(self) -> Dict:
        return {"format": REPORT_FORMAT, "title": self.title, "baseline": self.baseline,
                "teacher": self.teacher, "n_bootstrap": self.n_bootstrap, "n_trials": self.n_trials,
                "seed": self.seed,
                "n_sentences": self.n_sentences, "signature": self.signature, "interval": INTERVAL_DEFINITION,
                "paired_tests": PAIRED_TESTS_DEFINITION, "systems": [vars(row) for row in self.rows],
                "partial": self.partial}


def check_teacher(teacher: Optional[str], baseline: Optional[str], names: Sequence[str]) -> None:
    if teacher is not None and (baseline is None or teacher not in names or teacher == baseline):
        raise InputError(f"--teacher {teacher!r} needs --baseline and must be another of the systems {list(names)}")


def build_report(systems: Sequence[SystemScore], baseline: Optional[str] = None,
                 params: Optional[Dict[str, int]] = None, sents_per_sec: Optional[Dict[str, float]] = None,
                 n_bootstrap: int = DEFAULT_N_BOOTSTRAP, seed: int = DEFAULT_SEED,
                 n_trials: int = DEFAULT_N_TRIALS, teacher: Optional[str] = None) -> Report:
    """Results table for ``systems`` on one test set: one call of :func:`~.bleu.compare_systems`
    gives every system its interval (recomputed, so the table shares one seed) and the paired
    p-values against ``baseline``; with ``teacher``, each system's share of its lead."""
    if not systems:
        raise InputError("no systems given")
    names = [system.name for system in systems]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise InputError(f"system names must be unique; repeated: {', '.join(duplicates)}")
    params, sents_per_sec = dict(params or {}), dict(sents_per_sec or {})
    for flag, values in (("--params", params), ("--speed", sents_per_sec)):
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise InputError(f"{flag} names unknown systems {unknown}; systems are {names}")
    if baseline is not None and baseline not in names:
        raise InputError(f"--baseline {baseline!r} is not one of the systems {names}")
    check_teacher(teacher, baseline, names)
    check_n_bootstrap(n_bootstrap)
    check_n_trials(n_trials)
    if baseline is not None and not n_bootstrap:
        raise InputError("--baseline needs resampling for the paired test: use --bootstrap 1000, not 0")
    check_comparable(systems)

    by_name = {system.name: system for system in systems}
    rows = {
        system.name: ReportRow(system=system.name, is_baseline=system.name == baseline, bleu=system.result.score,
                               params=params.get(system.name), sents_per_sec=sents_per_sec.get(system.name),
                               length_ratio=system.length_ratio(), **system.chrf())
        for system in systems
    }
    if n_bootstrap:
        # sacreBLEU compares every system with the first one: the baseline goes first; without a
        # baseline only the intervals are kept.
        order = [baseline] + [name for name in names if name != baseline] if baseline else names
        comparison = compare_systems([(name, by_name[name].hypotheses) for name in order], systems[0].references,
                                     systems[0].result.settings, n_bootstrap, n_trials if baseline else 0, seed)
        signature = comparison.signature
        for result in comparison.rows:
            row = rows[result.system]
            row.bleu, row.mean, row.ci = result.score, result.mean, result.ci
            if baseline is not None and result.system != baseline:
                row.difference = result.score - by_name[baseline].result.score
                row.p_bootstrap, row.p_randomization = result.p_bootstrap, result.p_randomization
    else:
        first = systems[0]
        signature = score_corpus(first.hypotheses, first.references, first.result.settings, n_bootstrap=0).signature
    if teacher is not None:
        lead = rows[teacher].bleu - rows[baseline].bleu
        for name, row in rows.items():  # without a lead (a teacher no better than the baseline) no share
            if name not in (teacher, baseline) and lead > 0:
                row.lead_closed = (row.bleu - rows[baseline].bleu) / lead
    return Report(rows=[rows[name] for name in names], baseline=baseline, n_bootstrap=n_bootstrap,
                  n_trials=n_trials if baseline else 0, seed=seed, n_sentences=systems[0].result.n_sentences,
                  signature=signature, partial={system.name: system.partial for system in systems if system.partial},
                  teacher=teacher)


def format_params(params: Optional[int]) -> str:
    """Parameter counts as papers print them: 1.23M, 456.7K."""
    if params is None:
        return "-"
    if params >= 1e6:
        return f"{params / 1e6:.2f}M"
    if params >= 1e3:
        return f"{params / 1e3:.1f}K"
    return str(params)


def report_markdown(report: Report) -> str:
    """The table in Markdown, followed by the signature and the definitions used."""
    difference_header = f"Δ vs {report.baseline}" if report.baseline else "Δ"
    lines = [report.title, ""] if report.title else []
    lead_header = " Lead closed |" if report.teacher else ""
    lines += [
        f"| System | BLEU | μ ± 95% CI | {difference_header} | p (bs) | p (ar) |{lead_header} Params | Speed (sent/s) "
        "| chrF | chrF++ | Length |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if report.teacher else "") + "---:|---:|---:|---:|---:|",
    ]
    for row in report.rows:
        name = _cell(f"{row.system} (baseline)" if row.is_baseline else row.system)
        cells = [name, f"{row.bleu:.2f}", format_mean_ci(row.mean, row.ci), _or_dash(row.difference, "+.2f"),
                 format_p_value(row.p_bootstrap), format_p_value(row.p_randomization)]
        if report.teacher:
            cells.append("-" if row.lead_closed is None else f"{100 * row.lead_closed:.0f}%")
        cells += [format_params(row.params), _or_dash(row.sents_per_sec, ".1f"), _or_dash(row.chrf, ".2f"),
                  _or_dash(row.chrfpp, ".2f"), _or_dash(row.length_ratio, ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"sacreBLEU signature: `{report.signature}`; {report.n_sentences} sentences. {CHRF_DEFINITION} "
                 f"{LENGTH_DEFINITION}")
    for name, info in report.partial.items():
        lines.append(f"PARTIAL: {name} was scored on {info['n_sentences']} of {info['n_expected']} "
                     f"expected sentences ({'; '.join(info['problems'])}).")
    if report.n_bootstrap:
        lines.append(f"{INTERVAL_DEFINITION}, {report.n_bootstrap} resamples, seed {report.seed}.")
    if report.baseline:
        lines.append(f"{PAIRED_TESTS_DEFINITION} Against {report.baseline}: {report.n_bootstrap} resamples, "
                     f"{report.n_trials} trials. Re-check: SACREBLEU_SEED={report.seed} sacrebleu REF -i "
                     f"{report.baseline} OTHERS... --paired-bs (or --paired-ar) on the detokenised text (it counts no ties).")
    if report.teacher:
        lines.append(f"Lead closed: (BLEU - {report.baseline}'s) / ({report.teacher}'s - {report.baseline}'s), the "
                     f"share of {report.teacher}'s lead over {report.baseline} that a system closes"
                     + ("." if any(row.lead_closed is not None for row in report.rows)
                        else f" (none here: {report.teacher} does not beat {report.baseline})."))
    return "\n".join(lines) + "\n"


CSV_COLUMNS = [column.name for column in fields(ReportRow)]


def report_csv(report: Report) -> str:
    """Full-precision numbers, one row per system; empty cells where not applicable."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in report.rows:
        writer.writerow({key: ("" if value is None else value) for key, value in vars(row).items()})
    return buffer.getvalue()


def report_paths(out_prefix: Path) -> Dict[str, Path]:
    out_prefix = Path(out_prefix)
    return {ext: out_prefix.with_name(out_prefix.name + "." + ext) for ext in ("md", "csv", "json")}


def write_report(report: Report, out_prefix: Path, overwrite: bool = False) -> Dict[str, Path]:
    """Write ``<prefix>.md``, ``<prefix>.csv`` and ``<prefix>.json``; refuses to replace existing
    files unless ``overwrite``."""
    paths = report_paths(out_prefix)
    check_outputs_free(paths.values(), overwrite, "--out-prefix")
    paths["md"].parent.mkdir(parents=True, exist_ok=True)
    paths["md"].write_text(report_markdown(report), encoding="utf-8")
    paths["csv"].write_text(report_csv(report), encoding="utf-8")
    write_json(paths["json"], report.to_dict())
    return paths


def check_outputs_free(paths, overwrite: bool, flag: str) -> None:
    existing = [str(path) for path in paths if Path(path).exists()]
    if existing and not overwrite:
        raise InputError(f"{flag}: {', '.join(existing)} already exist(s); pass --overwrite to replace")


def read_sidecar(path: Path) -> Dict[str, Dict]:
    """Per-system extras: ``{"name": {"params": 12345678, "sents_per_sec": 85.2}, ...}``."""
    path = Path(path)
    data = load_json(path, "--sidecar file")
    if not isinstance(data, dict) or not all(isinstance(value, dict) for value in data.values()):
        raise InputError(f'--sidecar {path}: expected {{"system": {{"params": N, "sents_per_sec": X}}, ...}}')
    for name, values in data.items():
        unknown = sorted(set(values) - {"params", "sents_per_sec"})
        if unknown:
            raise InputError(f"--sidecar {path}: system {name!r} has unknown keys {unknown}; "
                             "allowed: params, sents_per_sec")
        for key, kinds, what in (("params", int, "integer"), ("sents_per_sec", (int, float), "number")):
            value = values.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kinds) or value < 0):
                raise InputError(f"--sidecar {path}: {name}.{key} must be a non-negative {what}, got {value!r}")
    return data
