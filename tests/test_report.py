"""fairseq-kd-score and fairseq-kd-report end to end on fairseq-generate files written in the test:
every number is compared with sacreBLEU run on the plain text the files were made from (the
sacrebleu command line, its corpus score, or a slow loop over explicit resamples)."""
import csv
import json
import random

import numpy as np
import pytest
import sacrebleu
from sacrebleu.metrics.bleu import BLEU
from sacremoses import MosesTokenizer

from conftest import sacrebleu_command_line
from fairseq_kd.cli import report as report_cli
from fairseq_kd.cli import score as score_cli

WORDS = (
    "the a cat dog bird sat ran flew on under over mat house garden tree big small red blue "
    "quickly slowly today yesterday he she it's isn't was is and but"
).split()


def plain_references(n_sentences, seed):
    rnd = random.Random(seed)
    sentences = []
    for _ in range(n_sentences):
        words = [rnd.choice(WORDS) for _ in range(rnd.randint(4, 14))]
        words.insert(rnd.randint(1, len(words) - 1), words.pop(0) + ",")
        sentences.append(" ".join(words).capitalize() + rnd.choice([".", "?", "!"]))
    return sentences


def plain_hypotheses(references, error_rate, seed):
    rnd = random.Random(seed)
    hypotheses = []
    for reference in references:
        words = reference.split()
        words = [word if rnd.random() > error_rate else rnd.choice(WORDS) for word in words[:-1]] + words[-1:]
        hypotheses.append(" ".join(words))
    return hypotheses


def tokenise_like_iwslt14(line):
    """What the IWSLT'14 recipe feeds the model: Moses tokens, then BPE pieces ("@@ ")."""
    tokens = MosesTokenizer(lang="en").tokenize(line, escape=True)
    pieces = []
    for token in tokens:
        pieces.append(token[:3] + "@@ " + token[3:] if len(token) >= 5 else token)
    return " ".join(pieces)


def write_generate_output(path, hypotheses, references, seed):
    """A fairseq-generate file (no --remove-bpe) with sentences in shuffled batch order."""
    order = list(range(len(references)))
    random.Random(seed).shuffle(order)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("2024-05-01 10:00:00 | INFO | fairseq_cli.generate | loading model(s)\n")
        for i in order:
            hypothesis = tokenise_like_iwslt14(hypotheses[i])
            handle.write(f"S-{i}\tquelle\nT-{i}\t{tokenise_like_iwslt14(references[i])}\n")
            handle.write(f"H-{i}\t-0.52\t{hypothesis}\nD-{i}\t-0.52\t{hypothesis}\nP-{i}\t-0.1 -0.2\n")
        handle.write("Generate test with beam=5: BLEU4 = 10.00\n")
    return path


DETOK = ["--remove-bpe", "subword_nmt", "--detok-moses", "en"]


@pytest.fixture(scope="module")
def test_set(tmp_path_factory):
    """Plain references and three systems of different quality, as generate files."""
    folder = tmp_path_factory.mktemp("generate")
    references = plain_references(120, seed=0)
    systems = {
        "teacher": plain_hypotheses(references, 0.12, seed=1),
        "no_kd": plain_hypotheses(references, 0.30, seed=2),
        "word_kd": plain_hypotheses(references, 0.27, seed=3),
    }
    files = {
        name: write_generate_output(folder / f"{name}.txt", hypotheses, references, seed=index)
        for index, (name, hypotheses) in enumerate(systems.items())
    }
    return references, systems, files


def run_score(*argv):
    score_cli.cli_main([str(a) for a in argv])


def sacrebleu_on_rows(hypotheses, references, rows):
    return np.array(
        [sacrebleu.corpus_bleu([hypotheses[i] for i in row], [[references[i] for i in row]]).score for row in rows]
    )


# --------------------------------------------------------------------------- fairseq-kd-score


