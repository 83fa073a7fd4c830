"""IWSLT'14 De-En preparation: the release formats, Moses tokenisation, cleaning, the split, the
real-data reproduction of fairseq's test set and BPE, and the entry point end to end.

Real-data checks read ../shared/data/iwslt14-de-en (the XML sets of de-en.tgz and fairseq's
tokenised/BPE output); they skip when it is absent.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from fairseq_kd_recipes.prepare.bpe import apply_bpe_lines, learn_joint_bpe
from fairseq_kd_recipes.prepare.corpora import iwslt14_de_en
from fairseq_kd_recipes.prepare.errors import PrepareError
from fairseq_kd_recipes.prepare.iwslt import (
    available_xml_sets,
    read_parallel_train_tags,
    read_segments,
    read_train_tags,
)
from fairseq_kd_recipes.prepare.textio import read_lines
from fairseq_kd_recipes.prepare.tokenize import CleanRule, MosesConfig, MosesPreprocessor, clean_indices, keep_pair, moses_preprocess
from prepare_fixtures import (
    IWSLT14_DATA,
    build_wit3_archive,
    load_entry_point,
    synthetic_parallel,
    truncated_xml,
    xml_set_text,
)

needs_real_data = pytest.mark.skipif(
    not (IWSLT14_DATA / "orig").is_dir(), reason=f"real IWSLT'14 data not found at {IWSLT14_DATA}"
)


# ----------------------------------------------------------------------------- formats
TRAIN_TAGS = """<url>http://www.ted.com/talks/lang/en/stephen_palumbi.html</url>
<keywords>talks, oceans</keywords>
<speaker>Stephen Palumbi</speaker>
<talkid>1017</talkid>
<title>Stephen Palumbi: Following the mercury trail</title>
<description>TED Talk: a story about the mercury trail.</description>
<reviewer href="http://www.ted.com/profiles/1">Someone</reviewer>
<translator href="http://www.ted.com/profiles/2">Someone else</translator>
It can be a very complicated thing, the ocean.
And it can be a very complicated thing, what human health is.
<url>http://www.ted.com/talks/lang/en/other.html</url>
<talkid>1018</talkid>
So what's the connection?
"""


def test_train_tags_drop_metadata_keep_header_text(tmp_path):
    path = tmp_path / "train.tags.de-en.en"
    path.write_text(TRAIN_TAGS, encoding="utf-8")
    assert read_train_tags(path) == [
        "Stephen Palumbi: Following the mercury trail",
        "TED Talk: a story about the mercury trail.",
        "It can be a very complicated thing, the ocean.",
        "And it can be a very complicated thing, what human health is.",
        "So what's the connection?",
    ]
    assert read_train_tags(path, keep_talk_headers=False) == [
        "It can be a very complicated thing, the ocean.",
        "And it can be a very complicated thing, what human health is.",
        "So what's the connection?",
    ]


def test_train_tags_split_on_newline_only(tmp_path):
    path = tmp_path / "train.tags.de-en.de"
    path.write_bytes("<url>u</url>\nEin\rSatz.\r\nZwei.\n".encode())
    assert read_train_tags(path) == ["Ein\rSatz.\r", "Zwei."]


def test_unparallel_train_tags_is_an_error(tmp_path):
    (tmp_path / "a").write_text(TRAIN_TAGS, encoding="utf-8")
    (tmp_path / "b").write_text(TRAIN_TAGS + "One more line.\n", encoding="utf-8")
    with pytest.raises(PrepareError, match="not parallel.*5 vs 6"):
        read_parallel_train_tags(tmp_path / "a", tmp_path / "b")


def test_xml_segments(tmp_path):
    path = tmp_path / "IWSLT14.TED.dev2010.de-en.en.xml"
    path.write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n<refset setid="iwslt2014-dev2010" srclang="german">\n'
        '<doc docid="69" genre="lectures">\n<url>http://www.ted.com/x.html</url>\n'
        "<description>Not a segment.</description>\n<title>Not a segment either</title>\n"
        '<seg id="1"> We’re all born. </seg>\n<seg id="2">\tTwo  spaces inside.\t</seg>  \n'
        "</doc>\n</refset>\n</mteval>\n",
        encoding="utf-8",
    )
    assert read_segments(path) == ["We're all born.", "Two  spaces inside."]
    assert read_segments(path, straighten_quotes=False)[0] == "We’re all born."
    empty = tmp_path / "empty.xml"
    empty.write_text("<mteval>\n</mteval>\n")
    with pytest.raises(PrepareError, match="empty.xml contains no <seg"):
        read_segments(empty)


def test_available_xml_sets_order(tmp_path):
    for name in ("TED.tst2012", "TEDX.dev2012", "TED.tst2010", "TED.dev2010", "TED.tst2011"):
        (tmp_path / f"IWSLT14.{name}.de-en.de.xml").write_text("")
    (tmp_path / "IWSLT14.TED.tst2013.de-en.en.xml").write_text("")  # other side: not listed
    assert available_xml_sets(tmp_path, "IWSLT14", "de-en", "de") == list(iwslt14_de_en.TEST_SETS)


def test_available_xml_sets_with_a_regional_language_code(tmp_path):
    # The WIT3 2014-01 release spells Portuguese pt-br: IWSLT14.TED.dev2010.pt-br-en.pt-br.xml.
    for name in ("TED.tst2010", "TED.dev2010"):
        for lang in ("pt-br", "en"):
            (tmp_path / f"IWSLT14.{name}.pt-br-en.{lang}.xml").write_text("")
    assert available_xml_sets(tmp_path, "IWSLT14", "pt-br-en", "pt-br") == ["TED.dev2010", "TED.tst2010"]
    assert available_xml_sets(tmp_path, "IWSLT14", "pt-br-en", "en") == ["TED.dev2010", "TED.tst2010"]
    assert available_xml_sets(tmp_path, "IWSLT14", "pt-en", "pt") == []


def test_iwslt14_pt_en_names_the_release_files():
    """WIT3 2014-01 has texts/pt-br/en/pt-br-en.tgz, not pt-en.tgz; the prepared data stays pt-en."""
    from fairseq_kd_recipes.prepare.corpora import iwslt_spm
    from fairseq_kd_recipes.pairs import PAIRS

    corpus = iwslt_spm.IWSLT14_PT_EN
    assert corpus.archive.name == "pt-br-en.tgz" and corpus.archive_pair == "pt-br-en"
    assert all(url.endswith("/2014-01/texts/pt-br/en/pt-br-en.tgz") for url in corpus.archive.urls)
    assert (corpus.source, corpus.target, corpus.name) == ("pt", "en", "iwslt14.spm.pt-en")
    assert PAIRS["iwslt14_pt_en"].archive_files == ("pt-br-en.tgz",)
    # Every WIT3 corpus's archive is named after the pair its files use (Tr-En is not WIT3's).
    for other in iwslt_spm.CORPORA.values():
        if isinstance(other, iwslt_spm.IwsltCorpus):
            assert other.archive.name == f"{other.archive_pair}.tgz"


# ----------------------------------------------------------------------------- Moses
@pytest.mark.parametrize(
    "lang, raw, expected",
    [
        # Moses' final-word rule: the full stop of the last word is split off even after a
        # non-breaking prefix (u.s, usw, single letters); inside the line "Dr." stays attached.
        ("en", "But those are all the roads in the U.S.", "but those are all the roads in the u.s ."),
        ("en", "So he went by Dr. P.", "so he went by dr. p ."),
        ("de", "Viele von ihnen sind von Gesichtern verdeckt usw.", "viele von ihnen sind von gesichtern verdeckt usw ."),
        ("de", "Wir haben einen 4-Buchstaben Code: A, C, G und T.", "wir haben einen 4-buchstaben code : a , c , g und t ."),
        # XML escaping and English contractions.
        ("en", 'We\'re "born" & <raised>.', "we &apos;re &quot; born &quot; &amp; &lt; raised &gt; ."),
        ("en", "It costs $5,300 -- or 3.5%.", "it costs $ 5,300 -- or 3.5 % ."),
    ],
)
def test_moses_tokenisation_matches_tokenizer_perl(lang, raw, expected):
    assert MosesPreprocessor(iwslt14_de_en.moses_config(lang))(raw) == expected


def test_wmt_style_options():
    wmt = MosesPreprocessor(MosesConfig(lang="en", aggressive_dash_splits=True, remove_non_printing=True))
    assert wmt("A state-of-the-art\u200bsystem.") == "A state @-@ of @-@ the @-@ art system ."


# ----------------------------------------------------------------------------- cleaning and split
@pytest.mark.parametrize(
    "source_len, target_len, kept",
    [(1, 1, True), (10, 15, True), (10, 16, False), (16, 10, False), (175, 175, True), (176, 170, False), (0, 3, False)],
)
def test_clean_rule_counts(source_len, target_len, kept):
    assert keep_pair(["w"] * source_len, ["w"] * target_len, CleanRule()) is kept


def test_clean_rule_word_length_and_indices():
    rule = CleanRule(max_word_length=5)
    assert keep_pair(["abcde"], ["xyz"], rule) and not keep_pair(["abcdef"], ["xyz"], rule)
    assert clean_indices(["a b", "", "a  b   c", "a"], ["x y", "x", "x y z", "x y z"], CleanRule()) == [0, 2]


def test_split_every_23rd():
    lines = [str(number) for number in range(1, 51)]
    train, valid = iwslt14_de_en.split_every(lines, 23)
    assert valid == ["23", "46"] and len(train) == 48 and "23" not in train and train[22] == "24"


# ----------------------------------------------------------------------------- real data
def _extract_and_tokenize_test_sets(lang: str) -> list[str]:
    segments = []
    for path in iwslt14_de_en.xml_test_files(IWSLT14_DATA / "orig", lang):
        segments += read_segments(path, straighten_quotes=True)
    return list(moses_preprocess(segments, iwslt14_de_en.moses_config(lang), workers=2))


@needs_real_data
@pytest.mark.parametrize("lang", ["de", "en"])
def test_real_test_set_reproduces_fairseq_tokenisation(lang):
    reference = read_lines(IWSLT14_DATA / "tokenized" / f"test.{lang}")
    ours = _extract_and_tokenize_test_sets(lang)
    assert len(ours) == len(reference) == 6750
    identical = sum(a == b for a, b in zip(ours, reference))
    share = identical / len(reference)
    print(f"IWSLT'14 test.{lang}: {identical}/{len(reference)} lines identical ({share:.2%})")
    assert share >= 0.99, f"only {share:.2%} of test.{lang} identical"


@needs_real_data
@pytest.mark.parametrize("split", ["test", "valid"])
def test_real_bpe_codes_reproduce_fairseq_segmentation(split):
    for lang in ("de", "en"):
        tokenized = read_lines(IWSLT14_DATA / "tokenized" / f"{split}.{lang}")
        reference = read_lines(IWSLT14_DATA / "bpe" / f"{split}.{lang}")
        assert list(apply_bpe_lines(IWSLT14_DATA / "bpe" / "code", tokenized)) == reference


def test_learned_codes_are_applied_consistently(tmp_path):
    source, target = synthetic_parallel(200, "de", "en", seed=3)
    (tmp_path / "train.de").write_text("\n".join(s.lower() for s in source) + "\n", encoding="utf-8")
    (tmp_path / "train.en").write_text("\n".join(t.lower() for t in target) + "\n", encoding="utf-8")
    learn_joint_bpe([tmp_path / "train.de", tmp_path / "train.en"], tmp_path / "code", merges=30)
    codes = read_lines(tmp_path / "code")
    assert codes[0] == "#version: 0.2" and 1 < len(codes) <= 31
    segmented = list(apply_bpe_lines(tmp_path / "code", [s.lower() for s in source]))
    # Removing the separators gives the input back.
    assert [line.replace("@@ ", "") for line in segmented] == [s.lower() for s in source]


# ----------------------------------------------------------------------------- end to end
SEGMENTS_PER_SET = 30
TEST_OFFSETS = {"TED.dev2010": 0, "TEDX.dev2012": 887, "TED.tst2010": 2052, "TED.tst2011": 3617, "TED.tst2012": 5050}


def _fake_de_en_archive(folder: Path) -> tuple[Path, dict[str, list[str]] | None]:
    """A de-en.tgz in the WIT3 layout, from real segments when available (else synthetic).

    Returns the archive and, with real data, the expected tokenised test lines per language.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if (IWSLT14_DATA / "orig").is_dir():
        train = tuple(read_segments(IWSLT14_DATA / "orig" / f"IWSLT14.TED.tst2012.de-en.{lang}.xml", False)[-400:]
                      for lang in ("de", "en"))
        sets = {name: tuple(truncated_xml(IWSLT14_DATA / "orig" / f"IWSLT14.{name}.de-en.{lang}.xml", SEGMENTS_PER_SET)
                            for lang in ("de", "en")) for name in iwslt14_de_en.TEST_SETS}
        expected = {lang: [line for name in iwslt14_de_en.TEST_SETS
                           for line in read_lines(IWSLT14_DATA / "tokenized" / f"test.{lang}")[TEST_OFFSETS[name]:TEST_OFFSETS[name] + SEGMENTS_PER_SET]]
                    for lang in ("de", "en")}
    else:
        train = synthetic_parallel(400, "de", "en", seed=1)
        sets = {}
        for index, name in enumerate(iwslt14_de_en.TEST_SETS):
            source, target = synthetic_parallel(SEGMENTS_PER_SET, "de", "en", seed=10 + index)
            target[1] = "It’s " + target[1]  # the real sets have ’, which only the tokenised copy straightens
            sets[name] = (xml_set_text(source, name, "srcset", "german"), xml_set_text(target, name, "refset", "english"))
        expected = None
    return build_wit3_archive(folder / "de-en.tgz", "de-en", "IWSLT14", train, sets), expected


