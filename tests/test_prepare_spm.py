"""SentencePiece training/encoding and the SentencePiece recipes end to end on small inputs in the
original formats: IWSLT'17 En-Zh and IWSLT'14 Pt-En (WIT3 archives with train.tags and XML sets)
and WMT'22 De-Dsb (gzipped plain text and a development-test tarball)."""
from __future__ import annotations

import gzip
import hashlib
import json
import tarfile

import pytest
import sentencepiece

from fairseq_kd_recipes.prepare.errors import PrepareError
from fairseq_kd_recipes.prepare.spm import SentencePieceConfig, encode_lines, train_sentencepiece
from fairseq_kd_recipes.prepare.textio import read_lines
from prepare_fixtures import add_to_tar, build_wit3_archive, load_entry_point, synthetic_parallel, xml_set_text
from test_prepare_iwslt import assert_binarized_equals_text


def _decode(model, lines):
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    return [processor.decode(line.split()) for line in lines]


def test_joint_model_round_trips_both_languages(tmp_path):
    german, english = synthetic_parallel(300, "de", "en", seed=5)
    (tmp_path / "train.de").write_text("\n".join(german) + "\n", encoding="utf-8")
    (tmp_path / "train.en").write_text("\n".join(english) + "\n", encoding="utf-8")
    model = tmp_path / "spm.model"
    train_sentencepiece([tmp_path / "train.de", tmp_path / "train.en"], model, SentencePieceConfig(vocab_size=70))
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    assert processor.get_piece_size() == 70
    assert (tmp_path / "spm.vocab").exists() and not list(tmp_path.glob("*.training.*"))
    for lines in (german, english):
        encoded = list(encode_lines(model, lines))
        assert all(" " not in piece for line in encoded for piece in line.split(" "))
        assert _decode(model, encoded) == lines


def test_too_large_vocabulary_names_the_flag(tmp_path):
    (tmp_path / "train.txt").write_text("ein kleines beispiel\n" * 20, encoding="utf-8")
    with pytest.raises(PrepareError, match="--spm-vocab-size"):
        train_sentencepiece([tmp_path / "train.txt"], tmp_path / "m.model", SentencePieceConfig(vocab_size=5000))


@pytest.mark.parametrize("kwargs, flag", [({"vocab_size": 2}, "--spm-vocab-size"),
                                          ({"vocab_size": 100, "model_type": "wordpiece"}, "--spm-model-type"),
                                          ({"vocab_size": 100, "character_coverage": 1.5}, "--spm-character-coverage")])
def test_config_validation(kwargs, flag):
    with pytest.raises(PrepareError, match=flag):
        SentencePieceConfig(**kwargs)


# ----------------------------------------------------------------------------- IWSLT'17 En-Zh
ZH_SETS = ["TED.dev2010"] + [f"TED.tst{year}" for year in range(2010, 2016)]


