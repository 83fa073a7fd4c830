"""Corpus BLEU with sacreBLEU, bootstrap confidence intervals and paired bootstrap significance.

The point estimate is computed by sacreBLEU's own code, the two steps of ``BLEU.corpus_score``
(Papineni et al. 2002 as sacreBLEU implements it; Post 2018), so it equals
``sacrebleu.corpus_bleu`` exactly, and the signature is the one sacreBLEU builds.

Bootstrap resampling (Koehn 2004, "Statistical Significance Tests for Machine Translation
Evaluation") never re-runs sacreBLEU. Corpus BLEU is a function of ten corpus sums (hypothesis
length, closest reference length, matched and total n-grams for n = 1..4), and each sum is a sum
over sentences, so each sentence's ten numbers are extracted once (by sacreBLEU), and a resample's
sums are ``multiplicities @ sentence_statistics``, where ``multiplicities[b, i]`` counts how often
sentence ``i`` was drawn in resample ``b``. :func:`bleu_from_statistics` then evaluates sacreBLEU's
``BLEU.compute_bleu`` formula (brevity penalty, smoothing, geometric mean) for all resamples at
once with numpy.

The resamples are the very draws sacreBLEU itself makes for ``--confidence`` and
``--paired-bs``: ``np.random.default_rng(seed).choice(n, size=(n_samples, n), replace=True)``,
with sacreBLEU's default seed 12345. The interval is the percentile interval sacreBLEU uses
(the ``n // 40``-th smallest and largest resampled scores; for 1,000 resamples the 26th smallest
and the 26th largest), so ``(ci_high - ci_low) / 2`` is the "±" sacreBLEU prints for the same
seed and number of resamples.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
from sacrebleu.metrics.bleu import BLEU, MAX_NGRAM_ORDER, BLEUSignature

DEFAULT_SEED = 12345  # sacreBLEU's default SACREBLEU_SEED
DEFAULT_N_BOOTSTRAP = 1000
MIN_N_BOOTSTRAP = 40  # a 95% percentile interval cuts 1 in 40 resamples on each side

# sacrebleu.utils.my_log returns this instead of log(0); reproduced for identical scores.
_LOG_OF_ZERO = -9999999999.0

STATISTIC_COLUMNS = (
    ["hyp_len", "ref_len"]
    + [f"matches_{n}" for n in range(1, MAX_NGRAM_ORDER + 1)]
    + [f"totals_{n}" for n in range(1, MAX_NGRAM_ORDER + 1)]
)

PAIRED_TEST_DEFINITION = (
    "Paired bootstrap (Koehn 2004): both systems are scored on the same resamples of sentence "
    "indices; difference = BLEU(system) - BLEU(baseline). If the full-corpus difference is "
    "positive, p = share of resamples whose difference is <= 0; if negative, share >= 0; if zero, "
    "p = 1. That is, p is the share of resamples on which the better system on the full test set "
    "is not strictly better (one-sided; ties count against it)."
)


@dataclass(frozen=True)
class BleuSettings:
    """The sacreBLEU options that change the score (all part of its signature)."""

    tokenize: str = BLEU.TOKENIZER_DEFAULT
    lowercase: bool = False
    smooth_method: str = "exp"
    smooth_value: Optional[float] = None

    def __post_init__(self):
        if self.tokenize not in BLEU.TOKENIZERS:
            raise ValueError(
                f"unknown sacreBLEU tokenizer {self.tokenize!r}; choose one of "
                f"{', '.join(sorted(BLEU.TOKENIZERS))}"
            )
        if self.smooth_method not in BLEU.SMOOTH_DEFAULTS:
            raise ValueError(
                f"unknown smoothing method {self.smooth_method!r}; choose one of "
                f"{', '.join(BLEU.SMOOTH_DEFAULTS)}"
            )

    def make_metric(self) -> BLEU:
        return BLEU(
            tokenize=self.tokenize,
            lowercase=self.lowercase,
            smooth_method=self.smooth_method,
            smooth_value=self.smooth_value,
        )

    def to_dict(self) -> Dict:
        return asdict(self)


def bleu_signature(settings: BleuSettings, n_bootstrap: int = 0, seed: Optional[int] = None) -> str:
    """sacreBLEU's signature for ``settings`` with one reference per sentence (all this project
    scores), built by sacreBLEU's own ``BLEUSignature`` from the metric's attributes as
    ``BLEU.get_signature`` does; ``bs``/``seed`` appear when resampling was on, as after
    ``corpus_score(n_bootstrap=...)``. For tables whose scores come from stored statistics."""
    metric = settings.make_metric()
    attributes = dict(vars(metric), num_refs=1)
    if n_bootstrap:
        attributes.update(n_bootstrap=n_bootstrap, seed=str(seed).lower())
    return BLEUSignature(attributes).format()


def check_n_bootstrap(n_bootstrap: int) -> None:
    if n_bootstrap != 0 and n_bootstrap < MIN_N_BOOTSTRAP:
        raise ValueError(
            f"--bootstrap {n_bootstrap}: use 0 to switch resampling off, or at least "
            f"{MIN_N_BOOTSTRAP} resamples (a 95% interval drops 1 in 40 on each side); "
            f"{DEFAULT_N_BOOTSTRAP} is usual"
        )


class BootstrapResampler:
    """``n_samples`` resamples, with replacement, of ``n_sentences`` sentence indices.

    The draws are sacreBLEU's (same generator call, same seed convention), so the resampled
    scores equal those of ``sacrebleu --confidence``. They are kept as a dense
    ``(n_samples, n_sentences)`` float64 matrix of multiplicities (56 MB for 1,000 resamples of
    7,000 sentences): one matrix product then gives every resample's corpus sums, exactly, for
    any number of systems scored on the same resamples. ``indices`` keeps the draws themselves,
    one row per resample, so that any resample can be rescored from the text.
    """

    def __init__(self, n_sentences: int, n_samples: int = DEFAULT_N_BOOTSTRAP, seed: int = DEFAULT_SEED):
        if n_sentences < 1:
            raise ValueError("cannot resample an empty test set")
        check_n_bootstrap(n_samples)
        if n_samples == 0:
            raise ValueError("a resampler needs at least one resample")
        self.n_sentences = n_sentences
        self.n_samples = n_samples
        self.seed = seed
        rng = np.random.default_rng(seed)
        indices = rng.choice(n_sentences, size=(n_samples, n_sentences), replace=True)
        offsets = np.arange(n_samples)[:, None] * n_sentences
        self.multiplicities = (
            np.bincount((indices + offsets).ravel(), minlength=n_samples * n_sentences)
            .reshape(n_samples, n_sentences)
            .astype(np.float64)
        )
        self.indices = indices

    def resample_sums(self, sentence_stats: np.ndarray) -> np.ndarray:
        """Corpus sums of each resample: ``(n_samples, n_columns)``; exact for integer stats."""
        sentence_stats = np.asarray(sentence_stats, dtype=np.float64)
        if sentence_stats.shape[0] != self.n_sentences:
            raise ValueError(
                f"statistics for {sentence_stats.shape[0]} sentences given to a resampler built "
                f"for {self.n_sentences}"
            )
        return self.multiplicities @ sentence_stats


def bleu_from_statistics(
    sums: np.ndarray,
    smooth_method: str = "exp",
    smooth_value: Optional[float] = None,
    max_ngram_order: int = MAX_NGRAM_ORDER,
) -> np.ndarray:
    """sacreBLEU's ``BLEU.compute_bleu`` (effective_order off, as for corpus BLEU), vectorised.

    ``sums``: ``(..., 2 + 2 * max_ngram_order)`` rows of ``[hyp_len, ref_len, matches_1..N,
    totals_1..N]``. Reproduces sacreBLEU step by step: brevity penalty ``exp(1 - r / c)`` when
    ``c < r`` (0 when ``c = 0``); score 0 when no n-gram matches at all; precision ``100 m / t``;
    for an order with ``m = 0``: ``exp`` smoothing (NIST) gives ``100 / (2^k t)`` for the ``k``-th
    such order, ``floor`` gives ``100 v / t``, ``none`` gives 0; ``add-k`` adds ``k`` to matches
    and totals of orders 2..N first; from the first order with ``t = 0`` on, precisions are 0;
    a zero precision contributes ``-9999999999`` to the log sum, as sacreBLEU's ``my_log``.
    """
    sums = np.asarray(sums, dtype=np.float64)
    if sums.shape[-1] != 2 + 2 * max_ngram_order:
        raise ValueError(
            f"expected {2 + 2 * max_ngram_order} statistics per row, got {sums.shape[-1]}"
        )
    if smooth_value is None:
        smooth_value = BLEU.SMOOTH_DEFAULTS[smooth_method]
    sys_len = sums[..., 0]
    ref_len = sums[..., 1]
    matches = sums[..., 2 : 2 + max_ngram_order].copy()
    totals = sums[..., 2 + max_ngram_order :].copy()
    any_match = (matches > 0).any(axis=-1)  # sacreBLEU checks this before add-k smoothing

    with np.errstate(divide="ignore", invalid="ignore"):
        shortfall = np.exp(1.0 - ref_len / sys_len)
    brevity_penalty = np.where(sys_len < ref_len, np.where(sys_len > 0, shortfall, 0.0), 1.0)

    if smooth_method == "add-k":
        matches[..., 1:] += smooth_value
        totals[..., 1:] += smooth_value

    log_sum = np.zeros(sys_len.shape)
    still_counting = np.ones(sys_len.shape, dtype=bool)  # sacreBLEU stops at the first empty order
    nist_factor = np.ones(sys_len.shape)
    for order in range(max_ngram_order):
        total = totals[..., order]
        match = matches[..., order]
        still_counting &= total > 0
        no_match = still_counting & (match == 0)
        safe_total = np.where(total > 0, total, 1.0)
        precision = np.where(still_counting & ~no_match, 100.0 * match / safe_total, 0.0)
        if smooth_method == "exp":
            nist_factor = np.where(no_match, nist_factor * 2, nist_factor)
            precision = np.where(no_match, 100.0 / (nist_factor * safe_total), precision)
        elif smooth_method == "floor":
            precision = np.where(no_match, 100.0 * smooth_value / safe_total, precision)
        with np.errstate(divide="ignore"):
            log_precision = np.where(precision > 0, np.log(np.where(precision > 0, precision, 1.0)), _LOG_OF_ZERO)
        log_sum = log_sum + log_precision
    scores = brevity_penalty * np.exp(log_sum / max_ngram_order)
    return np.where(any_match, scores, 0.0)


def percentile_interval(scores: np.ndarray) -> tuple:
    """95% percentile interval with sacreBLEU's order statistics (``n // 40`` from each end)."""
    ordered = np.sort(np.asarray(scores, dtype=np.float64))
    cut = len(ordered) // 40
    return float(ordered[cut]), float(ordered[len(ordered) - cut - 1])


