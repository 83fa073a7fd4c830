"""BLEU, bootstrap intervals, paired significance and detokenisation, each checked against an
independent reference: sacreBLEU called directly (on whole corpora and on explicit resamples),
sacreBLEU's own --confidence bootstrap, fairseq's own post-processing, and hand-written text."""
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
from sacrebleu.metrics.bleu import BLEU

from fairseq_kd.scoring.bleu import (
    BleuSettings,
    BootstrapResampler,
    bleu_from_statistics,
    bleu_signature,
    corpus_bleu_from_statistics,
    paired_bootstrap,
    percentile_interval,
    score_corpus,
)
from fairseq_kd.scoring.detok import (
    detokenize_lines,
    moses_detokenize,
    read_generate_output,
    remove_bpe,
)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

WORDS = (
    "the a cat dog bird sat ran flew on under over mat house garden tree big small red blue "
    "quickly slowly today yesterday he she it was is and but"
).split()


def make_references(n_sentences, seed, min_len=4, max_len=16):
    rnd = random.Random(seed)
    return [
        " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(min_len, max_len)))
        for _ in range(n_sentences)
    ]


def perturb(references, error_rate, seed):
    """Hypotheses: each word replaced with probability error_rate, sometimes one word dropped."""
    rnd = random.Random(seed)
    hypotheses = []
    for reference in references:
        words = [word if rnd.random() > error_rate else rnd.choice(WORDS) for word in reference.split()]
        if len(words) > 1 and rnd.random() < error_rate:
            del words[rnd.randrange(len(words))]
        hypotheses.append(" ".join(words))
    return hypotheses


def make_corpus(n_sentences, error_rate, seed, min_len=4, max_len=16):
    """(hypotheses, references) as sentences: capitalised, ending in a period."""
    references = make_references(n_sentences, seed, min_len, max_len)
    hypotheses = perturb(references, error_rate, seed + 1000)
    return [h.capitalize() + "." for h in hypotheses], [r.capitalize() + "." for r in references]


def sacrebleu_on_rows(hypotheses, references, rows, **options):
    """Slow reference: sacreBLEU's corpus BLEU of each explicit resample."""
    return np.array(
        [
            sacrebleu.corpus_bleu([hypotheses[i] for i in row], [[references[i] for i in row]], **options).score
            for row in rows
        ]
    )


# --------------------------------------------------------------------------- corpus BLEU


@pytest.mark.parametrize("lowercase", [False, True])
def test_full_corpus_bleu_equals_sacrebleu_exactly(lowercase):
    hypotheses, references = make_corpus(300, 0.3, seed=1)
    result = score_corpus(hypotheses, references, BleuSettings(lowercase=lowercase), n_bootstrap=0)
    expected = sacrebleu.corpus_bleu(hypotheses, [references], lowercase=lowercase)
    assert result.score == expected.score
    assert result.verbose == expected._verbose
    assert result.n_sentences == 300
    assert result.ci_low is None and result.n_bootstrap == 0


def test_chinese_tokenizer_equals_sacrebleu_zh():
    references = ["我们今天去公园散步。", "他说这本书很有意思。", "天气很好，我们出去吧！"] * 5
    hypotheses = ["我们今天去公园。", "他说这本书有意思。", "天气很好，我们出去玩吧！"] * 5
    result = score_corpus(hypotheses, references, BleuSettings(tokenize="zh"), n_bootstrap=0)
    assert result.score == sacrebleu.corpus_bleu(hypotheses, [references], tokenize="zh").score
    # 13a sees whole sentences as one word each: a different (much lower) score
    assert result.score != score_corpus(hypotheses, references, n_bootstrap=0).score
    assert "tok:zh" in result.signature


def test_signature_is_sacrebleus_own(monkeypatch):
    hypotheses, references = make_corpus(100, 0.3, seed=2)
    metric = BLEU()
    metric.corpus_score(hypotheses, [references])
    assert score_corpus(hypotheses, references, n_bootstrap=0).signature == metric.get_signature().format()
    # With resampling, sacreBLEU's signature records bs and seed; ours must read the same.
    monkeypatch.setenv("SACREBLEU_SEED", "777")
    metric = BLEU()
    metric.corpus_score(hypotheses, [references], n_bootstrap=1000)
    signature = score_corpus(hypotheses, references, n_bootstrap=1000, seed=777).signature
    assert signature == metric.get_signature().format()
    assert "bs:1000" in signature and "seed:777" in signature
    assert bleu_signature(BleuSettings(), 1000, 777) == signature