def assert_binarized_equals_text(dest: Path, prefix: str, lang: str, text_path: Path) -> None:
    """The binarised split decodes to the text file, with pieces unseen in training as <unk>."""
    from fairseq.data import Dictionary, data_utils

    dictionary = Dictionary.load(str(dest / f"dict.{lang}.txt"))
    dataset = data_utils.load_indexed_dataset(str(dest / f"{prefix}.{lang}"), dictionary)
    known = {dictionary[i] for i in range(len(dictionary))}
    expected = [" ".join(w if w in known else "<unk>" for w in line.split()) for line in read_lines(text_path)]
    assert [dictionary.string(dataset[i]) for i in range(len(dataset))] == expected


def test_entry_point_end_to_end(tmp_path):
    archive, expected_test = _fake_de_en_archive(tmp_path / "archives")
    workdir, dest = tmp_path / "work", tmp_path / "data-bin"
    args = ["--archives", str(archive.parent), "--workdir", str(workdir), "--dest", str(dest),
            "--bpe-merges", "200", "--workers", "1"]
    entry = load_entry_point("examples/translation/iwslt14_de_en/prepare.py")
    assert entry.cli_main(args) == 0

    # Training text: no metadata lines, talk titles kept (as fairseq), tokenised and lowercased.
    raw_train = read_lines(workdir / "raw" / "train.tags.en")
    assert not any(marker in line for line in raw_train for marker in ("<url>", "<talkid>", "<keywords>", "<title>"))
    assert sum(line.startswith("Speaker ") for line in raw_train) == 16  # one title per talk of 25 lines
    tok = {lang: read_lines(workdir / "tok" / f"train.tags.{lang}") for lang in ("de", "en")}
    kept = [i for i in range(len(tok["de"]))  # clean-corpus-n, written out in full here
            if 1 <= len(tok["de"][i].split()) <= 175 and 1 <= len(tok["en"][i].split()) <= 175
            and len(tok["de"][i].split()) / len(tok["en"][i].split()) <= 1.5
            and len(tok["en"][i].split()) / len(tok["de"][i].split()) <= 1.5]
    valid_en = read_lines(workdir / "tok" / "valid.en")
    assert valid_en == [tok["en"][i] for n, i in enumerate(kept, start=1) if n % 23 == 0]
    assert len(read_lines(workdir / "tok" / "train.en")) == len(kept) - len(valid_en)
    assert all(line == line.lower() for line in valid_en)

    # Test set: the five XML sets in fairseq's order; with real segments, fairseq's exact lines.
    for lang in ("de", "en"):
        test_tok = read_lines(workdir / "tok" / f"test.{lang}")
        assert len(test_tok) == 5 * SEGMENTS_PER_SET
        if expected_test is not None:
            assert test_tok == expected_test[lang]

    # raw/test.* (and --dest/raw/): the XML segments as they are, ’ included, the references
    # detokenised output is scored against; the tokenised copy has ’ straightened, as fairseq's.
    xml_folder = workdir / "extracted" / "de-en" / "de-en"
    for lang in ("de", "en"):
        segments = [" ".join(line.split()) for path in iwslt14_de_en.xml_test_files(xml_folder, lang)
                    for line in read_segments(path, straighten_quotes=False)]
        assert read_lines(workdir / "raw" / f"test.{lang}") == segments
        assert read_lines(dest / "raw" / f"test.{lang}") == segments
    assert any("\u2019" in line for line in read_lines(dest / "raw" / "test.en"))
    assert not any("\u2019" in line for line in read_lines(workdir / "tok" / "test.en"))

    # Binarised data: one joined dictionary; the binary splits decode to the BPE text.
    assert (dest / "dict.de.txt").read_text() == (dest / "dict.en.txt").read_text()
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            assert_binarized_equals_text(dest, f"{split}.de-en", lang, workdir / "bpe" / f"{split}.{lang}")
    assert (dest / "bpe.code").read_bytes() == (workdir / "bpe" / "code").read_bytes()
    assert read_lines(dest / "tok" / "test.en") == read_lines(workdir / "tok" / "test.en")
    record = json.loads((dest / "prepare.json").read_text())
    assert record["sizes"] == {"train": len(kept) - len(valid_en), "valid": len(valid_en), "test": 5 * SEGMENTS_PER_SET}
    assert record["subword"] == {"kind": "subword-nmt", "merges": 200}

    # Re-running (in process) skips every step and leaves the outputs untouched.
    stamps = {path.name: path.stat().st_mtime_ns for path in (workdir / "stamps").iterdir()}
    outputs = {path: path.stat().st_mtime_ns for path in dest.rglob("*") if path.is_file()}
    assert entry.cli_main(args) == 0
    assert {path.name: path.stat().st_mtime_ns for path in (workdir / "stamps").iterdir()} == stamps
    assert {path: path.stat().st_mtime_ns for path in dest.rglob("*") if path.is_file()} == outputs

    # Another non-empty folder as --dest is refused before any work.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert entry.cli_main(args[:4] + ["--dest", str(other), "--workers", "1"]) == 2
    assert (other / "notes.txt").read_text() == "mine" and len(list(other.iterdir())) == 1

    # A different number of merges re-runs BPE onward; --dest then needs --overwrite.
    assert entry.cli_main(args[:-4] + ["--bpe-merges", "150", "--workers", "1"]) == 2
    assert entry.cli_main(args[:-4] + ["--bpe-merges", "150", "--workers", "1", "--overwrite"]) == 0
    assert json.loads((dest / "prepare.json").read_text())["subword"]["merges"] == 150