def corpus_bleu_from_statistics(sentence_stats: np.ndarray, settings: BleuSettings) -> float:
    """Full-corpus BLEU from per-sentence statistics through sacreBLEU's own formula."""
    sums = np.asarray(sentence_stats, dtype=np.int64).sum(axis=0).tolist()
    order = MAX_NGRAM_ORDER
    return BLEU.compute_bleu(
        correct=sums[2 : 2 + order],
        total=sums[2 + order :],
        sys_len=sums[0],
        ref_len=sums[1],
        smooth_method=settings.smooth_method,
        smooth_value=settings.smooth_value,
        effective_order=False,
        max_ngram_order=order,
    ).score


@dataclass
class BleuResult:
    """Corpus BLEU of one system, with its bootstrap interval when resampling was on.

    ``sentence_stats``: ``(n_sentences, 10)`` integer array, columns :data:`STATISTIC_COLUMNS`;
    enough to rescore any resample or run a paired test later without the text.
    """

    score: float
    signature: str
    verbose: str
    n_sentences: int
    settings: BleuSettings
    sentence_stats: np.ndarray
    n_bootstrap: int = 0
    seed: Optional[int] = None
    ci_low: Optional[float] = None
    ci_high: Optional[float] = None
    bootstrap_mean: Optional[float] = None