@pytest.mark.parametrize("seed", [12345, 7])
def test_interval_matches_sacrebleu_confidence(monkeypatch, seed):
    """Same draws and order statistics as `sacrebleu --confidence`: same mean and half-width."""
    hypotheses, references = make_corpus(200, 0.3, seed=3)
    monkeypatch.setenv("SACREBLEU_SEED", str(seed))
    reference = BLEU().corpus_score(hypotheses, [references], n_bootstrap=1000)
    result = score_corpus(hypotheses, references, n_bootstrap=1000, seed=seed)
    # sacreBLEU's bootstrap keeps the statistics in float32 and, under NumPy 2's promotion
    # rules, computes the precisions in float32 too: agreement to about 1e-7 relative.
    assert (result.ci_high - result.ci_low) / 2 == pytest.approx(reference._ci, rel=1e-5)
    assert result.bootstrap_mean == pytest.approx(reference._mean, rel=1e-6)


@pytest.mark.parametrize("smooth_method", ["exp", "floor", "add-k", "none"])
@pytest.mark.parametrize("corpus", ["normal", "short"])
def test_resampled_scores_equal_sacrebleu_on_explicit_resamples(smooth_method, corpus):
    if corpus == "normal":
        hypotheses, references = make_corpus(60, 0.3, seed=4)
    else:  # 1-3 word sentences, many errors: resamples without 3-/4-gram matches, even totals
        references = make_references(40, seed=5, min_len=1, max_len=3)
        hypotheses = perturb(references, 0.7, seed=5)
    settings = BleuSettings(smooth_method=smooth_method)
    result = score_corpus(hypotheses, references, settings, n_bootstrap=0)
    resampler = BootstrapResampler(len(hypotheses), n_samples=60, seed=11)
    vectorised = bleu_from_statistics(resampler.resample_sums(result.sentence_stats), smooth_method)
    rows = resampler.indices[:25]
    expected = sacrebleu_on_rows(hypotheses, references, rows, smooth_method=smooth_method)
    np.testing.assert_allclose(vectorised[:25], expected, rtol=1e-12, atol=1e-12)
    if corpus == "short":
        assert (result.sentence_stats[:, 5] == 0).any()  # some sentences have no 4-grams at all


def test_bleu_from_statistics_edge_cases_match_compute_bleu():
    """Hand-made statistics rows through sacreBLEU's compute_bleu, one by one."""
    rows = [
        [0, 5, 0, 0, 0, 0, 0, 0, 0, 0],  # empty hypothesis
        [3, 5, 0, 0, 0, 0, 3, 2, 1, 0],  # no match at all
        [3, 5, 2, 1, 0, 0, 3, 2, 1, 0],  # 4-gram total 0: sacreBLEU stops there
        [10, 8, 7, 4, 0, 0, 10, 9, 8, 7],  # two orders without matches (exp smoothing doubles)
        [10, 12, 7, 4, 2, 1, 10, 9, 8, 7],  # brevity penalty
        [20, 12, 15, 9, 5, 2, 20, 19, 18, 17],  # longer than reference
    ]
    for smooth_method in ["exp", "floor", "add-k", "none"]:
        vectorised = bleu_from_statistics(np.array(rows), smooth_method)
        for row, value in zip(rows, vectorised):
            expected = BLEU.compute_bleu(
                correct=row[2:6], total=row[6:], sys_len=row[0], ref_len=row[1], smooth_method=smooth_method
            ).score
            assert value == pytest.approx(expected, rel=1e-12, abs=1e-12), (smooth_method, row)


def test_resampler_draws_are_sacrebleus():
    resampler = BootstrapResampler(50, n_samples=40, seed=12345)
    expected = np.random.default_rng(12345).choice(50, size=(40, 50), replace=True)
    np.testing.assert_array_equal(resampler.indices, expected)
    counts = np.stack([np.bincount(row, minlength=50) for row in expected])
    np.testing.assert_array_equal(resampler.multiplicities, counts)
    assert (resampler.multiplicities.sum(axis=1) == 50).all()


