"""Score records (what ``fairseq-kd-score`` writes) and the paper-style results table
(what ``fairseq-kd-report`` writes).

A score record is a JSON object (format :data:`SCORE_FORMAT`)::

    {"format": "fairseq-kd-score/1", "system": "word_kd", "bleu": 37.0, "ci_low": 36.2,
     "ci_high": 37.8, "bootstrap_mean": 37.0, "n_bootstrap": 1000, "seed": 12345,
     "signature": "nrefs:1|bs:1000|seed:12345|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
     "verbose": "68.6/45.1/31.2/21.9 (BP = 1.000 ...)", "n_sentences": 6750,
     "settings": {"tokenize": "13a", "lowercase": false, "smooth_method": "exp", "smooth_value": null},
     "references_sha256": "...", "inputs": {...how the text was read and detokenised...},
     "paired": null or {"baseline": "no_kd", "difference": ..., "p_value": ..., ...},
     "partial": null, or for a score of an incomplete output (--allow-partial only)
                {"complete": false, "n_sentences": 24, "n_expected": 30, "problems": [...]},
     "sentence_stats": {"columns": ["hyp_len", "ref_len", "matches_1", ...], "rows": [[...], ...]}}

It keeps each sentence's BLEU sufficient statistics rather than the text: that is all a later
bootstrap interval or paired test needs (BLEU of any resample is a function of the summed rows),
it is smaller than the text, and it cannot be scored by mistake with other tokenisation settings:
``settings`` and ``references_sha256`` (SHA-256 of the scored, detokenised references joined by
newlines) are checked before two records are compared.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from .bleu import (
    DEFAULT_N_BOOTSTRAP,
    DEFAULT_SEED,
    PAIRED_TEST_DEFINITION,
    STATISTIC_COLUMNS,
    BleuResult,
    BleuSettings,
    BootstrapResampler,
    PairedBootstrapResult,
    bleu_from_statistics,
    bleu_signature,
    check_n_bootstrap,
    corpus_bleu_from_statistics,
    paired_bootstrap,
    percentile_interval,
    score_corpus,
    statistics_from_rows,
    statistics_to_rows,
)
from .detok import detokenize_lines, read_generate_output, read_lines
from .files import naming_decode_errors, not_a_file

SCORE_FORMAT = "fairseq-kd-score/1"
REPORT_FORMAT = "fairseq-kd-report/1"


@dataclass(frozen=True)
class TextProcessing:
    """How system output and references are turned into plain text before scoring."""

    remove_bpe: str = "none"
    moses_lang: Optional[str] = None

    def apply(self, lines: Sequence[str]) -> List[str]:
        return detokenize_lines(lines, self.remove_bpe, self.moses_lang)

    def to_dict(self) -> Dict:
        return {"remove_bpe": self.remove_bpe, "detok_moses": self.moses_lang}


def references_fingerprint(references: Sequence[str]) -> str:
    """SHA-256 of the scored references, one per line: equal only for the same test set."""
    return hashlib.sha256("\n".join(references).encode("utf-8")).hexdigest()


@dataclass
class SystemScore:
    """One system's BLEU on a test set, from text just scored or from a stored score record."""

    name: str
    result: BleuResult
    references_sha256: str
    inputs: Dict = field(default_factory=dict)
    # None when every sentence of the test set was scored; else GenerateOutput.completeness()
    partial: Optional[Dict] = None

    def partial_note(self) -> Optional[str]:
        if not self.partial:
            return None
        return (f"PARTIAL: {self.name} scored {self.partial['n_sentences']} of "
                f"{self.partial['n_expected']} expected sentences ({'; '.join(self.partial['problems'])})")


def score_texts(
    name: str,
    hypotheses: Sequence[str],
    references: Sequence[str],
    settings: BleuSettings,
    n_bootstrap: int,
    seed: int,
    inputs: Optional[Dict] = None,
) -> SystemScore:
    result = score_corpus(hypotheses, references, settings, n_bootstrap, seed)
    return SystemScore(name, result, references_fingerprint(references), dict(inputs or {}))


