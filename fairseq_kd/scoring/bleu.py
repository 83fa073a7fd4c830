"""Corpus BLEU, its bootstrap confidence interval and paired significance tests, all by sacreBLEU
(Post 2018): ``BLEU.corpus_score`` and ``sacrebleu.significance.PairedTest``, the code behind
``sacrebleu --confidence``, ``--paired-bs`` (Koehn 2004) and ``--paired-ar`` (Riezler & Maxwell
2005). One deviation: p counts the resamples and shuffles whose statistic is at least the observed
|difference|, as Riezler & Maxwell define it (sacreBLEU: strictly beyond); ``docs/design/scoring.md``.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy
import sacrebleu.significance
from sacrebleu.metrics.bleu import BLEU
from sacrebleu.metrics.chrf import CHRF
from sacrebleu.significance import PairedTest

from ..errors import InputError

DEFAULT_SEED = 12345  # sacreBLEU's default SACREBLEU_SEED
DEFAULT_N_BOOTSTRAP = 1000  # sacreBLEU's --paired-bs-n and --confidence-n default
DEFAULT_N_TRIALS = 10000  # sacreBLEU's --paired-ar-n default
MIN_N_BOOTSTRAP = 40  # a 95% percentile interval cuts 1 in 40 resamples on each side

PAIRED_TESTS_DEFINITION = (
    "p (bs): sacreBLEU's paired bootstrap resampling (sacrebleu --paired-bs; Koehn 2004, as Moses' "
    "bootstrap-hypothesis-difference-significance.pl); p (ar): sacreBLEU's paired approximate "
    "randomisation (sacrebleu --paired-ar; Riezler & Maxwell 2005). Both are two-sided, test the "
    "absolute BLEU difference against the baseline, count the resamples or shuffles whose statistic "
    "is at least that difference (sacreBLEU: strictly above) and add one to numerator and denominator, so the "
    "smallest possible p is 1/(n+1).")
INTERVAL_DEFINITION = ("μ ± CI: mean of the bootstrap resamples and half the width of their 95% percentile "
                       "interval (sacrebleu --confidence)")


@dataclass(frozen=True)
class BleuSettings:
    """The sacreBLEU options that change the score (all part of its signature)."""

    tokenize: str = BLEU.TOKENIZER_DEFAULT
    lowercase: bool = False
    smooth_method: str = "exp"
    smooth_value: Optional[float] = None

    def __post_init__(self):
        if self.tokenize not in BLEU.TOKENIZERS:
            raise InputError(f"unknown sacreBLEU tokenizer {self.tokenize!r}; choose one of "
                             f"{', '.join(sorted(BLEU.TOKENIZERS))}")
        if self.smooth_method not in BLEU.SMOOTH_DEFAULTS:
            raise InputError(f"unknown smoothing method {self.smooth_method!r}; choose one of "
                             f"{', '.join(BLEU.SMOOTH_DEFAULTS)}")

    def make_metric(self) -> BLEU:
        return BLEU(tokenize=self.tokenize, lowercase=self.lowercase, smooth_method=self.smooth_method,
                    smooth_value=self.smooth_value)

    def to_dict(self) -> Dict:
        return asdict(self)


def check_n_bootstrap(n_bootstrap: int) -> None:
    if n_bootstrap != 0 and n_bootstrap < MIN_N_BOOTSTRAP:
        raise InputError(f"--bootstrap {n_bootstrap}: use 0 to switch resampling off, or at least "
                         f"{MIN_N_BOOTSTRAP} resamples (a 95% interval drops 1 in 40 on each side); "
                         f"{DEFAULT_N_BOOTSTRAP} is usual")


def check_n_trials(n_trials: int) -> None:
    if n_trials < 0 or 0 < n_trials < 100:
        raise InputError(f"--ar-trials {n_trials}: use 0 to skip the approximate randomisation test, or at "
                         f"least 100 trials (p cannot fall below 1/(trials+1)); {DEFAULT_N_TRIALS} is usual")


def chrf_scores(hypotheses: Sequence[str], references: Sequence[str], lowercase: bool = False) -> Dict[str, float]:
    """chrF (character 6-grams, beta 2; Popović 2015) and chrF++ (and word 2-grams; Popović 2017)
    of a corpus: sacreBLEU's ``CHRF(word_order=0)`` and ``CHRF(word_order=2)``, case-insensitive
    with ``lowercase`` as BLEU is."""
    check_parallel(hypotheses, references)
    return {key: CHRF(word_order=order, lowercase=lowercase).corpus_score(list(hypotheses), [list(references)]).score
            for key, order in (("chrf", 0), ("chrfpp", 2))}


@contextmanager
def sacrebleu_seed(seed: int) -> Iterator[None]:
    """Run sacreBLEU's resampling with ``seed``: it reads ``SACREBLEU_SEED`` at each call."""
    previous = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = previous