def test_interval_contains_estimate_and_shrinks_with_more_sentences():
    widths = []
    for n_sentences in (100, 1600):
        hypotheses, references = make_corpus(n_sentences, 0.3, seed=6)
        result = score_corpus(hypotheses, references, n_bootstrap=1000)
        assert result.ci_low < result.score < result.ci_high
        widths.append(result.ci_high - result.ci_low)
    # the standard error falls like 1/sqrt(n): 16x the sentences, about a quarter of the width
    assert widths[1] < 0.5 * widths[0]


def test_percentile_interval_order_statistics():
    scores = np.arange(1000, dtype=float)[::-1]  # 999..0
    assert percentile_interval(scores) == (25.0, 974.0)


def test_score_corpus_errors():
    with pytest.raises(ValueError, match="empty"):
        score_corpus([], [])
    with pytest.raises(ValueError, match="3 hypotheses but 2 references"):
        score_corpus(["a", "b", "c"], ["a", "b"])
    with pytest.raises(ValueError, match="at least 40"):
        score_corpus(["a b"], ["a b"], n_bootstrap=10)
    with pytest.raises(ValueError, match="tokenizer"):
        BleuSettings(tokenize="moses")


# --------------------------------------------------------------------------- paired bootstrap


def test_identical_systems_give_p_one():
    hypotheses, references = make_corpus(150, 0.3, seed=7)
    stats = score_corpus(hypotheses, references, n_bootstrap=0).sentence_stats
    paired = paired_bootstrap(stats, stats.copy())
    assert paired.difference == 0.0
    assert paired.p_value == 1.0
    assert paired.system_win_rate == 0.0
    assert paired.difference_ci_low == paired.difference_ci_high == 0.0


def test_clearly_better_system_gives_small_p_both_ways():
    references = make_references(300, seed=8)
    worse = perturb(references, 0.4, seed=1)
    better = perturb(references, 0.15, seed=2)
    worse_stats = score_corpus(worse, references, n_bootstrap=0).sentence_stats
    better_stats = score_corpus(better, references, n_bootstrap=0).sentence_stats
    forward = paired_bootstrap(better_stats, worse_stats)
    backward = paired_bootstrap(worse_stats, better_stats)
    assert forward.difference > 5
    assert forward.p_value < 0.01 and forward.system_win_rate > 0.99
    assert backward.difference == pytest.approx(-forward.difference)
    assert backward.p_value == forward.p_value
    assert forward.difference_ci_low > 0


def test_paired_p_value_equals_slow_loop_with_sacrebleu():
    """The documented definition, computed with sacreBLEU on each explicit resample."""
    references = make_references(50, seed=9)
    system = perturb(references, 0.30, seed=3)
    baseline = perturb(references, 0.32, seed=4)
    system_stats = score_corpus(system, references, n_bootstrap=0).sentence_stats
    baseline_stats = score_corpus(baseline, references, n_bootstrap=0).sentence_stats
    paired = paired_bootstrap(system_stats, baseline_stats, n_bootstrap=60, seed=3)
    rows = np.random.default_rng(3).choice(50, size=(60, 50), replace=True)
    differences = sacrebleu_on_rows(system, references, rows) - sacrebleu_on_rows(baseline, references, rows)
    full = sacrebleu.corpus_bleu(system, [references]).score - sacrebleu.corpus_bleu(baseline, [references]).score
    expected_p = np.mean(differences <= 0) if full > 0 else np.mean(differences >= 0)
    assert paired.difference == pytest.approx(full, abs=1e-12)
    assert paired.p_value == expected_p
    assert 0 < paired.p_value < 1  # a close call: the test is not trivially 0 or 1
    assert paired.system_win_rate == np.mean(differences > 0)