def score_generate_output(
    name: str, path: Path, processing: TextProcessing, settings: BleuSettings, n_bootstrap: int, seed: int,
    expected_sentences: Optional[int] = None, allow_partial: bool = False,
) -> SystemScore:
    """Score a fairseq-generate output file (see :func:`~.detok.read_generate_output`); an
    incomplete one is refused unless ``allow_partial`` (the score then says it is partial)."""
    generated = read_generate_output(path, expected_sentences, allow_partial)
    inputs = {
        "generate_output": str(path),
        "hypothesis_lines": generated.hypothesis_source + "-",
        **processing.to_dict(),
    }
    system = score_texts(
        name,
        processing.apply(generated.hypotheses),
        processing.apply(generated.references),
        settings,
        n_bootstrap,
        seed,
        inputs,
    )
    system.partial = None if generated.complete else generated.completeness()
    return system


def score_text_files(
    name: str,
    hyp_path: Path,
    ref_path: Path,
    processing: TextProcessing,
    settings: BleuSettings,
    n_bootstrap: int,
    seed: int,
    ref_is_plain: bool = False,
) -> SystemScore:
    """Score a hypothesis file against a reference file, line by line.

    The same ``processing`` is applied to both files unless ``ref_is_plain`` says the reference
    is already plain, detokenised text.
    """
    hypotheses = read_lines(hyp_path, "--hyp")
    references = read_lines(ref_path, "--ref")
    if not hypotheses:
        raise ValueError(f"--hyp file {str(hyp_path)!r} is empty")
    if not references:
        raise ValueError(f"--ref file {str(ref_path)!r} is empty")
    if len(hypotheses) != len(references):
        raise ValueError(
            f"--hyp file {str(hyp_path)!r} has {len(hypotheses)} lines but --ref file "
            f"{str(ref_path)!r} has {len(references)}; they must be line-parallel"
        )
    inputs = {"hyp": str(hyp_path), "ref": str(ref_path), "ref_is_plain": ref_is_plain, **processing.to_dict()}
    references = references if ref_is_plain else processing.apply(references)
    return score_texts(
        name, processing.apply(hypotheses), references, settings, n_bootstrap, seed, inputs
    )


# --------------------------------------------------------------------------- score records


def score_record(system: SystemScore, paired: Optional[Dict] = None) -> Dict:
    """The JSON-serialisable score record of ``system`` (format described in the module doc)."""
    result = system.result
    return {
        "format": SCORE_FORMAT,
        "system": system.name,
        "bleu": result.score,
        "ci_low": result.ci_low,
        "ci_high": result.ci_high,
        "bootstrap_mean": result.bootstrap_mean,
        "n_bootstrap": result.n_bootstrap,
        "seed": result.seed,
        "signature": result.signature,
        "verbose": result.verbose,
        "n_sentences": result.n_sentences,
        "settings": result.settings.to_dict(),
        "references_sha256": system.references_sha256,
        "inputs": system.inputs,
        "paired": paired,
        "partial": system.partial,
        "sentence_stats": {
            "columns": list(STATISTIC_COLUMNS),
            "rows": statistics_to_rows(result.sentence_stats),
        },
    }


def is_score_record_file(path: Path) -> bool:
    """Whether ``path`` holds a JSON object (a score record) rather than fairseq-generate text."""
    with naming_decode_errors(path), open(path, encoding="utf-8", errors="ignore") as handle:
        head = handle.read(4096).lstrip()
    return head.startswith("{")