def check_parallel(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if not hypotheses:
        raise InputError("no hypotheses to score: the input is empty")
    if len(hypotheses) != len(references):
        raise InputError(f"{len(hypotheses)} hypotheses but {len(references)} references")


@dataclass
class BleuResult:
    """Corpus BLEU of one system; ``mean``/``ci`` (sacreBLEU's mu +- half-width) when resampled."""

    score: float
    signature: str
    verbose: str
    n_sentences: int
    settings: BleuSettings
    n_bootstrap: int = 0
    seed: Optional[int] = None
    mean: Optional[float] = None
    ci: Optional[float] = None


def score_corpus(hypotheses: Sequence[str], references: Sequence[str], settings: BleuSettings = BleuSettings(),
                 n_bootstrap: int = DEFAULT_N_BOOTSTRAP, seed: int = DEFAULT_SEED) -> BleuResult:
    """sacreBLEU corpus BLEU of detokenised ``hypotheses`` against one reference each; with
    ``n_bootstrap`` resamples also its interval, as ``sacrebleu --confidence`` computes it."""
    hypotheses, references = list(hypotheses), list(references)
    check_parallel(hypotheses, references)
    check_n_bootstrap(n_bootstrap)
    metric = settings.make_metric()
    bleu = metric.corpus_score(hypotheses, [references])
    result = BleuResult(score=bleu.score, signature=metric.get_signature().format(), verbose=bleu.format(width=2),
                        n_sentences=len(hypotheses), settings=settings)
    if n_bootstrap:
        comparison = compare_systems([("system", hypotheses)], references, settings, n_bootstrap, 0, seed)
        row = comparison.rows[0]
        result.mean, result.ci, result.signature = row.mean, row.ci, comparison.signature
        result.n_bootstrap, result.seed = n_bootstrap, seed
    return result


@dataclass
class ComparisonRow:
    """One system of :func:`compare_systems`; p-values are None for the baseline."""

    system: str
    score: float
    mean: float
    ci: float
    p_bootstrap: Optional[float]
    p_randomization: Optional[float]


@dataclass
class Comparison:
    rows: List[ComparisonRow]
    signature: str


def _p_counting_ties(statistics: numpy.ndarray, observed: float) -> float:
    """(resamples or shuffles whose statistic is >= the observed difference, + 1) / (their number + 1)."""
    return (int(numpy.sum(statistics >= observed)) + 1) / (len(statistics) + 1)


_SWAP = threading.Lock()  # one swap at a time: a second thread would restore the strict count


@contextmanager
def _counting_ties() -> Iterator[None]:
    """sacreBLEU's paired tests (its resamples, shuffles, seed and scores) with :func:`_p_counting_ties`."""
    with _SWAP:
        strictly_beyond = sacrebleu.significance._compute_p_value
        sacrebleu.significance._compute_p_value = _p_counting_ties
        try:
            yield
        finally:
            sacrebleu.significance._compute_p_value = strictly_beyond


def _paired_test(named_systems, references, settings, test_type: str, n_samples: int, seed: int):
    metric = settings.make_metric()
    with sacrebleu_seed(seed), _counting_ties():
        signatures, scores = PairedTest(named_systems, {"BLEU": metric}, [list(references)],
                                        test_type=test_type, n_samples=n_samples)()
    (name,) = signatures
    return signatures[name].format(), scores[name]


def compare_systems(named_systems: Sequence[Tuple[str, Sequence[str]]], references: Sequence[str],
                    settings: BleuSettings = BleuSettings(), n_bootstrap: int = DEFAULT_N_BOOTSTRAP,
                    n_trials: int = DEFAULT_N_TRIALS, seed: int = DEFAULT_SEED) -> Comparison:
    """Every system's BLEU and interval (``n_bootstrap`` resamples), and both paired tests of each
    against the first (p (ar) only with ``n_trials`` > 0)."""
    named_systems = [(name, list(hypotheses)) for name, hypotheses in named_systems]
    if not named_systems:
        raise InputError("no systems to compare")
    for _, hypotheses in named_systems:
        check_parallel(hypotheses, references)
    check_n_bootstrap(n_bootstrap)
    check_n_trials(n_trials)
    if not n_bootstrap:
        raise InputError("intervals and paired tests need resampling: use --bootstrap 1000, not 0")
    signature, bootstrap = _paired_test(named_systems, references, settings, "bs", n_bootstrap, seed)
    randomization = [None] * len(named_systems)
    if n_trials and len(named_systems) > 1:
        ar_signature, randomization = _paired_test(named_systems, references, settings, "ar", n_trials, seed)
        signature = f"{signature} (ar: {ar_signature})"
    p_value = lambda index, test: None if index == 0 or test is None else test.p_value
    rows = [
        ComparisonRow(system=name, score=bs.score, mean=float(bs.mean), ci=float(bs.ci),
                      p_bootstrap=p_value(index, bs), p_randomization=p_value(index, ar))
        for index, ((name, _), bs, ar) in enumerate(zip(named_systems, bootstrap, randomization))
    ]
    return Comparison(rows=rows, signature=signature)
