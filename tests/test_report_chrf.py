"""chrF and chrF++ beside BLEU in every score record, score table and report: sacreBLEU's own
CHRF (word_order 0 and 2) of exactly the scored text, in columns added after the existing ones."""
import csv
import json

from sacrebleu.metrics.chrf import CHRF

from fairseq_kd.cli.report import cli_main as report_main
from fairseq_kd.cli.score import cli_main as score_main
from fairseq_kd.scoring.bleu import chrf_scores

REFERENCES = ["the cat sat on the mat", "a dog barked at the postman", "It rained all day in Paris",
              "she reads a book every week", "we will meet at noon tomorrow"] * 4
SYSTEMS = {
    "good": ["the cat sat on a mat", "a dog barked at the postman", "it rained all day in paris",
             "she reads one book each week", "we meet at noon tomorrow"] * 4,
    "poor": ["cat the mat", "dog postman", "rain Paris day", "book week she", "noon"] * 4,
}


def sacrebleu_chrf(hypotheses, references, word_order, lowercase=False):
    return CHRF(word_order=word_order, lowercase=lowercase).corpus_score(hypotheses, [references]).score


def test_chrf_scores_are_sacrebleus():
    for hypotheses in SYSTEMS.values():
        for lowercase in (False, True):
            scores = chrf_scores(hypotheses, REFERENCES, lowercase)
            assert scores["chrf"] == sacrebleu_chrf(hypotheses, REFERENCES, 0, lowercase)
            assert scores["chrfpp"] == sacrebleu_chrf(hypotheses, REFERENCES, 2, lowercase)
    assert chrf_scores(SYSTEMS["good"], REFERENCES)["chrf"] > chrf_scores(SYSTEMS["poor"], REFERENCES)["chrf"]


def _files(tmp_path):
    ref = tmp_path / "ref.txt"
    ref.write_text("\n".join(REFERENCES) + "\n", encoding="utf-8")
    hyps = {}
    for name, lines in SYSTEMS.items():
        hyps[name] = tmp_path / f"{name}.txt"
        hyps[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    return ref, hyps


def test_score_record_table_and_report_carry_chrf(tmp_path, capsys):
    ref, hyps = _files(tmp_path)
    records = {}
    for name, hyp in hyps.items():
        records[name] = tmp_path / f"{name}.json"
        score_main(["--hyp", str(hyp), "--ref", str(ref), "--system", name, "--bootstrap", "0",
                    "--output-json", str(records[name]), "--output-md", str(tmp_path / "scores.md")])
    printed = capsys.readouterr().out
    for name, path in records.items():
        record = json.loads(path.read_text())
        chrf, chrfpp = (sacrebleu_chrf(SYSTEMS[name], REFERENCES, order) for order in (0, 2))
        assert (record["chrf"], record["chrfpp"]) == (chrf, chrfpp)
        assert f"chrF = {chrf:.2f}, chrF++ = {chrfpp:.2f}" in printed
    table = (tmp_path / "scores.md").read_text().splitlines()
    assert table[0].startswith("| System | BLEU | μ ± 95% CI | Baseline | Δ BLEU | p (bs) | p (ar) | Sentences | "
                               "Signature |") and table[0].endswith("| chrF | chrF++ |")
    good = json.loads(records["good"].read_text())
    assert table[2].endswith(f"| {good['chrf']:.2f} | {good['chrfpp']:.2f} |")

    report_main(["--system", f"good={records['good']}", "--system", f"poor={records['poor']}", "--bootstrap", "100",
                 "--baseline", "poor", "--ar-trials", "100", "--out-prefix", str(tmp_path / "report")])
    markdown = (tmp_path / "report.md").read_text()
    assert "| Params | Speed (sent/s) | chrF | chrF++ |" in markdown
    assert "sacreBLEU's CHRF" in markdown
    rows = {row["system"]: row for row in json.loads((tmp_path / "report.json").read_text())["systems"]}
    with open(tmp_path / "report.csv", newline="") as handle:
        csv_rows = {row["system"]: row for row in csv.DictReader(handle)}
    for name in SYSTEMS:
        chrf, chrfpp = (sacrebleu_chrf(SYSTEMS[name], REFERENCES, order) for order in (0, 2))
        assert (rows[name]["chrf"], rows[name]["chrfpp"]) == (chrf, chrfpp)
        assert (float(csv_rows[name]["chrf"]), float(csv_rows[name]["chrfpp"])) == (chrf, chrfpp)
        assert f"| {chrf:.2f} | {chrfpp:.2f} |" in markdown
    assert list(csv_rows["good"])[-3:] == ["chrf", "chrfpp", "length_ratio"]