def test_paired_bootstrap_rejects_other_references():
    hypotheses, references = make_corpus(30, 0.3, seed=11)
    stats = score_corpus(hypotheses, references, n_bootstrap=0).sentence_stats
    other_hypotheses, other_references = make_corpus(30, 0.3, seed=12)
    other = score_corpus(other_hypotheses, other_references, n_bootstrap=0).sentence_stats
    with pytest.raises(ValueError, match="different reference lengths"):
        paired_bootstrap(stats, other)
    with pytest.raises(ValueError, match="different numbers of sentences"):
        paired_bootstrap(stats, stats[:20])


def test_corpus_bleu_from_statistics_equals_sacrebleu():
    hypotheses, references = make_corpus(80, 0.3, seed=13)
    result = score_corpus(hypotheses, references, n_bootstrap=0)
    assert corpus_bleu_from_statistics(result.sentence_stats, BleuSettings()) == result.score


# --------------------------------------------------------------------------- detokenisation


def test_remove_bpe_subword_nmt_by_hand():
    assert remove_bpe("you know , the inten@@ se pleas@@ ures", "subword_nmt") == "you know , the intense pleasures"
    assert remove_bpe("a truncated hypo@@", "subword_nmt") == "a truncated hypo"
    assert remove_bpe("eth@@ no@@ graphic research", "subword_nmt") == "ethnographic research"
    assert remove_bpe("no pieces here", "subword_nmt") == "no pieces here"
    assert remove_bpe("inten@@ se", "none") == "inten@@ se"


def test_remove_bpe_sentencepiece_by_hand():
    assert remove_bpe("▁the ▁cat s ▁sat ▁on ▁the ▁mat .", "sentencepiece") == "the cats sat on the mat."
    assert remove_bpe("▁我们 今天 ▁去 公园", "sentencepiece") == "我们今天 去公园"
    assert remove_bpe("▁Hello ▁world", "sentencepiece") == "Hello world"


def test_moses_detokenize_by_hand():
    lines = ["it &apos;s a &quot; test &quot; , isn &apos;t it ?", "( really ) : yes !"]
    assert moses_detokenize(lines, "en") == ['it\'s a "test", isn\'t it?', "(really): yes!"]
    assert detokenize_lines(["it &apos;s fin@@ e ."], "subword_nmt", "en") == ["it's fine."]


def test_remove_bpe_equals_fairseq_post_process():
    data_utils = pytest.importorskip("fairseq.data.data_utils", reason="fairseq not installed")
    lines = ["a b@@ c d@@", "▁x y ▁z", "plain", "", "e@@ f@@ g ."]
    for scheme in ("subword_nmt", "sentencepiece", "none"):
        for line in lines:
            assert remove_bpe(line, scheme) == data_utils.post_process(line, scheme)


def test_remove_bpe_restores_iwslt14_tokenized_text():
    bpe_file = SHARED_DATA / "iwslt14-de-en" / "bpe" / "test.en"
    tokenized_file = SHARED_DATA / "iwslt14-de-en" / "tokenized" / "test.en"
    if not (bpe_file.is_file() and tokenized_file.is_file()):
        pytest.skip(f"shared IWSLT'14 data not found under {SHARED_DATA}")
    with open(bpe_file, encoding="utf-8") as bpe, open(tokenized_file, encoding="utf-8") as tokenized:
        pairs = [(b.rstrip("\n"), t.rstrip("\n")) for b, t, _ in zip(bpe, tokenized, range(2000))]
    assert sum("@@ " in b for b, _ in pairs) > 1000
    assert [remove_bpe(b, "subword_nmt") for b, _ in pairs] == [t for _, t in pairs]


# --------------------------------------------------------------------------- generate output


GENERATE_OUTPUT = """\
2024-05-01 10:00:00 | INFO | fairseq_cli.generate | loading model(s) from checkpoint_best.pt
S-2\tdrei
T-2\tthree
H-2\t-0.41\tthr@@ ee
D-2\t-0.41\tthree
P-2\t-0.5 -0.3
S-0\tnull
T-0\tzero
H-0\t-0.20\tzero
D-0\t-0.20\tzero
H-0\t-0.90\tnil
D-0\t-0.90\tnil
S-10\tzehn
T-10\tten
H-10\t-1.50\t
D-10\t-1.50\t
T-1\tone
H-1\t-0.30\tone
D-1\t-0.30\tone
""" + "".join(f"T-{i}\tw{i}\nH-{i}\t-0.1\tw{i}\nD-{i}\t-0.1\tw{i}\n" for i in range(3, 10)) + """\
2024-05-01 10:00:05 | INFO | fairseq_cli.generate | Translated 11 sentences (90 tokens) in 0.1s (9.00 sentences/s)
Generate test with beam=5: BLEU4 = 12.34, 50.0/20.0/10.0/5.0 (BP=1.000, ratio=1.000)
"""


