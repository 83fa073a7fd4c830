"""IWSLT'14 Tr-En as the CKD paper has it: the Multitarget TED Talks release's train/dev/test1
sets (Duh 2018), prepared from a small ``multitarget-ted.tgz`` in the release's layout."""
from __future__ import annotations

import json

from fairseq_kd_recipes.prepare.textio import read_lines
from prepare_fixtures import build_multitarget_ted_archive, load_entry_point, synthetic_parallel
from test_prepare_iwslt import assert_binarized_equals_text

ENTRY = "examples/translation/iwslt14_pt_en_tr_en/prepare.py"


def _release(tmp_path):
    turkish, english = synthetic_parallel(120, "tr", "en", seed=8)
    turkish[10], english[10] = "Bu .", "This is a much longer English sentence than its Turkish side ."  # ratio > 1.5
    turkish[30], english[30] = "", "An empty Turkish side."  # dropped
    dev = synthetic_parallel(7, "tr", "en", seed=81)
    test1 = synthetic_parallel(9, "tr", "en", seed=82)
    test1[1][2] = "He said: “It’s ours” –  really…"  # typographic text stays; whitespace runs collapse
    german_dev = (["Ein Satz."] * 7, dev[1])  # another language, same English side, as in the release
    archives = tmp_path / "archives"
    archives.mkdir()
    build_multitarget_ted_archive(archives / "multitarget-ted.tgz", {
        "tr": {"train": (turkish, english), "dev": dev, "test1": test1},
        "de": {"train": synthetic_parallel(30, "de", "en", seed=83), "dev": german_dev,
               "test1": synthetic_parallel(9, "de", "en", seed=84)},
    })
    return archives, (turkish, english), dev, test1


def test_tr_en_takes_the_release_dev_and_test1_sets(tmp_path):
    archives, (turkish, english), dev, test1 = _release(tmp_path)
    workdir, dest = tmp_path / "work", tmp_path / "bin"
    entry = load_entry_point(ENTRY)
    assert entry.cli_main(["--pair", "tr-en", "--archives", str(archives), "--workdir", str(workdir),
                           "--dest", str(dest), "--workers", "1", "--spm-vocab-size", "100"]) == 0

    # valid and test are the release's dev and test1 files, whole, not every 23rd training pair.
    record = json.loads((dest / "prepare.json").read_text())
    assert record["sizes"] == {"train": 118, "valid": 7, "test": 9}
    assert (record["source_lang"], record["target_lang"]) == ("tr", "en")
    assert record["sets"]["valid"] == "ted_dev_en-tr.raw.{tr,en}"
    assert record["sets"]["test"] == "ted_test1_en-tr.raw.{tr,en}"
    for split, (source, target) in (("valid", dev), ("test", test1)):
        target = [" ".join(line.split()) for line in target]
        assert read_lines(workdir / "raw" / f"{split}.tr") == source
        assert read_lines(workdir / "raw" / f"{split}.en") == target  # cased raw/, not the lowercased tok/
        assert read_lines(dest / "raw" / f"{split}.tr") == source
        assert read_lines(dest / "raw" / f"{split}.en") == target
    assert "He said: “It’s ours” – really…" in read_lines(dest / "raw" / "test.en")

    # Training: every release pair but the empty one and the one fairseq's ratio rule drops;
    # the 23rd, 46th, ... pairs are training pairs too.
    train = list(zip(read_lines(workdir / "raw" / "train.tr"), read_lines(workdir / "raw" / "train.en")))
    assert train == [pair for index, pair in enumerate(zip(turkish, english)) if index not in (10, 30)]
    assert (turkish[22], english[22]) in train and (turkish[45], english[45]) in train
    assert (dest / "dict.tr.txt").is_file() and (dest / "spm.model").is_file()
    for split in ("train", "valid", "test"):
        assert_binarized_equals_text(dest, f"{split}.tr-en", "en", workdir / "spm" / f"{split}.en")

    # Re-running skips every step: --dest is not written again.
    written = (dest / "prepare.json").stat().st_mtime_ns
    assert entry.cli_main(["--pair", "tr-en", "--archives", str(archives), "--workdir", str(workdir),
                           "--dest", str(dest), "--workers", "1", "--spm-vocab-size", "100"]) == 0
    assert (dest / "prepare.json").stat().st_mtime_ns == written


def test_tr_en_refuses_the_wit3_flags_and_names_the_archive(tmp_path, capsys):
    archives, *_ = _release(tmp_path)
    entry = load_entry_point(ENTRY)
    base = ["--pair", "tr-en", "--workdir", str(tmp_path / "w"), "--dest", str(tmp_path / "b"), "--workers", "1"]
    for flags, named in ((["--valid-sets", "TED.dev2010"], "--valid-sets"),
                         (["--drop-talk-headers"], "--drop-talk-headers")):
        assert entry.cli_main(base + ["--archives", str(archives)] + flags) == 2
        error = capsys.readouterr().err
        assert named in error and "multitarget-ted.tgz" in error
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "tr-en.tgz").write_bytes(b"")  # the WIT3 archive is not what Tr-En reads
    assert entry.cli_main(base + ["--archives", str(empty)]) == 2
    error = capsys.readouterr().err
    assert "multitarget-ted.tgz is missing from --archives" in error
    assert "https://www.cs.jhu.edu/~kevinduh/a/multitarget-tedtalks/multitarget-ted.tgz" in error


def test_tr_en_recipe_needs_the_multitarget_archive():
    from fairseq_kd_recipes.prepare.corpora import iwslt_spm
    from fairseq_kd_recipes.pairs import PAIRS

    assert PAIRS["iwslt14_tr_en"].archive_files == ("multitarget-ted.tgz",)
    corpus = iwslt_spm.CORPORA["tr-en"]
    assert corpus.file_name("test", "tr") == "ted_test1_en-tr.raw.tr"
    assert corpus.name == "iwslt14.spm.tr-en"