def score_corpus(
    hypotheses: Sequence[str],
    references: Sequence[str],
    settings: BleuSettings = BleuSettings(),
    n_bootstrap: int = DEFAULT_N_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
    resampler: Optional[BootstrapResampler] = None,
) -> BleuResult:
    """sacreBLEU corpus BLEU of detokenised ``hypotheses`` against one reference each.

    With ``n_bootstrap > 0`` also the 95% percentile interval over that many resamples (drawn with
    ``seed``, or taken from ``resampler`` so that several systems share them); the signature then
    carries ``bs`` and ``seed`` as sacreBLEU's own does for ``--confidence``.
    """
    hypotheses, references = list(hypotheses), list(references)
    if not hypotheses:
        raise ValueError("no hypotheses to score: the input is empty")
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    check_n_bootstrap(n_bootstrap)
    metric = settings.make_metric()
    # Exactly the two steps of BLEU.corpus_score, done here so that the per-sentence statistics
    # are kept: sacreBLEU's own extraction (which also records the number of references for the
    # signature) and its own aggregation. Private methods, but the ones sacreBLEU's significance
    # tests use too; the tests compare the result with sacrebleu.corpus_bleu.
    segment_stats = metric._extract_corpus_statistics(hypotheses, [references])
    corpus = metric._aggregate_and_compute(segment_stats)
    stats = np.asarray(segment_stats, dtype=np.int64)
    if stats.shape != (len(hypotheses), len(STATISTIC_COLUMNS)):
        raise RuntimeError(
            f"sacreBLEU returned per-sentence statistics of shape {stats.shape}, expected "
            f"{(len(hypotheses), len(STATISTIC_COLUMNS))}; this sacreBLEU version is not supported"
        )
    result = BleuResult(
        score=corpus.score,
        signature="",
        verbose=corpus._verbose,
        n_sentences=len(hypotheses),
        settings=settings,
        sentence_stats=stats,
    )
    if n_bootstrap:
        if resampler is None:
            resampler = BootstrapResampler(len(hypotheses), n_bootstrap, seed)
        elif resampler.n_samples != n_bootstrap or resampler.seed != seed:
            raise ValueError("the given resampler was built with other n_bootstrap/seed values")
        scores = bleu_from_statistics(
            resampler.resample_sums(stats), settings.smooth_method, settings.smooth_value
        )
        result.ci_low, result.ci_high = percentile_interval(scores)
        result.bootstrap_mean = float(scores.mean())
        result.n_bootstrap, result.seed = n_bootstrap, seed
        # What sacreBLEU's corpus_score(n_bootstrap=...) records, so its signature says "bs"/"rs".
        metric.n_bootstrap = n_bootstrap
        metric.seed = str(seed).lower()
    result.signature = metric.get_signature().format()
    return result


