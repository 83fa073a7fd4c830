"""Tests for the synthetic corpus generator (fairseq_kd/data/synthetic.py) and its CLI.

The agreement checks re-implement the rules from the module docstring with their own parser and
their own suffix tables; they take from the module only the lexicon (which word is which).
"""
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_kd.cli.make_corpus import cli_main
from fairseq_kd.data.synthetic import build_lexicon, generate_corpus, sample_sentence_pair, write_corpus

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL = {"train_size": 400, "valid_size": 60, "test_size": 60}

# Suffix tables as documented, written out independently of the module's constants.
THIRD_PERSON = {("m", "sg"): "o", ("f", "sg"): "a", ("n", "sg"): "u",
                ("m", "pl"): "oi", ("f", "pl"): "ai", ("n", "pl"): "ui"}
PRONOUN_SUFFIX = {"mi": "e", "tu": "i", "nos": "eo", "vos": "io"}


def _files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _manifest_without_times(folder: Path) -> dict:
    manifest = json.loads((folder / "corpus.json").read_text())
    for recorded in manifest["files"]["files"].values():
        del recorded["mtime_ns"]
    return manifest


def _split_suffix(word: str) -> tuple[str, str]:
    """Split a target word into (consonant-final stem, trailing vowel run)."""
    stem = word.rstrip("aeiou")
    return stem, word[len(stem):]


class AgreementChecker:
    """Parses sentence pairs with the documented rules and lists the agreement violations."""

    def __init__(self):
        lex = build_lexicon()
        self.source_gender = {n.source[0]: n.gender for n in lex.nouns}
        self.compound_heads = {n.source: n.source[1] for n in lex.compounds}
        self.target_noun_number = {}  # target noun form -> (gender, number)
        for noun in lex.nouns + lex.compounds:
            self.target_noun_number[noun.target] = (noun.gender, "sg")
            self.target_noun_number[noun.target + "en"] = (noun.gender, "pl")
        self.nominal_stems = {"d", "n", "s"} | {a.target for a in lex.adjectives}
        self.verb_stems = {v.target_stem for v in lex.verbs}
        self.seen = {"subject": set(), "head": 0, "relative_verbs": 0}

    def source_noun(self, word: str):
        if word in self.source_gender:
            return self.source_gender[word], "sg"
        if word.endswith("s") and word[:-1] in self.source_gender:
            return self.source_gender[word[:-1]], "pl"
        return None

    def expected_subject_suffix(self, source_clause: list[str]) -> str:
        if source_clause[0] in PRONOUN_SUFFIX:
            return PRONOUN_SUFFIX[source_clause[0]]
        for first, second in zip(source_clause, source_clause[1:] + [""]):
            # a listed compound is one noun whose gender is its head's (second word's)
            singular_second = second[:-1] if second.endswith("s") else second
            if (first, singular_second) in self.compound_heads:
                return THIRD_PERSON[self.source_noun(second)]
            if self.source_noun(first):
                return THIRD_PERSON[self.source_noun(first)]
        raise AssertionError(f"no subject found in {source_clause}")

    def violations(self, source: str, target: str) -> list[str]:
        problems = []
        source_clauses = " ".join(source.split()[:-1]).split(" i ")
        target_clauses = " ".join(target.split()[:-1]).split(" e ")
        if len(source_clauses) != len(target_clauses):
            return [f"clause count differs: {source!r} / {target!r}"]
        for source_clause, target_clause in zip(source_clauses, target_clauses):
            # long-distance rule: the clause-final verb agrees with the source subject
            stem, suffix = _split_suffix(target_clause.split()[-1])
            expected = self.expected_subject_suffix(source_clause.split())
            self.seen["subject"].add(expected)
            if stem not in self.verb_stems or suffix != expected:
                problems.append(f"final verb {target_clause.split()[-1]!r} should end in -{expected}")
        # local rule: determiners, adjectives and relative-clause verbs agree with the next noun
        words = target.split()
        for position, word in enumerate(words):
            stem, suffix = _split_suffix(word)
            relative_verb = stem in self.verb_stems and words[position + 1] == "ke"
            if not (relative_verb or (stem in self.nominal_stems and suffix in THIRD_PERSON.values())):
                continue
            noun = next((self.target_noun_number[w] for w in words[position + 1:]
                         if w in self.target_noun_number), None)
            self.seen["head"] += 1
            self.seen["relative_verbs"] += relative_verb
            if noun is None or suffix != THIRD_PERSON[noun]:
                problems.append(f"{word!r} does not agree with the next noun ({noun})")
        return problems