def load_score_record(path: Path, name: Optional[str] = None) -> SystemScore:
    """Read a score record written by ``fairseq-kd-score --output-json``.

    ``name`` overrides the system name stored in it. The statistics are validated against the
    stored BLEU: a record edited by hand or truncated fails here, not in a table.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"score record {str(path)!r} {not_a_file(path)}")
    try:
        with naming_decode_errors(path, "score record"), open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(record, dict) or record.get("format") != SCORE_FORMAT:
        raise ValueError(
            f"{path}: not a score record (expected \"format\": \"{SCORE_FORMAT}\"); write one "
            "with fairseq-kd-score --output-json"
        )
    missing = [
        key
        for key in ("system", "bleu", "signature", "settings", "references_sha256", "sentence_stats")
        if key not in record
    ]
    if missing:
        raise ValueError(f"{path}: score record lacks {', '.join(missing)}")
    stored_columns = record["sentence_stats"].get("columns")
    if stored_columns != list(STATISTIC_COLUMNS):
        raise ValueError(f"{path}: sentence_stats columns {stored_columns} are not {list(STATISTIC_COLUMNS)}")
    stats = statistics_from_rows(record["sentence_stats"].get("rows"), str(path))
    try:
        settings = BleuSettings(**record["settings"])
    except TypeError as error:
        raise ValueError(f"{path}: bad settings {record['settings']} ({error})") from None
    recomputed = corpus_bleu_from_statistics(stats, settings)
    if not np.isclose(recomputed, record["bleu"], rtol=0, atol=1e-9):
        raise ValueError(
            f"{path}: stored BLEU {record['bleu']} does not match its sentence statistics "
            f"({recomputed}); the record was changed after it was written"
        )
    result = BleuResult(
        score=record["bleu"],
        signature=record["signature"],
        verbose=record.get("verbose", ""),
        n_sentences=stats.shape[0],
        settings=settings,
        sentence_stats=stats,
        n_bootstrap=record.get("n_bootstrap") or 0,
        seed=record.get("seed"),
        ci_low=record.get("ci_low"),
        ci_high=record.get("ci_high"),
        bootstrap_mean=record.get("bootstrap_mean"),
    )
    inputs = dict(record.get("inputs") or {}, score_record=str(path))
    return SystemScore(name or record["system"], result, record["references_sha256"], inputs,
                       record.get("partial") or None)


def load_system(
    name: str,
    path: Path,
    processing: TextProcessing,
    settings: BleuSettings,
    n_bootstrap: int,
    seed: int,
    expected_sentences: Optional[int] = None,
    allow_partial: bool = False,
) -> SystemScore:
    """A system from a score record (JSON) or a fairseq-generate output file (anything else).

    Partial scores (an incomplete generate output, or a record written with --allow-partial) and
    records of another sentence count than ``expected_sentences`` are refused unless
    ``allow_partial``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"system {name!r}: file {str(path)!r} {not_a_file(path)}")
    if not is_score_record_file(path):
        return score_generate_output(name, path, processing, settings, n_bootstrap, seed,
                                     expected_sentences, allow_partial)
    system = load_score_record(path, name)
    if not allow_partial:
        if system.partial:
            raise ValueError(
                f"system {name!r}: score record {str(path)!r} is a partial score "
                f"({system.partial['n_sentences']} of {system.partial['n_expected']} sentences); "
                "score a complete output, or pass --allow-partial"
            )
        if expected_sentences is not None and system.result.n_sentences != expected_sentences:
            raise ValueError(
                f"system {name!r}: score record {str(path)!r} has {system.result.n_sentences} "
                f"sentences but {expected_sentences} are expected; pass --allow-partial to use it anyway"
            )
    return system


def check_comparable(systems: Sequence[SystemScore]) -> None:
    """Raise unless all systems were scored on the same references with the same settings."""
    first = systems[0]
    for other in systems[1:]:
        if other.result.settings != first.result.settings:
            raise ValueError(
                f"systems {first.name!r} and {other.name!r} were scored with different sacreBLEU "
                f"settings ({first.result.settings.to_dict()} vs {other.result.settings.to_dict()}); "
                "score them with the same --tokenize/--lowercase"
            )
        if other.result.n_sentences != first.result.n_sentences:
            raise ValueError(
                f"systems {first.name!r} and {other.name!r} have {first.result.n_sentences} and "
                f"{other.result.n_sentences} sentences: not the same test set"
            )
        if other.references_sha256 != first.references_sha256:
            raise ValueError(
                f"systems {first.name!r} and {other.name!r} were scored against different "
                "references (after detokenisation): not the same test set, or different "
                "--remove-bpe/--detok-moses settings"
            )


def paired_record(baseline_name: str, paired: PairedBootstrapResult) -> Dict:
    return {"baseline": baseline_name, **paired.to_dict()}


def compare_with_baseline(system: SystemScore, baseline: SystemScore) -> PairedBootstrapResult:
    """Paired bootstrap of ``system`` against ``baseline`` on the resamples of ``system``'s run."""
    check_comparable([system, baseline])
    result = system.result
    if not result.n_bootstrap:
        raise ValueError("a paired bootstrap test needs resampling: use --bootstrap 1000, not 0")
    return paired_bootstrap(
        result.sentence_stats,
        baseline.result.sentence_stats,
        result.settings,
        result.n_bootstrap,
        result.seed,
    )


# --------------------------------------------------------------------------- formatting


def format_p_value(p_value: Optional[float], n_bootstrap: int) -> str:
    """``p`` with three decimals; 0 resamples against is shown as ``< 1/n`` (the resolution)."""
    if p_value is None:
        return "-"
    if p_value == 0:
        return f"< {1 / n_bootstrap:.3g}"
    return f"{p_value:.3f}"