@dataclass
class PairedBootstrapResult:
    """Paired bootstrap comparison of a system with a baseline; see :data:`PAIRED_TEST_DEFINITION`."""

    system_bleu: float
    baseline_bleu: float
    difference: float
    difference_ci_low: float
    difference_ci_high: float
    p_value: float
    system_win_rate: float
    n_bootstrap: int
    seed: int
    definition: str = PAIRED_TEST_DEFINITION

    def to_dict(self) -> Dict:
        return asdict(self)


def paired_bootstrap(
    system_stats: np.ndarray,
    baseline_stats: np.ndarray,
    settings: BleuSettings = BleuSettings(),
    n_bootstrap: int = DEFAULT_N_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
    resampler: Optional[BootstrapResampler] = None,
) -> PairedBootstrapResult:
    """Paired bootstrap test of a system against a baseline on the same test set (Koehn 2004).

    Both statistics arrays must come from the same references in the same order. Besides the
    p-value (definition in :data:`PAIRED_TEST_DEFINITION`) it returns the 95% percentile interval
    of the BLEU difference and the share of resamples where the system scores strictly higher.

    This is Koehn's test, not the p-value of ``sacrebleu --paired-bs``, which follows Moses'
    ``bootstrap-hypothesis-difference-significance.pl`` (absolute differences centred on their
    mean, compared with the observed difference, with +1 smoothing).
    """
    system_stats = np.asarray(system_stats)
    baseline_stats = np.asarray(baseline_stats)
    if system_stats.shape != baseline_stats.shape:
        raise ValueError(
            f"system and baseline were scored on different numbers of sentences "
            f"({system_stats.shape[0]} vs {baseline_stats.shape[0]})"
        )
    if system_stats.shape[0] == 0:
        raise ValueError("cannot compare systems on an empty test set")
    if np.any(system_stats[:, 1] != baseline_stats[:, 1]):
        raise ValueError(
            "system and baseline have different reference lengths: they were not scored "
            "against the same references"
        )
    if resampler is None:
        resampler = BootstrapResampler(system_stats.shape[0], n_bootstrap, seed)
    elif resampler.n_samples != n_bootstrap or resampler.seed != seed:
        raise ValueError("the given resampler was built with other n_bootstrap/seed values")
    system_bleu = corpus_bleu_from_statistics(system_stats, settings)
    baseline_bleu = corpus_bleu_from_statistics(baseline_stats, settings)
    system_scores = bleu_from_statistics(
        resampler.resample_sums(system_stats), settings.smooth_method, settings.smooth_value
    )
    baseline_scores = bleu_from_statistics(
        resampler.resample_sums(baseline_stats), settings.smooth_method, settings.smooth_value
    )
    differences = system_scores - baseline_scores
    difference = system_bleu - baseline_bleu
    if difference > 0:
        p_value = float(np.mean(differences <= 0))
    elif difference < 0:
        p_value = float(np.mean(differences >= 0))
    else:
        p_value = 1.0
    low, high = percentile_interval(differences)
    return PairedBootstrapResult(
        system_bleu=system_bleu,
        baseline_bleu=baseline_bleu,
        difference=difference,
        difference_ci_low=low,
        difference_ci_high=high,
        p_value=p_value,
        system_win_rate=float(np.mean(differences > 0)),
        n_bootstrap=n_bootstrap,
        seed=seed,
    )


def statistics_to_rows(sentence_stats: np.ndarray) -> List[List[int]]:
    return np.asarray(sentence_stats, dtype=np.int64).tolist()


def statistics_from_rows(rows, source: str) -> np.ndarray:
    """Inverse of :func:`statistics_to_rows`, validating the shape; ``source`` names the file."""
    stats = np.asarray(rows, dtype=np.int64)
    if stats.ndim != 2 or stats.shape[1] != len(STATISTIC_COLUMNS) or stats.shape[0] == 0:
        raise ValueError(
            f"{source}: sentence_stats must be a non-empty list of rows of "
            f"{len(STATISTIC_COLUMNS)} integers ({', '.join(STATISTIC_COLUMNS)})"
        )
    return stats