def test_iwslt17_en_zh_end_to_end(tmp_path):
    english, chinese = synthetic_parallel(240, "en", "zh", seed=2)
    english.append(" ".join(["word"] * 300) + ".")  # longer than --max-pieces: filtered out
    chinese.append("词" * 300 + "。")
    sets, expected = {}, {"valid": ([], []), "test": ([], [])}
    for index, name in enumerate(ZH_SETS):
        source, target = synthetic_parallel(6, "en", "zh", seed=20 + index)
        if name == "TED.tst2011":  # typographic punctuation stays in the references
            source[2], target[2] = "He said: “It’s ours” – really…", "他说“这是我们的”——真的。"
        sets[name] = (xml_set_text(source, name, "srcset", "english"), xml_set_text(target, name, "refset", "chinese"))
        split = "valid" if name == "TED.dev2010" else "test"
        expected[split][0].extend(source)
        expected[split][1].extend(target)
    archives = tmp_path / "archives"
    archives.mkdir()
    build_wit3_archive(archives / "en-zh.tgz", "en-zh", "IWSLT17", (english, chinese), sets, style=2017)
    workdir, dest = tmp_path / "work", tmp_path / "bin"
    pinned = tmp_path / "sums.json"  # the manifest's md5 belongs to the real archive: pin ours
    pinned.write_text(json.dumps({"en-zh.tgz": hashlib.sha256((archives / "en-zh.tgz").read_bytes()).hexdigest()}))
    entry = load_entry_point("examples/translation/iwslt17_en_zh/prepare.py")
    args = ["--archives", str(archives), "--workdir", str(workdir), "--dest", str(dest), "--workers", "1",
            "--spm-vocab-size", "120"]
    # The real archive's md5 does not match the fake one: a clear error naming the file.
    assert entry.cli_main(args) == 2
    assert entry.cli_main(args + ["--checksums", str(pinned)]) == 0

    raw_train_en = read_lines(workdir / "raw" / "train.tags.en")
    for marker in ("Reviewer", "Translator", "ted.com", "<"):
        assert not any(marker in line for line in raw_train_en), marker
    assert raw_train_en[0] == "Speaker 1 (en): Talk title number 1"  # titles kept, as fairseq
    for split, (source, target) in expected.items():
        assert read_lines(workdir / "raw" / f"{split}.en") == source
        assert read_lines(workdir / "raw" / f"{split}.zh") == target
    model = workdir / "spm" / "spm.model"
    # Encoded training pairs decode to the raw ones, minus the over-long pair.
    raw_pairs = list(zip(read_lines(workdir / "raw" / "train.en"), read_lines(workdir / "raw" / "train.zh")))
    decoded = list(zip(_decode(model, read_lines(workdir / "spm" / "train.en")), _decode(model, read_lines(workdir / "spm" / "train.zh"))))
    assert decoded == [pair for pair in raw_pairs if not pair[0].startswith("word word")]
    assert len(decoded) == len(raw_pairs) - 1
    assert _decode(model, read_lines(workdir / "spm" / "test.zh")) == expected["test"][1]

    record = json.loads((dest / "prepare.json").read_text())
    assert record["sacrebleu_tokenize"] == "zh"
    assert record["valid_sets"] == ["TED.dev2010"] and record["test_sets"] == ZH_SETS[1:]
    assert (dest / "spm.model").read_bytes() == model.read_bytes()
    assert read_lines(dest / "raw" / "test.zh") == expected["test"][1]
    assert read_lines(dest / "raw" / "test.en") == expected["test"][0]
    assert "He said: “It’s ours” – really…" in expected["test"][0]
    for split in ("train", "valid", "test"):
        for lang in ("en", "zh"):
            assert_binarized_equals_text(dest, f"{split}.en-zh", lang, workdir / "spm" / f"{split}.{lang}")


# ----------------------------------------------------------------------------- IWSLT'14 Pt-En
PT_SETS = ["TED.dev2010", "TED.tst2010", "TED.tst2011", "TED.tst2012"]


def test_iwslt14_pt_en_split_like_fairseq(tmp_path):
    portuguese, english = synthetic_parallel(120, "pt", "en", seed=4)
    portuguese[10] = "Uma frase muito longa , com muitas palavras a mais do que a outra ."  # ratio > 1.5
    english[10] = "A short one."
    sets = {}
    for index, name in enumerate(reversed(PT_SETS)):  # archive order must not matter
        source, target = synthetic_parallel(4, "pt", "en", seed=40 + index)
        sets[name] = (xml_set_text(source, name, "srcset", "portuguese"), xml_set_text(target, name, "refset", "english"))
    archives = tmp_path / "archives"
    archives.mkdir()
    # The WIT3 2014-01 layout: Portuguese is pt-br in the archive's name, folder and file names.
    build_wit3_archive(archives / "pt-br-en.tgz", ("pt-br", "en"), "IWSLT14", (portuguese, english), sets)
    workdir, dest = tmp_path / "work", tmp_path / "bin"
    entry = load_entry_point("examples/translation/iwslt14_pt_en_tr_en/prepare.py")
    base = ["--pair", "pt-en", "--archives", str(archives), "--workdir", str(workdir), "--workers", "1",
            "--spm-vocab-size", "100"]
    assert entry.cli_main(base + ["--dest", str(dest), "--test-sets", "TED.tst2099"]) == 2
    assert entry.cli_main(base + ["--dest", str(dest)]) == 0

    tagged = list(zip(read_lines(workdir / "raw" / "train.tags.pt"), read_lines(workdir / "raw" / "train.tags.en")))
    assert ("Uma frase muito longa , com muitas palavras a mais do que a outra .", "A short one.") in tagged
    kept = [pair for pair in tagged if pair[1] != "A short one."]  # the only pair the cleaning drops
    train = list(zip(read_lines(workdir / "raw" / "train.pt"), read_lines(workdir / "raw" / "train.en")))
    valid = list(zip(read_lines(workdir / "raw" / "valid.pt"), read_lines(workdir / "raw" / "valid.en")))
    assert valid == kept[22::23] and len(train) + len(valid) == len(kept)
    assert train[0][0][0].isupper()  # raw, cased text goes to SentencePiece
    test_en = read_lines(workdir / "raw" / "test.en")
    assert test_en == [line for name in PT_SETS
                       for line in synthetic_parallel(4, "pt", "en", seed=40 + list(reversed(PT_SETS)).index(name))[1]]
    record = json.loads((dest / "prepare.json").read_text())
    assert record["test_sets"] == PT_SETS
    # The prepared data calls the language pt, as --source-lang pt and the recipe expect.
    assert (record["source_lang"], record["target_lang"]) == ("pt", "en")
    assert (dest / "dict.pt.txt").is_file() and (dest / "test.pt-en.pt.bin").is_file()
    assert read_lines(dest / "raw" / "test.pt") == read_lines(workdir / "raw" / "test.pt")


