"""BLEU, bootstrap intervals, paired significance and detokenisation, each checked against an
independent reference: sacreBLEU called directly (on whole corpora and on explicit resamples), the
sacrebleu command line's paired tests, fairseq's own post-processing, and hand-written text."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
from sacrebleu.metrics.bleu import BLEU

from conftest import sacrebleu_command_line
from fairseq_kd.errors import PathError
from fairseq_kd.scoring.bleu import BleuSettings, check_n_trials, compare_systems, score_corpus
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
    assert f"hyp_len = {expected.sys_len} ref_len = {expected.ref_len}" in result.verbose
    assert result.n_sentences == 300
    assert result.mean is None and result.ci is None and result.n_bootstrap == 0


def test_chinese_tokenizer_equals_sacrebleu_zh():
    references = ["我们今天去公园散步。", "他说这本书很有意思。", "天气很好，我们出去吧！"] * 5
    hypotheses = ["我们今天去公园。", "他说这本书有意思。", "天气很好，我们出去玩吧！"] * 5
    result = score_corpus(hypotheses, references, BleuSettings(tokenize="zh"), n_bootstrap=0)
    assert result.score == sacrebleu.corpus_bleu(hypotheses, [references], tokenize="zh").score
    # 13a sees whole sentences as one word each: a different (much lower) score
    assert result.score != score_corpus(hypotheses, references, n_bootstrap=0).score
    assert "tok:zh" in result.signature


def test_signature_is_sacrebleus_own():
    hypotheses, references = make_corpus(100, 0.3, seed=2)
    metric = BLEU()
    metric.corpus_score(hypotheses, [references])
    assert score_corpus(hypotheses, references, n_bootstrap=0).signature == metric.get_signature().format()
    signature = score_corpus(hypotheses, references, n_bootstrap=1000, seed=777).signature
    assert "bs:1000" in signature and "seed:777" in signature


def slow_interval(hypotheses, references, n_samples, seed):
    """Independent reference: sacreBLEU's corpus BLEU of each explicit resample (the draws
    sacreBLEU documents), then the mean and half the 1/40-to-39/40 order-statistic interval."""
    rows = np.random.default_rng(seed).choice(len(hypotheses), size=(n_samples, len(hypotheses)), replace=True)
    scores = np.sort(sacrebleu_on_rows(hypotheses, references, rows))
    cut = n_samples // 40
    return scores.mean(), (scores[n_samples - cut - 1] - scores[cut]) / 2


@pytest.mark.parametrize("seed", [12345, 7])
def test_interval_equals_slow_loop_over_explicit_resamples(seed):
    hypotheses, references = make_corpus(80, 0.3, seed=3)
    result = score_corpus(hypotheses, references, n_bootstrap=200, seed=seed)
    mean, half_width = slow_interval(hypotheses, references, 200, seed)
    # sacreBLEU's bootstrap sums the statistics in float32: agreement to about 1e-6 relative.
    assert result.mean == pytest.approx(mean, rel=1e-5)
    assert result.ci == pytest.approx(half_width, rel=1e-4)
    assert result.mean - result.ci < result.score < result.mean + result.ci
    assert os.environ.get("SACREBLEU_SEED") is None  # the seed was set for the call only


def test_interval_shrinks_with_more_sentences():
    widths = []
    for n_sentences in (100, 1600):
        hypotheses, references = make_corpus(n_sentences, 0.3, seed=6)
        widths.append(score_corpus(hypotheses, references, n_bootstrap=200).ci)
    # the standard error falls like 1/sqrt(n): 16x the sentences, about a quarter of the width
    assert widths[1] < 0.5 * widths[0]


def test_score_corpus_errors():
    with pytest.raises(ValueError, match="empty"):
        score_corpus([], [])
    with pytest.raises(ValueError, match="3 hypotheses but 2 references"):
        score_corpus(["a", "b", "c"], ["a", "b"])
    with pytest.raises(ValueError, match="at least 40"):
        score_corpus(["a b"], ["a b"], n_bootstrap=10)
    with pytest.raises(ValueError, match="tokenizer"):
        BleuSettings(tokenize="moses")
    with pytest.raises(ValueError, match="--ar-trials 50"):
        check_n_trials(50)


# --------------------------------------------------------------------------- paired tests


def sacrebleu_cli(tmp_path, references, systems, *flags, seed):
    return [row["BLEU"] for row in sacrebleu_command_line(tmp_path, references, systems, *flags, seed=seed)]


@pytest.mark.parametrize("seed", [12345, 3])
def test_paired_tests_equal_the_sacrebleu_command_line(tmp_path, seed):
    references = make_references(120, seed=9)
    base = perturb(references, 0.30, seed=3)
    # Half the sentences from another draw at the same error rate: a close call either way.
    other = perturb(references, 0.30, seed=4)
    close = [base[i] if i % 2 else other[i] for i in range(len(base))]
    systems = [("base", base), ("close", close), ("better", perturb(references, 0.15, seed=5))]
    comparison = compare_systems(systems, references, n_bootstrap=300, n_trials=500, seed=seed)
    bootstrap = sacrebleu_cli(tmp_path, references, systems, "--paired-bs", "--paired-bs-n", "300", seed=seed)
    randomization = sacrebleu_cli(tmp_path, references, systems, "--paired-ar", "--paired-ar-n", "500", seed=seed)
    for row, bs, ar in zip(comparison.rows, bootstrap, randomization):
        assert row.score == bs["score"] == ar["score"]
        assert row.mean == bs["mean"] and row.ci == bs["ci"]
        assert row.p_bootstrap == bs["p_value"] and row.p_randomization == ar["p_value"]
    base, close, better = comparison.rows
    assert base.p_bootstrap is None and base.p_randomization is None
    assert better.p_bootstrap < 0.01 and better.p_randomization < 0.01
    assert close.p_bootstrap > 0.05 and close.p_randomization > 0.05  # a close call is not significant


def test_an_output_equal_to_the_baseline_is_not_a_significant_difference(tmp_path):
    """The observed difference is exactly 0, and P(|difference| >= 0) = 1 under the null; sacreBLEU's
    own command line prints its smallest p for it (it counts only resamples strictly beyond)."""
    references = make_references(60, seed=9)
    base = perturb(references, 0.30, seed=3)
    systems = [("base", base), ("same", list(base)), ("other", perturb(references, 0.30, seed=4))]
    comparison = compare_systems(systems, references, n_bootstrap=300, n_trials=500)
    same, other = comparison.rows[1:]
    assert same.score == comparison.rows[0].score
    assert same.p_bootstrap == 1.0 and same.p_randomization == 1.0
    cli = sacrebleu_cli(tmp_path, references, systems[:2], "--paired-bs", "--paired-bs-n", "300", seed=12345)
    assert cli[1]["p_value"] < 0.01  # what the correction is for
    assert other.p_bootstrap < 1.0


def exact_randomisation_p(base, system, references):
    """The exact paired randomisation test (Riezler & Maxwell 2005, every shuffle enumerated): the
    share of the 2^k ways to swap the k differing sentences between the two systems whose corpus
    BLEU difference is at least the observed one in absolute value."""
    differing = [i for i in range(len(base)) if base[i] != system[i]]
    bleu = lambda hypotheses: BLEU().corpus_score(hypotheses, [references]).score
    observed = abs(bleu(base) - bleu(system))
    at_least = 0
    for mask in range(2 ** len(differing)):
        a, b = list(base), list(system)
        for bit, i in enumerate(differing):
            if mask >> bit & 1:
                a[i], b[i] = b[i], a[i]
        at_least += abs(bleu(a) - bleu(b)) >= observed
    return at_least / 2 ** len(differing)


@pytest.mark.parametrize("differing", [1, 3, 6])
def test_randomisation_p_counts_the_shuffles_that_reproduce_the_observed_difference(tmp_path, differing):
    """With few sentences differing, many shuffles reproduce the observed difference exactly (for one
    sentence every shuffle does: it is swapped or not); they count, and p approaches the exact test's.
    sacreBLEU counts only shuffles strictly beyond and prints its smallest p for one sentence."""
    references = make_references(60, seed=9)
    base = perturb(references, 0.30, seed=3)
    other = perturb(references, 0.30, seed=4)
    changed = [i for i in range(len(base)) if other[i] != base[i]][:differing]
    system = [other[i] if i in changed else base[i] for i in range(len(base))]
    row = compare_systems([("base", base), ("system", system)], references, n_bootstrap=100, n_trials=2000).rows[1]
    exact = exact_randomisation_p(base, system, references)
    assert abs(row.p_randomization - exact) < 0.05, (row.p_randomization, exact)  # 2,000 shuffles: sd <= 0.012
    if differing == 1:
        assert exact == 1.0 and row.p_randomization == 1.0
        cli = sacrebleu_cli(tmp_path, references, [("base", base), ("system", system)], "--paired-ar",
                            "--paired-ar-n", "2000", seed=12345)
        assert cli[1]["p_value"] == 1 / 2001  # what the count is for


def test_compare_systems_needs_resampling_and_parallel_text():
    references = make_references(20, seed=10)
    with pytest.raises(ValueError, match="--bootstrap 1000, not 0"):
        compare_systems([("a", references)], references, n_bootstrap=0)
    with pytest.raises(ValueError, match="19 hypotheses but 20 references"):
        compare_systems([("a", references), ("b", references[:19])], references)


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


def _random_segmented_lines(seed, n_lines=300):
    """Lines of subword-nmt and SentencePiece pieces, with the edge cases of both schemes: a
    trailing "@@" (a hypothesis cut inside a word), doubled and edge spaces, a lone "▁", CJK text."""
    rnd = random.Random(seed)
    pieces = WORDS + ["inten@@", "pleas@@", "@@", "\u2581", "\u2581the", "\u2581猫", "今天", ".", "a@@b", ""]
    return [
        rnd.choice(["", " ", "  "]).join(rnd.choice(pieces) for _ in range(rnd.randint(0, 12)))
        + rnd.choice(["", " ", "@@", " \u2581"])
        for _ in range(n_lines)
    ]


def test_remove_bpe_equals_fairseq_post_process():
    """The copy in fairseq_kd.scoring.detok (kept so that scoring needs neither fairseq nor torch)
    gives fairseq's text on hand-picked, random and real segmented lines."""
    data_utils = pytest.importorskip("fairseq.data.data_utils", reason="fairseq not installed")
    lines = ["a b@@ c d@@", "\u2581x y \u2581z", "plain", "", "e@@ f@@ g .", *_random_segmented_lines(seed=11)]
    real = {"subword_nmt": SHARED_DATA / "iwslt14-de-en" / "bpe" / "test.en"}
    for scheme in ("subword_nmt", "sentencepiece", "none"):
        corpus = []
        if scheme in real and real[scheme].is_file():
            corpus = real[scheme].read_text(encoding="utf-8").splitlines()[:2000]
        for line in lines + corpus:
            assert remove_bpe(line, scheme) == data_utils.post_process(line, scheme), (scheme, line)


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
    # the one wording of path problems (fairseq_kd.errors.path_problem), a user error
    with pytest.raises(PathError, match="absent.txt': no such file"):
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


