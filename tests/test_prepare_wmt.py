"""WMT'14 En-De preparation: SGML test sets, the Moses chain of fairseq's WMT recipe, and the
entry point end to end on tiny archives laid out like the statmt.org releases."""
from __future__ import annotations

import hashlib
import json
import tarfile

from fairseq_kd_recipes.prepare.corpora import wmt14_en_de
from fairseq_kd_recipes.prepare.iwslt import read_segments
from fairseq_kd_recipes.prepare.textio import read_lines
from fairseq_kd_recipes.prepare.tokenize import MosesPreprocessor
from prepare_fixtures import add_to_tar, load_entry_point, sgm_text, synthetic_parallel
from test_prepare_iwslt import assert_binarized_equals_text


def test_sgm_segments(tmp_path):
    path = tmp_path / "newstest2014-deen-src.en.sgm"
    path.write_text(sgm_text(["Gutach: Increased safety for pedestrians", "They’re   not even 100 metres apart"],
                             "newstest2014", "en"), encoding="utf-8")
    assert read_segments(path) == ["Gutach: Increased safety for pedestrians", "They're   not even 100 metres apart"]


def test_wmt_moses_chain():
    english = MosesPreprocessor(wmt14_en_de.moses_config("en"))
    assert english("He said “hi” – then left… A state-of-the-art\u200bsystem.") == (
        "He said &quot; hi &quot; - then left ... A state @-@ of @-@ the @-@ art system ."
    )
    german = MosesPreprocessor(wmt14_en_de.moses_config("de"))
    assert german("„Das ist gut“, sagte er – 1.000 Euro.") == "&quot; Das ist gut &quot; , sagte er - 1.000 Euro ."


def _corpus_tgz(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, lines in members.items():
            add_to_tar(tar, name, "\n".join(lines) + "\n")


def test_wmt14_end_to_end(tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    corpora = {name: synthetic_parallel(60, "en", "de", seed=seed)
               for seed, name in enumerate(("europarl-v7", "commoncrawl", "news-commentary-v9"))}
    corpora["commoncrawl"][0][5] = "A well-known, long-standing example with many more words than its other side."
    corpora["commoncrawl"][1][5] = "Kurz."
    _corpus_tgz(archives / "training-parallel-europarl-v7.tgz",
                {f"training/europarl-v7.de-en.{lang}": corpora["europarl-v7"][i] for i, lang in enumerate(("en", "de"))})
    _corpus_tgz(archives / "training-parallel-commoncrawl.tgz",
                {f"commoncrawl.de-en.{lang}": corpora["commoncrawl"][i] for i, lang in enumerate(("en", "de"))})
    _corpus_tgz(archives / "training-parallel-nc-v9.tgz",
                {f"training/news-commentary-v9.de-en.{lang}": corpora["news-commentary-v9"][i] for i, lang in enumerate(("en", "de"))})
    newstest = {year: synthetic_parallel(7, "en", "de", seed=year) for year in (2013, 2014)}
    # Official text that punctuation normalisation and quote replacement would change.
    newstest[2014][0][2], newstest[2014][1][2] = "“It’s here” – he said…", "„Es ist da“ – sagte er…"
    newstest[2013][0][4], newstest[2013][1][4] = "Don’t  «go»!", "Geh‘ nicht  «weg»!"
    with tarfile.open(archives / "test.tgz", "w:gz") as tar:
        for i, lang in enumerate(("en", "de")):
            add_to_tar(tar, f"test/newstest2013-src.{lang}.sgm", sgm_text(newstest[2013][i], "newstest2013", lang))
    with tarfile.open(archives / "test-full.tgz", "w:gz") as tar:
        add_to_tar(tar, "test-full/newstest2014-deen-src.en.sgm", sgm_text(newstest[2014][0], "newstest2014", "en"))
        add_to_tar(tar, "test-full/newstest2014-deen-ref.de.sgm", sgm_text(newstest[2014][1], "newstest2014", "de", "refset"))
    pinned = tmp_path / "sums.json"  # the manifest's md5 values are those of the real test archives
    pinned.write_text(json.dumps({name: hashlib.sha256((archives / name).read_bytes()).hexdigest()
                                  for name in ("test.tgz", "test-full.tgz")}))
    workdir, dest = tmp_path / "work", tmp_path / "bin"
    entry = load_entry_point("examples/translation/wmt14_en_de/prepare.py")
    assert entry.cli_main(["--archives", str(archives), "--checksums", str(pinned), "--workdir", str(workdir),
                           "--dest", str(dest), "--bpe-merges", "60", "--workers", "1"]) == 0

    # Training text: the three corpora in order, Moses-tokenised with aggressive hyphen splitting, cased.
    raw_en = read_lines(workdir / "raw" / "train.en")
    assert raw_en == corpora["europarl-v7"][0] + corpora["commoncrawl"][0] + corpora["news-commentary-v9"][0]
    tok_en = read_lines(workdir / "tok" / "train.en")
    assert tok_en[65] == "A well @-@ known , long @-@ standing example with many more words than its other side ."
    # Held-out sets from the SGML files, never cleaned; raw/ and --dest/raw/ hold the official text
    # untouched (only whitespace runs collapsed, as sacreBLEU extracts it), the references scored against.
    official = {(split, lang): [" ".join(line.split()) for line in newstest[year][index]]
                for split, year in (("valid", 2013), ("test", 2014)) for index, lang in enumerate(("en", "de"))}
    assert official["test", "de"][2] == "„Es ist da“ – sagte er…" and official["valid", "en"][4] == "Don’t «go»!"
    for (split, lang), lines in official.items():
        assert read_lines(workdir / "raw" / f"{split}.{lang}") == lines
        assert read_lines(dest / "raw" / f"{split}.{lang}") == lines
    # The models' input is normalised: straight quotes, Moses-escaped, hyphens split.
    assert read_lines(workdir / "tok" / "test.de")[2] == "&quot; Es ist da &quot; - sagte er ..."
    assert read_lines(workdir / "tok" / "valid.en")[4] == "Don &apos;t &quot; go &quot; !"
    # Cleaning after BPE drops exactly the unbalanced pair.
    bpe_all = read_lines(workdir / "bpe" / "train.all.en")
    bpe_train = read_lines(workdir / "bpe" / "train.en")
    assert len(bpe_all) == 180 and bpe_train == bpe_all[:65] + bpe_all[66:]
    assert [line.replace("@@ ", "") for line in bpe_train] == tok_en[:65] + tok_en[66:]
    record = json.loads((dest / "prepare.json").read_text())
    assert record["sizes"] == {"train": 179, "valid": 7, "test": 7}
    assert record["moses"]["aggressive_dash_splits"] is True
    for split in ("train", "valid", "test"):
        assert_binarized_equals_text(dest, f"{split}.en-de", "de", workdir / "bpe" / f"{split}.de")