# ----------------------------------------------------------------------------- WMT'22 De-Dsb
def test_wmt22_de_dsb_end_to_end(tmp_path):
    german, sorbian = synthetic_parallel(150, "de", "dsb", seed=6)
    german[3], sorbian[3] = "", "Prazna linija."  # an empty side: dropped from training
    archives = tmp_path / "archives"
    archives.mkdir()
    for lang, lines in (("de", german), ("dsb", sorbian)):
        (archives / f"40194_train_dsb_de.{lang}.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    heldout = {name: synthetic_parallel(5, "de", "dsb", seed=seed) for name, seed in (("devel", 60), ("devel_test", 61))}
    heldout["devel_test"][0][1] = "„Das ist’s“ – sagte er…"  # the references keep it as it is
    with tarfile.open(archives / "devtest.dsb-de.tgz", "w:gz") as tar:
        for name, (de_lines, dsb_lines) in heldout.items():
            add_to_tar(tar, f"devtest/{name}.dsb-de.de", "\n".join(de_lines) + "\n")
            add_to_tar(tar, f"devtest/{name}.dsb-de.dsb", "\n".join(dsb_lines) + "\n")
    workdir, dest = tmp_path / "work", tmp_path / "bin"
    entry = load_entry_point("examples/translation/wmt22_de_dsb/prepare.py")
    args = ["--archives", str(archives), "--workdir", str(workdir), "--dest", str(dest), "--workers", "1",
            "--spm-vocab-size", "100"]
    assert entry.cli_main(args) == 0
    assert read_lines(workdir / "raw" / "valid.dsb") == heldout["devel"][1]
    assert read_lines(workdir / "raw" / "test.de") == heldout["devel_test"][0]
    for lang, lines in zip(("de", "dsb"), heldout["devel_test"]):
        assert read_lines(dest / "raw" / f"test.{lang}") == lines
    assert read_lines(workdir / "raw" / "train.de") == [line for line in german if line]
    record = json.loads((dest / "prepare.json").read_text())
    assert record["sizes"] == {"train": 149, "valid": 5, "test": 5}
    assert record["sets"] == {"train": "train2022", "valid": "devel2021", "test": "devel_test2021"}
    for split in ("train", "test"):
        assert_binarized_equals_text(dest, f"{split}.de-dsb", "dsb", workdir / "spm" / f"{split}.dsb")


def test_wmt22_missing_set_file_is_named(tmp_path, capsys):
    archives = tmp_path / "archives"
    archives.mkdir()
    for name in ("40194_train_dsb_de.de.gz", "40194_train_dsb_de.dsb.gz"):
        (archives / name).write_bytes(gzip.compress(b"Ein Satz.\n"))
    with tarfile.open(archives / "devtest.dsb-de.tgz", "w:gz") as tar:
        add_to_tar(tar, "devtest/dev.de", "x\n")
    entry = load_entry_point("examples/translation/wmt22_de_dsb/prepare.py")
    args = ["--archives", str(archives), "--workdir", str(tmp_path / "w"), "--dest", str(tmp_path / "b"), "--workers", "1"]
    assert entry.cli_main(args) == 2
    assert "devtest.dsb-de.tgz holds no file named devel.dsb-de.de (it holds: devtest/dev.de)" in capsys.readouterr().err
    assert entry.cli_main(args + ["--valid-set", "valid2022"]) == 2
    assert "valid.de.gz is missing from --archives" in capsys.readouterr().err