def test_score_generate_output_equals_sacrebleu_on_plain_text(test_set, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SACREBLEU_SEED", raising=False)  # sacreBLEU's default seed, as ours
    references, systems, files = test_set
    output = tmp_path / "word_kd.json"
    run_score("--generate-output", files["word_kd"], *DETOK, "--system", "word_kd", "--output-json", output)
    record = json.loads(output.read_text())
    expected = sacrebleu_command_line(tmp_path, references, [("word_kd", systems["word_kd"])], "--confidence")
    assert record["bleu"] == sacrebleu.corpus_bleu(systems["word_kd"], [references]).score
    assert record["signature"] == expected["signature"]
    assert record["mean"] == pytest.approx(expected["confidence_mean"], abs=1e-9)
    assert record["ci"] == pytest.approx(expected["confidence_var"], abs=1e-9)
    assert record["system"] == "word_kd" and record["n_sentences"] == 120 and record["n_bootstrap"] == 1000
    assert record["inputs"]["hypothesis_lines"] == "D-"
    # the scored text itself: detokenised, in sentence-id order
    assert record["hypotheses"] == systems["word_kd"] and record["references"] == references
    assert record["paired"] is None
    printed = capsys.readouterr().out
    assert f"word_kd: BLEU = {record['bleu']:.2f}" in printed and record["signature"] in printed


def test_score_hyp_and_ref_files(test_set, tmp_path):
    references, systems, _ = test_set
    hyp = tmp_path / "hyp.txt"
    hyp.write_text("".join(tokenise_like_iwslt14(h) + "\n" for h in systems["no_kd"]), encoding="utf-8")
    plain_ref = tmp_path / "ref.txt"
    plain_ref.write_text("".join(r + "\n" for r in references), encoding="utf-8")
    output = tmp_path / "out.json"
    run_score("--hyp", hyp, "--ref", plain_ref, "--ref-is-plain", *DETOK, "--bootstrap", "0", "--output-json", output)
    record = json.loads(output.read_text())
    assert record["bleu"] == sacrebleu.corpus_bleu(systems["no_kd"], [references]).score
    assert record["system"] == "hyp" and record["ci"] is None and record["n_bootstrap"] == 0
    # The same reference, tokenised: now it is detokenised too, with the same result.
    tokenised_ref = tmp_path / "ref.tok.txt"
    tokenised_ref.write_text("".join(tokenise_like_iwslt14(r) + "\n" for r in references), encoding="utf-8")
    run_score("--hyp", hyp, "--ref", tokenised_ref, *DETOK, "--bootstrap", "0",
              "--output-json", output, "--overwrite")
    assert json.loads(output.read_text())["bleu"] == record["bleu"]


def test_generate_output_scored_against_the_untouched_reference_file(test_set, tmp_path, capsys):
    """--ref replaces the T- lines (which fairseq rebuilds from the binarised data) by the test set's
    own text, line i for sentence id i; the generate file's shuffled order does not matter."""
    references, systems, files = test_set
    raw_lines = list(references)
    raw_lines[3] = "The untouched reference, with a word the dictionary lacks: Zürich."
    raw = tmp_path / "test.en"
    raw.write_text("".join(line + "\n" for line in raw_lines), encoding="utf-8")
    output = tmp_path / "word_kd.json"
    run_score("--generate-output", files["word_kd"], *DETOK, "--ref", raw, "--ref-is-plain",
              "--baseline", f"no_kd={files['no_kd']}", "--bootstrap", "100", "--ar-trials", "100",
              "--output-json", output)
    record = json.loads(output.read_text())
    assert record["bleu"] == sacrebleu.corpus_bleu(systems["word_kd"], [raw_lines]).score
    assert record["bleu"] != sacrebleu.corpus_bleu(systems["word_kd"], [references]).score
    assert record["references"] == raw_lines and record["inputs"]["ref"] == str(raw)
    # the baseline, a generate output too, was scored against the same file (else: refused)
    assert record["paired"]["baseline_bleu"] == sacrebleu.corpus_bleu(systems["no_kd"], [raw_lines]).score
    short = tmp_path / "short.en"
    short.write_text("".join(line + "\n" for line in raw_lines[:-1]), encoding="utf-8")
    expect_error(capsys, ["--generate-output", files["word_kd"], *DETOK, "--ref", short, "--ref-is-plain"],
                 "the test set has 119 sentences")


def test_paired_tests_equal_sacrebleu_command_line_and_baseline_kinds_agree(test_set, tmp_path):
    references, systems, files = test_set
    baseline_json = tmp_path / "no_kd.json"
    run_score("--generate-output", files["no_kd"], *DETOK, "--system", "no_kd", "--output-json", baseline_json)
    outputs = {}
    for kind, baseline in (("json", baseline_json), ("generate", files["no_kd"])):
        outputs[kind] = tmp_path / f"word_kd_{kind}.json"
        run_score("--generate-output", files["word_kd"], *DETOK, "--system", "word_kd", "--bootstrap", "50",
                  "--ar-trials", "500", "--seed", "5", "--baseline", f"no_kd={baseline}", "--output-json", outputs[kind])
    paired = json.loads(outputs["json"].read_text())["paired"]
    assert paired == json.loads(outputs["generate"].read_text())["paired"]

    pair = [("no_kd", systems["no_kd"]), ("word_kd", systems["word_kd"])]
    bootstrap = sacrebleu_command_line(tmp_path, references, pair, "--paired-bs", "--paired-bs-n", "50", seed=5)
    randomization = sacrebleu_command_line(tmp_path, references, pair, "--paired-ar", "--paired-ar-n", "500", seed=5)
    assert paired["baseline"] == "no_kd"
    assert paired["difference"] == bootstrap[1]["BLEU"]["score"] - bootstrap[0]["BLEU"]["score"]
    assert paired["p_bootstrap"] == bootstrap[1]["BLEU"]["p_value"]
    assert paired["p_randomization"] == randomization[1]["BLEU"]["p_value"]
    assert 0.01 < paired["p_bootstrap"] < 1  # a close call, so the comparison is not trivially small


def test_markdown_table_gets_one_header_and_a_row_per_run(test_set, tmp_path):
    _, _, files = test_set
    table = tmp_path / "scores.md"
    run_score("--generate-output", files["no_kd"], *DETOK, "--system", "no_kd", "--bootstrap", "0", "--output-md", table)
    run_score("--generate-output", files["teacher"], *DETOK, "--system", "teacher", "--bootstrap", "0", "--output-md", table)
    lines = table.read_text().splitlines()
    assert len(lines) == 4 and lines[0].startswith("| System | BLEU |")
    assert lines[2].startswith("| no_kd | ") and lines[3].startswith("| teacher | ")
    # every row has as many cells as the header, despite the '|' inside the signature
    cells = [len(line.replace("\\|", "").split("|")) for line in lines]
    assert len(set(cells)) == 1


def expect_error(capsys, argv, *fragments, runner=run_score):
    with pytest.raises(SystemExit) as raised:
        runner(*argv)
    assert raised.value.code == 2
    message = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_score_errors_name_the_flag_and_file(test_set, tmp_path, capsys):
    _, _, files = test_set
    missing = tmp_path / "missing.txt"
    expect_error(capsys, ["--generate-output", missing], "--generate-output", str(missing), "no such file")
    hyp, ref, empty = tmp_path / "h.txt", tmp_path / "r.txt", tmp_path / "empty.txt"
    hyp.write_text("a b\nc d\ne f\n")
    ref.write_text("a b\nc d\n")
    empty.write_text("")
    expect_error(capsys, ["--hyp", hyp, "--ref", ref], str(hyp), "3 lines", str(ref), "has 2")
    expect_error(capsys, ["--hyp", empty, "--ref", ref], str(empty), "is empty")
    expect_error(capsys, ["--generate-output", files["no_kd"], "--hyp", hyp, "--ref", ref], "not both")
    expect_error(capsys, ["--hyp", hyp], "--generate-output FILE, or both")
    expect_error(capsys, ["--generate-output", files["no_kd"], "--bootstrap", "5"], "at least 40")
    existing = tmp_path / "exists.json"
    existing.write_text("{}")
    expect_error(capsys, ["--generate-output", files["no_kd"], "--output-json", existing], "--overwrite")
    unrelated = tmp_path / "notes.md"
    unrelated.write_text("# my notes\n")
    expect_error(capsys, ["--generate-output", files["no_kd"], "--output-md", unrelated], "not a score table")
    assert unrelated.read_text() == "# my notes\n"
    expect_error(capsys, ["--generate-output", files["no_kd"], "--baseline", "no_kd"], "NAME=FILE")


def test_score_rejects_baseline_on_another_test_set_or_tampered(test_set, tmp_path, capsys):
    references, systems, files = test_set
    other = write_generate_output(tmp_path / "other.txt", systems["no_kd"][:100], references[:100], seed=9)
    expect_error(capsys, ["--generate-output", files["word_kd"], *DETOK, "--baseline", f"other={other}"],
                 "not the same test set")
    record_path = tmp_path / "no_kd.json"
    run_score("--generate-output", files["no_kd"], *DETOK, "--bootstrap", "0", "--output-json", record_path)
    record = json.loads(record_path.read_text())
    for key, change, message in (("bleu", lambda value: value + 1.0, "is not the BLEU of its text"),
                                 ("hypotheses", lambda lines: lines[1:] + lines[:1], "is not the BLEU of its text"),
                                 ("references", lambda lines: lines[:-1] + ["x"], "do not match references_sha256"),
                                 ("format", lambda _: "fairseq-kd-score/1", "not a score record")):
        record_path.write_text(json.dumps({**record, key: change(record[key])}))
        expect_error(capsys, ["--generate-output", files["word_kd"], *DETOK, "--baseline", f"no_kd={record_path}"],
                     str(record_path), message)
    # scored with another tokenizer: not comparable
    zh_path = tmp_path / "zh.json"
    run_score("--generate-output", files["no_kd"], *DETOK, "--tokenize", "zh", "--bootstrap", "0", "--output-json", zh_path)
    expect_error(capsys, ["--generate-output", files["word_kd"], *DETOK, "--baseline", f"no_kd={zh_path}"],
                 "different sacreBLEU settings")


# --------------------------------------------------------------------------- fairseq-kd-report


def run_report(*argv):
    report_cli.cli_main([str(a) for a in argv])


def test_report_numbers_equal_sacrebleu(test_set, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SACREBLEU_SEED", raising=False)  # sacreBLEU's default seed, as ours
    references, systems, files = test_set
    no_kd_json = tmp_path / "no_kd.json"
    run_score("--generate-output", files["no_kd"], *DETOK, "--system", "no_kd", "--output-json", no_kd_json)
    sidecar = tmp_path / "sizes.json"
    sidecar.write_text(json.dumps({
        "teacher": {"params": 31_500_000, "sents_per_sec": 40.0},
        "no_kd": {"params": 12_000_000},
        "unrelated": {"params": 5},  # other systems in a shared sidecar are ignored
    }))
    capsys.readouterr()
    prefix = tmp_path / "out" / "table"
    run_report(
        "--system", f"teacher={files['teacher']}", "--system", f"no_kd={no_kd_json}",
        "--system", f"word_kd={files['word_kd']}", *DETOK, "--baseline", "no_kd",
        "--sidecar", sidecar, "--speed", "teacher=42.5", "--params", "word_kd=1.2e7",
        "--out-prefix", prefix,
    )
    printed = capsys.readouterr().out
    markdown = (tmp_path / "out" / "table.md").read_text()
    assert printed == markdown
    with open(tmp_path / "out" / "table.csv", newline="") as handle:
        rows = {row["system"]: row for row in csv.DictReader(handle)}
    report = json.loads((tmp_path / "out" / "table.json").read_text())
    assert [s["system"] for s in report["systems"]] == ["teacher", "no_kd", "word_kd"]

    # Every number against the sacrebleu command line on the same text, the baseline first.
    ordered = [("no_kd", systems["no_kd"]), ("teacher", systems["teacher"]), ("word_kd", systems["word_kd"])]
    bootstrap = {row["system"].split("sacrebleu_")[-1][:-4]: row["BLEU"] for row in
                 sacrebleu_command_line(tmp_path, references, ordered, "--paired-bs")}
    randomization = {row["system"].split("sacrebleu_")[-1][:-4]: row["BLEU"] for row in
                     sacrebleu_command_line(tmp_path, references, ordered, "--paired-ar")}
    for entry in report["systems"]:
        name, bs, ar = entry["system"], bootstrap[entry["system"]], randomization[entry["system"]]
        assert entry["bleu"] == bs["score"] == sacrebleu.corpus_bleu(systems[name], [references]).score
        assert entry["mean"] == bs["mean"] and entry["ci"] == bs["ci"]
        assert entry["p_bootstrap"] == bs["p_value"] and entry["p_randomization"] == ar["p_value"]
        row = rows[name]
        assert float(row["bleu"]) == entry["bleu"] and float(row["ci"]) == entry["ci"]
        assert f"| {name}" in markdown and f"{entry['bleu']:.2f} | {entry['mean']:.2f} ± {entry['ci']:.2f}" in markdown
    assert report["signature"].startswith("nrefs:1|bs:1000|seed:12345|")
    assert rows["no_kd"]["is_baseline"] == "True" and rows["no_kd"]["p_bootstrap"] == ""
    assert float(rows["teacher"]["difference"]) == pytest.approx(
        sacrebleu.corpus_bleu(systems["teacher"], [references]).score
        - sacrebleu.corpus_bleu(systems["no_kd"], [references]).score, abs=1e-12)
    assert float(rows["teacher"]["p_bootstrap"]) < 0.01  # a much better system
    assert rows["teacher"]["params"] == "31500000" and float(rows["teacher"]["sents_per_sec"]) == 42.5
    assert rows["word_kd"]["params"] == "12000000" and rows["word_kd"]["sents_per_sec"] == ""
    assert "31.50M" in markdown and "42.5" in markdown and "no_kd (baseline)" in markdown


def test_report_intervals_and_p_values_equal_slow_loop(test_set, tmp_path, capsys):
    """With 50 resamples and another seed: every interval and the paired bootstrap p by sacreBLEU's
    corpus BLEU on each explicit resample, with the definitions written out here (the mean and
    half the 1/40 order-statistic interval; Moses' centred absolute differences, +1 smoothed)."""
    references, systems, files = test_set
    prefix = tmp_path / "small"
    run_report("--system", f"no_kd={files['no_kd']}", "--system", f"word_kd={files['word_kd']}", *DETOK,
               "--baseline", "no_kd", "--bootstrap", "50", "--ar-trials", "200", "--seed", "21", "--out-prefix", prefix)
    report = json.loads((tmp_path / "small.json").read_text())
    rows = np.random.default_rng(21).choice(120, size=(50, 120), replace=True)
    scores = {name: sacrebleu_on_rows(systems[name], references, rows) for name in ("no_kd", "word_kd")}
    for entry in report["systems"]:
        ordered = np.sort(scores[entry["system"]])
        assert entry["mean"] == pytest.approx(ordered.mean(), rel=1e-5)
        assert entry["ci"] == pytest.approx((ordered[-2] - ordered[1]) / 2, rel=1e-4)  # 50 // 40 = 1
    word_kd = report["systems"][1]
    observed = abs(word_kd["difference"])
    differences = np.abs(scores["word_kd"] - scores["no_kd"])
    expected_p = (np.sum(differences - differences.mean() > observed) + 1) / 51
    assert word_kd["p_bootstrap"] == pytest.approx(expected_p)
    assert report["signature"].startswith("nrefs:1|bs:50|seed:21|") and "ar:200" in report["signature"]


def test_length_column_is_the_hypotheses_words_over_the_references_in_bleus_tokens(test_set, tmp_path, capsys):
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    references, systems, files = test_set
    words = lambda lines: sum(len(Tokenizer13a()(line).split()) for line in lines)
    run_report(*(f"--system={name}={files[name]}" for name in ("no_kd", "word_kd")), *DETOK, "--bootstrap", "0",
               "--out-prefix", tmp_path / "t")
    markdown = capsys.readouterr().out
    rows = {row["system"]: row for row in json.loads((tmp_path / "t.json").read_text())["systems"]}
    for name in ("no_kd", "word_kd"):
        expected = words(systems[name]) / words(references)
        assert rows[name]["length_ratio"] == pytest.approx(expected, rel=1e-12) and expected != 1
        assert f"| {expected:.3f} |" in next(line for line in markdown.splitlines() if line.startswith(f"| {name} "))
    assert "| chrF | chrF++ | Length |" in markdown and "Length: the hypotheses' length over the references'" in markdown


def test_lead_closed_is_the_share_of_the_teachers_lead_over_the_baseline(test_set, tmp_path, capsys):
    references, systems, files = test_set
    bleu = {name: sacrebleu.corpus_bleu(hypotheses, [references]).score for name, hypotheses in systems.items()}
    assert bleu["teacher"] > bleu["word_kd"] > bleu["no_kd"]  # the fixture's order, so the share is in (0, 1)
    both = [f"--system={name}={files[name]}" for name in ("teacher", "no_kd", "word_kd")] + DETOK
    capsys.readouterr()
    run_report(*both, "--baseline", "no_kd", "--teacher", "teacher", "--bootstrap", "40", "--ar-trials", "100",
               "--out-prefix", tmp_path / "t")
    markdown = capsys.readouterr().out
    rows = {row["system"]: row for row in json.loads((tmp_path / "t.json").read_text())["systems"]}
    share = (bleu["word_kd"] - bleu["no_kd"]) / (bleu["teacher"] - bleu["no_kd"])
    assert rows["word_kd"]["lead_closed"] == pytest.approx(share, rel=1e-12) and 0 < share < 1
    assert rows["teacher"]["lead_closed"] is None and rows["no_kd"]["lead_closed"] is None
    table = [line for line in markdown.splitlines() if line.startswith("|")]
    assert "| p (ar) | Lead closed | Params |" in table[0] and len(table[1].split("|")) == len(table[0].split("|"))
    assert f"| {100 * share:.0f}% |" in table[4] and "Lead closed: (BLEU - no_kd's) / (teacher's - no_kd's)" in markdown
    # the roles swapped: a "teacher" below the baseline has no lead, so no share (and no refusal)
    run_report(*both, "--baseline", "teacher", "--teacher", "no_kd", "--bootstrap", "40", "--ar-trials", "100")
    assert "(none here: no_kd does not beat teacher)" in capsys.readouterr().out
    # without --teacher the table keeps its columns
    run_report(*both, "--baseline", "no_kd", "--bootstrap", "40", "--ar-trials", "100")
    assert "Lead closed" not in capsys.readouterr().out
    for argv in (both + ["--teacher", "teacher"], both + ["--baseline", "no_kd", "--teacher", "nobody"]):
        expect_error(capsys, argv, "--teacher", "needs --baseline", runner=run_report)


def test_report_errors(test_set, tmp_path, capsys):
    references, systems, files = test_set
    both = ["--system", f"a={files['no_kd']}", "--system", f"b={files['word_kd']}", *DETOK]
    expect_error(capsys, both + ["--baseline", "c"], "--baseline 'c'", runner=run_report)
    expect_error(capsys, ["--system", f"a={files['no_kd']}", "--system", f"a={files['word_kd']}"],
                 "repeated: a", runner=run_report)
    expect_error(capsys, both + ["--params", "a=many"], "--params", "not a number", runner=run_report)
    expect_error(capsys, both + ["--speed", "zzz=3"], "unknown systems", runner=run_report)
    expect_error(capsys, ["--system", f"a={tmp_path / 'nope.txt'}"], "nope.txt", "no such file", runner=run_report)
    other = write_generate_output(tmp_path / "other.txt", systems["no_kd"][:100], references[:100], seed=9)
    expect_error(capsys, both + ["--system", f"c={other}"], "not the same test set", runner=run_report)
    prefix = tmp_path / "t"
    (tmp_path / "t.csv").write_text("keep me")
    expect_error(capsys, both + ["--out-prefix", prefix], "t.csv", "--overwrite", runner=run_report)
    assert (tmp_path / "t.csv").read_text() == "keep me"


# --------------------------------------------------------------------------- complete outputs or none


def truncated_copy(source, destination, keep_sentences):
    """The first ``keep_sentences`` sentences of a generate file (in its printed order), the next
    line cut in the middle, no summary line: a run killed while writing."""
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    kept, seen = [], []
    for line in lines:
        if line[:2] in ("S-", "T-", "H-", "D-", "P-"):
            sentence = line.split("\t")[0].split("-")[1]
            if sentence not in seen:
                seen.append(sentence)
            if len(seen) > keep_sentences:
                kept.append(line[: len(line) // 2])
                break
        kept.append(line)
    destination.write_text("".join(kept), encoding="utf-8")
    return destination


def test_score_and_report_refuse_a_truncated_output(test_set, tmp_path, capsys):
    references, _, files = test_set
    cut = truncated_copy(files["word_kd"], tmp_path / "cut.txt", 96)
    message = expect_error(capsys, ["--generate-output", cut, *DETOK], "incomplete fairseq-generate output",
                           "summary line", "--allow-partial")
    assert "9" in message  # the count of sentences found is named
    refs = tmp_path / "test.ref"
    refs.write_text("".join(r + "\n" for r in references))
    expect_error(capsys, ["--generate-output", cut, *DETOK, "--expected-from", refs],
                 f"the test set has {len(references)} sentences")
    expect_error(capsys, ["--system", f"a={files['no_kd']}", "--system", f"b={cut}", *DETOK],
                 "incomplete fairseq-generate output", runner=run_report)
    # the complete files pass with the expected count
    run_score("--generate-output", files["word_kd"], *DETOK, "--bootstrap", "0", "--expected-from", refs)
    expect_error(capsys, ["--generate-output", files["word_kd"], *DETOK, "--expected-sentences", "121"],
                 "the test set has 121 sentences", "1 sentence ids of 0..120 have no hypothesis")


def test_partial_score_only_behind_the_flag_and_says_so(test_set, tmp_path, capsys):
    references, _, files = test_set
    cut = truncated_copy(files["word_kd"], tmp_path / "cut.txt", 96)
    record_path = tmp_path / "partial.json"
    run_score("--generate-output", cut, *DETOK, "--bootstrap", "0", "--allow-partial",
              "--expected-sentences", len(references), "--output-json", record_path, "--output-md", tmp_path / "t.md")
    out = capsys.readouterr().out
    record = json.loads(record_path.read_text())
    assert record["partial"]["n_expected"] == len(references)
    assert record["partial"]["n_sentences"] == record["n_sentences"] < len(references)
    assert f"of {len(references)} expected sentences" in out and "PARTIAL" in out
    assert f"of {len(references)} (partial)" in (tmp_path / "t.md").read_text()
    complete = tmp_path / "complete.json"
    run_score("--generate-output", files["word_kd"], *DETOK, "--bootstrap", "0", "--output-json", complete)
    assert json.loads(complete.read_text())["partial"] is None
    # a partial record is refused by the report unless the flag is given again; then it is named
    expect_error(capsys, ["--system", f"p={record_path}"], "partial score", "--allow-partial", runner=run_report)
    run_report("--system", f"p={record_path}", "--bootstrap", "0", "--allow-partial", "--out-prefix", tmp_path / "r")
    captured = capsys.readouterr()
    assert "PARTIAL: p was scored on" in captured.out and "PARTIAL" in captured.err
    assert json.loads((tmp_path / "r.json").read_text())["partial"]["p"]["n_expected"] == len(references)
    assert "PARTIAL" in (tmp_path / "r.md").read_text()
    # a complete record of another size than expected is refused too
    expect_error(capsys, ["--system", f"c={complete}", "--expected-sentences", "500"], "500 are expected",
                 runner=run_report)


def test_outputs_never_overwrite_inputs(test_set, tmp_path, capsys):
    references, _, files = test_set
    generate = tmp_path / "gen.txt"
    generate.write_bytes(files["no_kd"].read_bytes())
    before = generate.read_bytes()
    expect_error(capsys, ["--generate-output", generate, "--output-json", generate, "--overwrite"],
                 "--output-json", "is the --generate-output input file")
    expect_error(capsys, ["--generate-output", generate, "--output-md", tmp_path / "." / "gen.txt"],
                 "--output-md", "input file")
    record = tmp_path / "base.json"
    run_score("--generate-output", files["word_kd"], *DETOK, "--bootstrap", "0", "--output-json", record)
    record_before = record.read_bytes()
    expect_error(capsys, ["--generate-output", generate, *DETOK, "--baseline", f"b={record}",
                          "--output-json", record, "--overwrite"], "is the --baseline input file")
    hyp, ref = tmp_path / "h.txt", tmp_path / "r.txt"
    hyp.write_text("a b\n")
    ref.write_text("a b\n")
    expect_error(capsys, ["--hyp", hyp, "--ref", ref, "--output-json", ref, "--overwrite"], "is the --ref input file")
    # the report: an --out-prefix file that is a --system input
    expect_error(capsys, ["--system", f"b={record}", "--out-prefix", tmp_path / "base", "--overwrite"],
                 "--out-prefix", "is the --system b input file", runner=run_report)
    assert generate.read_bytes() == before and record.read_bytes() == record_before
    assert ref.read_text() == "a b\n"