def test_foreign_destination_and_corrupt_archive_are_refused(tmp_path, capsys):
    entry = load_entry_point("examples/translation/iwslt14_de_en/prepare.py")
    archives = tmp_path / "archives"
    archives.mkdir()
    dest = tmp_path / "data-bin"
    dest.mkdir()
    (dest / "model.pt").write_text("somebody's work")
    args = ["--archives", str(archives), "--workdir", str(tmp_path / "w"), "--dest", str(dest), "--workers", "1"]
    assert entry.cli_main(args) == 2
    assert "--dest" in capsys.readouterr().err and (dest / "model.pt").exists()
    assert entry.cli_main(args[:-4] + ["--dest", str(tmp_path / "fresh"), "--workers", "1"]) == 2
    assert "de-en.tgz is missing from --archives" in capsys.readouterr().err
    with tarfile.open(archives / "de-en.tgz", "w:gz") as tar:
        tar.add(__file__, arcname="de-en/unrelated.py")
    (archives / "de-en.tgz").write_bytes((archives / "de-en.tgz").read_bytes()[:-20])
    assert entry.cli_main(args[:-4] + ["--dest", str(tmp_path / "fresh"), "--workers", "1"]) == 2
    assert "de-en.tgz is truncated or corrupt" in capsys.readouterr().err