@pytest.fixture(scope="module")
def corpus():
    return generate_corpus(3, {"train": 4000, "valid": 500, "test": 500})


def test_same_seed_same_bytes_different_seed_different(tmp_path):
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        write_corpus(tmp_path / name, seed=seed, **SMALL)
    first, again, other = (_files(tmp_path / name) for name in "abc")
    # corpus.json records when its files were written (their fingerprints' modification times)
    assert {name: data for name, data in first.items() if name != "corpus.json"} == {
        name: data for name, data in again.items() if name != "corpus.json"}
    assert _manifest_without_times(tmp_path / "a") == _manifest_without_times(tmp_path / "b")
    assert all(other[name] != first[name] for name in first if name != "corpus.json")


def test_corpus_does_not_depend_on_hash_randomisation():
    # the package imports neither torch nor fairseq: the subprocesses start quickly
    code = ("import hashlib; from fairseq_kd.data import synthetic; "
            "corpus = synthetic.generate_corpus(11, {'train': 300, 'test': 30}); "
            "print(hashlib.sha256(repr(corpus).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, text=True,
                              capture_output=True, env={**os.environ, "PYTHONHASHSEED": hash_seed}
                              ).stdout.strip() for hash_seed in ("1", "2")}
    here = hashlib.sha256(repr(generate_corpus(11, {"train": 300, "test": 30})).encode()).hexdigest()
    assert digests == {here}


def test_splits_have_requested_sizes_and_disjoint_sources(corpus):
    assert {name: len(pairs) for name, pairs in corpus.items()} == {"train": 4000, "valid": 500, "test": 500}
    sources = {name: [src for src, _ in pairs] for name, pairs in corpus.items()}
    assert all(len(set(s)) == len(s) for s in sources.values())
    assert not set(sources["train"]) & set(sources["valid"])
    assert not set(sources["train"]) & set(sources["test"])
    assert not set(sources["valid"]) & set(sources["test"])


def test_translation_is_a_function_of_the_source():
    translations, repeats = {}, 0
    for seed in (0, 1):  # different sentence streams must still agree on shared sources
        rng = random.Random(seed)
        for _ in range(6000):
            source, target = sample_sentence_pair(rng)
            repeats += source in translations
            assert translations.setdefault(source, target) == target, source
    assert repeats > 200  # the check above really compared repeated sources


def test_agreement_rules_hold(corpus):
    checker = AgreementChecker()
    for source, target in corpus["train"][:2000] + corpus["test"]:
        assert checker.violations(source, target) == [], (source, target)
    # every suffix and the relative-clause case were exercised
    assert checker.seen["subject"] == set(THIRD_PERSON.values()) | set(PRONOUN_SUFFIX.values())
    assert checker.seen["head"] > 2000 and checker.seen["relative_verbs"] > 50


def test_agreement_checker_detects_wrong_suffixes(corpus):
    checker = AgreementChecker()
    source, target = next((s, t) for s, t in corpus["test"] if " ke " in t and " i " not in s)
    words = target.split()
    final = words[-2]
    stem, suffix = _split_suffix(final)
    wrong = next(s for s in THIRD_PERSON.values() if s != suffix)
    assert checker.violations(source, " ".join(words[:-2] + [stem + wrong, "."]))
    relative = words.index("ke") - 1
    stem, suffix = _split_suffix(words[relative])
    wrong = next(s for s in THIRD_PERSON.values() if s != suffix)
    assert checker.violations(source, " ".join(words[:relative] + [stem + wrong] + words[relative + 1:]))


def test_lengths_in_range(corpus):
    pairs = [pair for split in corpus.values() for pair in split]
    source_lengths = [len(src.split()) for src, _ in pairs]
    target_lengths = [len(tgt.split()) for _, tgt in pairs]
    assert min(source_lengths + target_lengths) >= 3 and max(source_lengths + target_lengths) <= 20
    assert 8.0 <= statistics.mean(source_lengths) <= 10.0
    assert min(source_lengths) <= 4 and max(source_lengths) >= 18  # real length variety
    assert all(src.endswith(" .") and tgt.endswith(" .") for src, tgt in pairs)