def test_detok_hf_without_transformers_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    """Scoring runs where only sacreBLEU is installed; --detok-hf then says how to install what it
    needs, in one line. (Its decoding is checked against the tokenizers' own in
    tests/test_recipe_hf_teacher.py.)"""
    from fairseq_kd.cli import score
    from fairseq_kd.scoring.detok import load_hf_tokenizer

    output, references, model = tmp_path / "gen.out", tmp_path / "ref.txt", tmp_path / "teacher"
    output.write_text(GENERATE_OUTPUT, encoding="utf-8")
    references.write_text("".join(f"ref {i}\n" for i in range(11)), encoding="utf-8")
    model.mkdir()
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    load_hf_tokenizer.cache_clear()
    with pytest.raises(SystemExit) as exit_:
        score.cli_main(["--generate-output", str(output), "--detok-hf", str(model), "--ref", str(references),
                        "--ref-is-plain"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--detok-hf needs transformers: pip install 'fairseq-kd[hf]'" in error
    # the tokenizer replaces BPE removal and Moses detokenisation; both at once is refused
    with pytest.raises(ValueError, match="--detok-hf .* drop --remove-bpe and --detok-moses"):
        detokenize_lines(["a b"], "sentencepiece", None, hf_folder=str(model))
    with pytest.raises(SystemExit):
        score.cli_main(["--generate-output", str(output), "--detok-hf", str(model), "--detok-moses", "en"])
    assert "drop --remove-bpe and --detok-moses" in capsys.readouterr().err


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
        "import fairseq_kd.figures.draw, fairseq_kd.figures.training_log, fairseq_kd.cli.score, fairseq_kd.cli.report, fairseq_kd.cli.plot\n"
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