def test_read_generate_output_sorts_ids_and_prefers_d_lines(tmp_path):
    path = tmp_path / "gen.out"
    path.write_text(GENERATE_OUTPUT, encoding="utf-8")
    generated = read_generate_output(path)
    assert generated.ids == list(range(11))  # numeric order, not text order ("10" < "2")
    assert generated.complete and generated.n_expected == 11
    # first of the n-best; empty kept
    assert generated.hypotheses[:3] + generated.hypotheses[10:] == ["zero", "one", "three", ""]
    assert generated.references[:3] + generated.references[10:] == ["zero", "one", "three", "ten"]
    assert generated.hypothesis_source == "D"


def test_read_generate_output_falls_back_to_h_lines(tmp_path):
    path = tmp_path / "gen.out"
    path.write_text("".join(l + "\n" for l in GENERATE_OUTPUT.splitlines() if not l.startswith("D-")))
    generated = read_generate_output(path)
    assert generated.hypothesis_source == "H"
    assert generated.hypotheses[:3] + generated.hypotheses[10:] == ["zero", "one", "thr@@ ee", ""]


@pytest.mark.parametrize(
    "text, message",
    [
        ("H-0\t-1\ta\nD-0\t-1\ta\n", "no T- reference"),
        ("T-0\ta\nT-1\tb\nH-0\t-1\ta\nD-0\t-1\ta\n", "no D- hypothesis"),
        ("T-0\ta\nT-0\ta\nH-0\t-1\ta\n", "second T- line"),
        ("2024-05-01 10:00:00 | INFO | nothing here\n", "no H- or D- lines"),
    ],
)
def test_read_generate_output_errors(tmp_path, text, message):
    path = tmp_path / "gen.out"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_generate_output(path)


def test_read_generate_output_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_generate_output(tmp_path / "absent.txt")


def _complete_output(n, order_seed=0):
    order = list(range(n))
    random.Random(order_seed).shuffle(order)  # fairseq prints sentences in batch order
    body = "".join(f"S-{i}\ts{i}\nT-{i}\tr{i}\nH-{i}\t-0.1\th{i}\nD-{i}\t-0.1\th{i}\n" for i in order)
    return (body + f"2024-05-01 10:00:05 | INFO | fairseq_cli.generate | Translated {n} sentences (1 tokens)\n"
            "Generate test with beam=5: BLEU4 = 1.00, 1/1/1/1 (BP=1.000, ratio=1.000)\n")


def _drop_sentences(text, ids):
    return "".join(l for l in text.splitlines(keepends=True) if l.split("\t")[0].split("-")[-1] not in map(str, ids)
                   or not l[:2] in ("S-", "T-", "H-", "D-"))


def test_complete_output_passes_with_and_without_expected_count(tmp_path):
    path = tmp_path / "gen.out"
    path.write_text(_complete_output(30))
    assert read_generate_output(path).ids == list(range(30))
    assert read_generate_output(path, expected_sentences=30).complete


def test_truncated_output_is_refused_with_counts(tmp_path):
    """The issue's probe: 24 of 30 sentences and the last line cut mid-way."""
    from fairseq_kd.scoring.detok import IncompleteGenerateOutputError

    full = _complete_output(30)
    sentence_lines = [l for l in full.splitlines(keepends=True) if l[:2] in ("S-", "T-", "H-", "D-")]
    cut = "".join(sentence_lines[:24 * 4 + 2]) + "D-" + sentence_lines[24 * 4 + 2][2:6]  # a cut D- line
    path = tmp_path / "gen.out"
    path.write_text(cut)
    with pytest.raises(IncompleteGenerateOutputError, match="summary line") as raised:
        read_generate_output(path, expected_sentences=30)
    assert "30 sentences" in str(raised.value) and "--allow-partial" in str(raised.value)
    # even without the expected count: the missing summary line betrays the cut
    with pytest.raises(IncompleteGenerateOutputError, match="summary line"):
        read_generate_output(path)
    partial = read_generate_output(path, expected_sentences=30, allow_partial=True)
    assert not partial.complete
    assert partial.completeness()["n_expected"] == 30 and partial.completeness()["n_sentences"] == len(partial.ids)