def format_interval(low: Optional[float], high: Optional[float]) -> str:
    return "-" if low is None else f"[{low:.2f}, {high:.2f}]"


SCORE_TABLE_HEADER = "| System | BLEU | 95% CI | Baseline | Δ BLEU | p | Sentences | Signature |"
SCORE_TABLE_RULE = "|---|---:|---|---|---:|---:|---:|---|"


def _cell(text: str) -> str:
    """A Markdown table cell: a literal "|" would end the cell (sacreBLEU signatures have many)."""
    return text.replace("|", "\\|")


def score_table_row(record: Dict) -> str:
    """One Markdown row of the running score table for a score record."""
    paired = record.get("paired")
    if paired:
        baseline = paired["baseline"]
        difference = f"{paired['difference']:+.2f}"
        p_value = format_p_value(paired["p_value"], paired["n_bootstrap"])
    else:
        baseline = difference = p_value = "-"
    sentences = str(record["n_sentences"])
    if record.get("partial"):
        sentences = f"{record['n_sentences']} of {record['partial']['n_expected']} (partial)"
    cells = [
        record["system"],
        f"{record['bleu']:.2f}",
        format_interval(record.get("ci_low"), record.get("ci_high")),
        baseline,
        difference,
        p_value,
        sentences,
        f"`{record['signature']}`",
    ]
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
        raise ValueError(
            f"--output-md {str(path)!r} exists but is not a score table written by this "
            "command (its first line differs); choose another file"
        )
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
    ci_low: Optional[float]
    ci_high: Optional[float]
    difference: Optional[float]
    difference_ci_low: Optional[float]
    difference_ci_high: Optional[float]
    p_value: Optional[float]
    params: Optional[int]
    sents_per_sec: Optional[float]


@dataclass
class Report:
    rows: List[ReportRow]
    baseline: Optional[str]
    n_bootstrap: int
    seed: int
    n_sentences: int
    signature: str
    # system name -> GenerateOutput.completeness() for systems scored on part of the test set
    partial: Dict[str, Dict] = field(default_factory=dict)

    def to_dict(self) -> Dict:
        return {
            "format": REPORT_FORMAT,
            "baseline": self.baseline,
            "n_bootstrap": self.n_bootstrap,
            "seed": self.seed,
            "n_sentences": self.n_sentences,
            "signature": self.signature,
            "interval": "95% bootstrap percentile interval (sacreBLEU's order statistics)",
            "paired_test": PAIRED_TEST_DEFINITION,
            "systems": [vars(row) for row in self.rows],
            "partial": self.partial,
        }