def test_same_parameters_reuse_the_corpus(tmp_path, capsys):
    out = tmp_path / "corpus"
    argv = ["--output-dir", str(out), "--seed", "4", "--train-size", "200", "--valid-size", "20",
            "--test-size", "20", "--source-lang", "de", "--target-lang", "en"]
    cli_main(argv)
    expected = {f"{split}.{lang}" for split in ("train", "valid", "test") for lang in ("de", "en")}
    assert {p.name for p in out.iterdir()} == expected | {"corpus.json"}
    assert len((out / "valid.en").read_text().splitlines()) == 20
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    cli_main(argv)
    assert "skipping" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


def test_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "corpus"
    write_corpus(out, seed=1, **SMALL)
    before = _files(out)
    with pytest.raises(FileExistsError, match="--force"):
        write_corpus(out, seed=2, **SMALL)
    assert _files(out) == before
    with (out / "train.tgt").open("a") as handle:  # an edited corpus is not silently reused
        handle.write("extra line .\n")
    with pytest.raises(FileExistsError):
        write_corpus(out, seed=1, **SMALL)
    assert write_corpus(out, seed=2, force=True, **SMALL) == "written"
    assert _files(out)["train.src"] != before["train.src"]
    assert write_corpus(out, seed=2, **SMALL) == "reused"


def test_foreign_folder_is_left_alone(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--output-dir", str(out), "--train-size", "50"])
    assert exit_info.value.code == 2
    assert _files(out) == {"notes.txt": b"keep me"}
    cli_main(["--output-dir", str(out), "--train-size", "50", "--force"])
    assert (out / "notes.txt").read_text() == "keep me" and (out / "train.src").is_file()


@pytest.mark.parametrize("bad_flags", [["--train-size", "0"], ["--source-lang", "a/b"],
                                       ["--source-lang", "xx", "--target-lang", "xx"]])
def test_bad_arguments_fail_before_writing(tmp_path, bad_flags):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--output-dir", str(out), *bad_flags])
    assert exit_info.value.code == 2 and not out.exists()


def test_a_format_1_manifest_is_a_foreign_folder_refused_in_one_line_naming_force(tmp_path):
    """A manifest of another format is no corpus made with these parameters (no special refusal)."""
    out = tmp_path / "corpus"
    write_corpus(out, seed=1, **SMALL)
    manifest = json.loads((out / "corpus.json").read_text())
    corpus_files = sorted(manifest["files"]["files"])
    # corpus.json as written before format 2: no format, the files' bare SHA-256
    legacy = {"generator": "fairseq_kd.data.synthetic", "grammar_version": manifest["grammar_version"],
              "parameters": manifest["parameters"],
              "sha256": {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in corpus_files}}
    (out / "corpus.json").write_text(json.dumps(legacy, indent=2) + "\n")
    stamps = {name: (out / name).stat().st_mtime_ns for name in corpus_files}
    with pytest.raises(FileExistsError, match=r"holds no corpus made with these parameters .*pass --force") as refused:
        write_corpus(out, seed=1, **SMALL)
    assert "\n" not in str(refused.value)
    assert {name: (out / name).stat().st_mtime_ns for name in corpus_files} == stamps  # nothing rewritten
    assert write_corpus(out, seed=1, force=True, **SMALL) == "written"
    assert json.loads((out / "corpus.json").read_text())["format"] == 2
    assert write_corpus(out, seed=1, **SMALL) == "reused"


def test_an_output_folder_under_a_file_is_one_line_naming_the_flag(tmp_path):
    """The system's refusal to make the folder is a user error naming --output-dir and the file in
    the way, not a traceback."""
    from fairseq_kd.errors import UserError

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UserError) as refused:
        write_corpus(tmp_path / "a_file" / "corpus", seed=1, **SMALL)
    message = str(refused.value)
    assert message.startswith(f"output folder {tmp_path / 'a_file' / 'corpus'} (--output-dir): ")
    assert "is a file, not a folder" in message and "\n" not in message


def test_reuse_reads_only_the_files_whose_size_or_time_changed(tmp_path, hashed_files):
    out = tmp_path / "corpus"
    write_corpus(out, seed=1, **SMALL)
    hashed = hashed_files
    hashed.clear()
    assert write_corpus(out, seed=1, **SMALL) == "reused" and hashed == []
    train = out / "train.tgt"
    stat = train.stat()
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes, another time
    assert write_corpus(out, seed=1, **SMALL) == "reused" and hashed == ["train.tgt"]
    edited = bytearray(train.read_bytes())
    edited[0] ^= 1  # same size, other text
    train.write_bytes(bytes(edited))
    with pytest.raises(FileExistsError):
        write_corpus(out, seed=1, **SMALL)
    assert hashed == ["train.tgt", "train.tgt"]