def test_missing_sentences_in_the_middle_are_refused(tmp_path):
    from fairseq_kd.scoring.detok import IncompleteGenerateOutputError

    path = tmp_path / "gen.out"
    path.write_text(_drop_sentences(_complete_output(30), [3, 17]).replace("Translated 30", "Translated 28"))
    with pytest.raises(IncompleteGenerateOutputError, match=r"2 sentence ids of 0..29 have no hypothesis \(first: 3, 17\)"):
        read_generate_output(path)
    assert read_generate_output(path, allow_partial=True).ids == [i for i in range(30) if i not in (3, 17)]


def test_missing_sentences_at_the_end_need_the_expected_count(tmp_path):
    """A run that finished but skipped the last sentences: only the test set's size shows it."""
    from fairseq_kd.scoring.detok import IncompleteGenerateOutputError

    path = tmp_path / "gen.out"
    path.write_text(_drop_sentences(_complete_output(30), [28, 29]).replace("Translated 30", "Translated 28"))
    assert read_generate_output(path).complete  # nothing in the file alone says sentences are missing
    with pytest.raises(IncompleteGenerateOutputError, match=r"28 sentences, the test set has 30"):
        read_generate_output(path, expected_sentences=30)
    with pytest.raises(IncompleteGenerateOutputError, match="beyond the 20 expected"):
        read_generate_output(path, expected_sentences=20)


def test_translated_count_and_duplicated_runs_are_refused(tmp_path):
    from fairseq_kd.scoring.detok import IncompleteGenerateOutputError

    path = tmp_path / "gen.out"
    path.write_text(_complete_output(30).replace("Translated 30", "Translated 31"))
    with pytest.raises(IncompleteGenerateOutputError, match="Translated 31 sentences' but the file holds 30"):
        read_generate_output(path)
    path.write_text(_complete_output(30) + _complete_output(30, order_seed=1))
    with pytest.raises(IncompleteGenerateOutputError, match="30 sentence ids appear more than once"):
        read_generate_output(path, allow_partial=True)  # never scorable, not even partially
    path.write_text(_complete_output(30) + "H-31\t-0.1\tlate\n")
    with pytest.raises(IncompleteGenerateOutputError, match="sentence lines follow the summary line"):
        read_generate_output(path)
    two_runs = _drop_sentences(_complete_output(30), range(15, 30)) + _drop_sentences(_complete_output(30), range(15))
    path.write_text(two_runs.replace("Translated 30", "Translated 15"))
    with pytest.raises(IncompleteGenerateOutputError, match="2 summary lines"):
        read_generate_output(path)


# --------------------------------------------------------------------------- import isolation


def _import_scoring_modules_in_subprocess(bypass_package_init):
    code = (
        "import sys, types\n"
        + (
            # Load the subpackages without running fairseq_kd/__init__.py (the plugin registration).
            f"package = types.ModuleType('fairseq_kd'); package.__path__ = [{str(REPO / 'fairseq_kd')!r}]\n"
            "sys.modules['fairseq_kd'] = package\n"
            if bypass_package_init
            else ""
        )
        + "import fairseq_kd.scoring.bleu, fairseq_kd.scoring.detok, fairseq_kd.scoring.report\n"
        "import fairseq_kd.scoring.plots, fairseq_kd.cli.score, fairseq_kd.cli.report, fairseq_kd.cli.plot\n"
        "print(sorted(name for name in ('torch', 'fairseq') if name in sys.modules))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.strip().splitlines()[-1]


def test_scoring_modules_do_not_import_torch_or_fairseq():
    assert _import_scoring_modules_in_subprocess(bypass_package_init=True) == "[]"


def test_importing_fairseq_kd_scoring_does_not_import_torch():
    assert _import_scoring_modules_in_subprocess(bypass_package_init=False) == "[]"