def build_report(
    systems: Sequence[SystemScore],
    baseline: Optional[str] = None,
    params: Optional[Dict[str, int]] = None,
    sents_per_sec: Optional[Dict[str, float]] = None,
    n_bootstrap: int = DEFAULT_N_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
) -> Report:
    """Results table for ``systems`` on one test set.

    Every interval and p-value comes from one set of ``n_bootstrap`` resamples drawn with
    ``seed`` and shared by all systems (intervals stored in score records are recomputed, so the
    whole table is consistent); BLEU itself is the full-corpus score. ``baseline`` names the
    system every other one is compared with (difference, its interval, paired p-value).
    """
    if not systems:
        raise ValueError("no systems given")
    names = [system.name for system in systems]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"system names must be unique; repeated: {', '.join(duplicates)}")
    params, sents_per_sec = dict(params or {}), dict(sents_per_sec or {})
    for flag, values in (("--params", params), ("--speed", sents_per_sec)):
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"{flag} names unknown systems {unknown}; systems are {names}")
    if baseline is not None and baseline not in names:
        raise ValueError(f"--baseline {baseline!r} is not one of the systems {names}")
    check_n_bootstrap(n_bootstrap)
    if baseline is not None and not n_bootstrap:
        raise ValueError("--baseline needs resampling for the paired test: use --bootstrap 1000, not 0")
    check_comparable(systems)

    settings = systems[0].result.settings
    resampler = BootstrapResampler(systems[0].result.n_sentences, n_bootstrap, seed) if n_bootstrap else None
    by_name = {system.name: system for system in systems}
    rows = []
    for system in systems:
        stats = system.result.sentence_stats
        row = ReportRow(
            system=system.name,
            is_baseline=system.name == baseline,
            bleu=corpus_bleu_from_statistics(stats, settings),
            ci_low=None,
            ci_high=None,
            difference=None,
            difference_ci_low=None,
            difference_ci_high=None,
            p_value=None,
            params=params.get(system.name),
            sents_per_sec=sents_per_sec.get(system.name),
        )
        if resampler is not None:
            scores = bleu_from_statistics(
                resampler.resample_sums(stats), settings.smooth_method, settings.smooth_value
            )
            row.ci_low, row.ci_high = percentile_interval(scores)
        if baseline is not None and system.name != baseline:
            paired = paired_bootstrap(
                stats, by_name[baseline].result.sentence_stats, settings, n_bootstrap, seed, resampler
            )
            row.difference = paired.difference
            row.difference_ci_low = paired.difference_ci_low
            row.difference_ci_high = paired.difference_ci_high
            row.p_value = paired.p_value
        rows.append(row)
    return Report(
        rows=rows,
        baseline=baseline,
        n_bootstrap=n_bootstrap,
        seed=seed,
        n_sentences=systems[0].result.n_sentences,
        signature=bleu_signature(settings, n_bootstrap, seed),
        partial={system.name: system.partial for system in systems if system.partial},
    )


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
    lines = [
        f"| System | BLEU | 95% CI | {difference_header} | p | Params | Speed (sent/s) |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in report.rows:
        name = _cell(f"{row.system} (baseline)" if row.is_baseline else row.system)
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    f"{row.bleu:.2f}",
                    format_interval(row.ci_low, row.ci_high),
                    "-" if row.difference is None else f"{row.difference:+.2f}",
                    format_p_value(row.p_value, report.n_bootstrap),
                    format_params(row.params),
                    "-" if row.sents_per_sec is None else f"{row.sents_per_sec:.1f}",
                ]
            )
            + " |"
        )
    lines.append("")
    lines.append(f"sacreBLEU signature: `{report.signature}`; {report.n_sentences} sentences.")
    for name, info in report.partial.items():
        lines.append(f"PARTIAL: {name} was scored on {info['n_sentences']} of {info['n_expected']} "
                     f"expected sentences ({'; '.join(info['problems'])}).")
    if report.n_bootstrap:
        lines.append(
            f"95% CI: bootstrap percentile interval over {report.n_bootstrap} resamples "
            f"(seed {report.seed}); p: paired bootstrap against {report.baseline or 'no baseline'}, "
            "share of resamples where the better system is not strictly better (Koehn 2004)."
        )
    return "\n".join(lines) + "\n"


CSV_COLUMNS = [
    "system",
    "is_baseline",
    "bleu",
    "ci_low",
    "ci_high",
    "difference",
    "difference_ci_low",
    "difference_ci_high",
    "p_value",
    "params",
    "sents_per_sec",
]


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
        raise FileExistsError(
            f"{flag}: {', '.join(existing)} already exist(s); pass --overwrite to replace"
        )


def read_sidecar(path: Path) -> Dict[str, Dict]:
    """Per-system extras: ``{"name": {"params": 12345678, "sents_per_sec": 85.2}, ...}``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--sidecar file {str(path)!r} {not_a_file(path)}")
    try:
        with naming_decode_errors(path, "--sidecar file"), open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"--sidecar {path}: not valid JSON ({error})") from None
    if not isinstance(data, dict) or not all(isinstance(value, dict) for value in data.values()):
        raise ValueError(
            f'--sidecar {path}: expected {{"system": {{"params": N, "sents_per_sec": X}}, ...}}'
        )
    for name, values in data.items():
        unknown = sorted(set(values) - {"params", "sents_per_sec"})
        if unknown:
            raise ValueError(
                f"--sidecar {path}: system {name!r} has unknown keys {unknown}; "
                "allowed: params, sents_per_sec"
            )
        params = values.get("params")
        if params is not None and (isinstance(params, bool) or not isinstance(params, int) or params < 0):
            raise ValueError(f"--sidecar {path}: {name}.params must be a non-negative integer, got {params!r}")
        speed = values.get("sents_per_sec")
        if speed is not None and (isinstance(speed, bool) or not isinstance(speed, (int, float)) or speed < 0):
            raise ValueError(f"--sidecar {path}: {name}.sents_per_sec must be a non-negative number, got {speed!r}")
    return data
