"""Sequence-level KD data (fairseq-kd-seqkd): output = teacher beam search, in source order,
resumable, accepted by fairseq-train, and refusing bad input before any decoding.

The independent reference is fairseq's own ``fairseq-generate`` on the same split with the same
beam and length limits: its ``H-<id>`` lines, mapped back to token ids with the dictionary.
"""
import filecmp
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, COMMON_TRAIN_ARGS, QUIET_ENV, REPO, TINY_STUDENT_ARGS, USER_DIR, run_cli

import fairseq_kd
from fairseq.data import Dictionary, indexed_dataset
from fairseq_kd.checkpoints import safe_load
from fairseq_kd.teacher_pass import seqkd
from fairseq_kd.models.teacher import TeacherCheckpointError

# short length limits keep the undertrained tiny teacher fast; 400 sentences -> 7 shards of 64
DECODE_FLAGS = ["--max-len-a", "1.2", "--max-len-b", "10", "--max-tokens", "4096", "--shard-size", "64"]
SENTENCES = 400
fairseq_kd.register()


def seqkd_cli(data, teacher, output, *extra, check=True):
    return run_cli("fairseq-kd-seqkd", "--data", data, "--teacher-checkpoint", teacher, "--output", output,
                   *DECODE_FLAGS, *extra, check=check, warm=True)


def read_split(folder: Path, lang: str, split="train"):
    data = indexed_dataset.MMapIndexedDataset(str(folder / f"{split}.src-tgt.{lang}"))
    return [data[i].tolist() for i in range(len(data))]


@pytest.fixture(scope="module")
def generate_reference(tiny_data_bin, tiny_teacher, tmp_path_factory):
    """fairseq-generate's best hypothesis per training sentence id, as token ids (with </s>)."""
    proc = run_cli("fairseq-generate", tiny_data_bin, "--gen-subset", "train", "--path", tiny_teacher,
                   "--beam", "5", "--max-len-a", "1.2", "--max-len-b", "10", "--max-tokens", "4096",
                   "--required-batch-size-multiple", "1", "--user-dir", USER_DIR, warm=True)
    dictionary = Dictionary.load(str(tiny_data_bin / "dict.tgt.txt"))
    hypotheses = {}
    for line in proc.stdout.splitlines():
        if line.startswith("H-"):
            sentence_id, _score, text = line.split("\t")
            hypotheses[int(sentence_id[2:])] = dictionary.encode_line(text, add_if_not_exist=False).tolist()
    assert sorted(hypotheses) == list(range(SENTENCES))
    return hypotheses


@pytest.fixture(scope="module")
def straight_run(tiny_data_bin, tiny_teacher, tmp_path_factory):
    """One uninterrupted run; returns (output folder, CompletedProcess)."""
    output = tmp_path_factory.mktemp("seqkd") / "out"
    return output, seqkd_cli(tiny_data_bin, tiny_teacher, output)


def test_output_is_the_teacher_beam_search_in_source_order(tiny_data_bin, straight_run, generate_reference):
    output, proc = straight_run
    targets, sources = read_split(output, "tgt"), read_split(output, "src")
    # one hypothesis per source line, in the order of the raw training file
    raw_lines = (tiny_data_bin.parent / "raw" / "train.src").read_text().splitlines()
    src_dict = Dictionary.load(str(tiny_data_bin / "dict.src.txt"))
    assert len(targets) == len(sources) == len(raw_lines) == SENTENCES
    assert sources == [src_dict.encode_line(line, add_if_not_exist=False).tolist() for line in raw_lines]
    assert targets == [generate_reference[i] for i in range(SENTENCES)]
    # everything else is the original data, byte for byte
    for name in ["dict.src.txt", "dict.tgt.txt"] + [f"{split}.src-tgt.{lang}.{ext}" for split in ("valid", "test")
                                                    for lang in ("src", "tgt") for ext in ("bin", "idx")]:
        assert filecmp.cmp(tiny_data_bin / name, output / name, shallow=False), name
    assert not (output / seqkd.WORK_DIR_NAME).exists()
    manifest = json.loads((output / seqkd.MANIFEST_NAME).read_text())
    assert manifest["status"] == "complete" and manifest["sentences"] == SENTENCES
    assert manifest["parameters"]["beam"] == 5 and len(manifest["inputs"]["teacher"]["sha256"]) == 64
    throughput = re.search(r"(\d+) sentences in [\d.]+ s = ([\d.]+) sentences/s", proc.stdout)
    assert throughput and int(throughput.group(1)) == SENTENCES and float(throughput.group(2)) > 0


def test_rerun_with_same_flags_is_a_no_op(tiny_data_bin, tiny_teacher, straight_run):
    output, _ = straight_run
    before = {p.name: p.stat().st_mtime_ns for p in output.iterdir()}
    proc = seqkd_cli(tiny_data_bin, tiny_teacher, output)
    assert "nothing to do" in proc.stdout
    assert {p.name: p.stat().st_mtime_ns for p in output.iterdir()} == before


def test_stopped_run_resumes_without_duplicates(tiny_data_bin, tiny_teacher, straight_run, tmp_path):
    output = tmp_path / "out"
    first = seqkd_cli(tiny_data_bin, tiny_teacher, output, "--max-shards", "2")
    assert "2/7 shards done" in first.stdout
    work = output / seqkd.WORK_DIR_NAME
    # each shard with its record (its SHA-256), written before it
    assert sorted(p.name for p in work.iterdir()) == ["shard000000.json", "shard000000.pt", "shard000001.json",
                                                      "shard000001.pt"]
    assert not (output / "train.src-tgt.tgt.bin").exists()
    (work / "shard000002.pt.tmp").write_bytes(b"half-written shard of a killed run")
    second = seqkd_cli(tiny_data_bin, tiny_teacher, output)
    assert "resuming: 2 of 7 shards already decoded" in second.stdout
    assert re.search(rf"\b{SENTENCES - 128} sentences in", second.stdout)  # only the missing ones
    straight, _ = straight_run
    assert read_split(output, "tgt") == read_split(straight, "tgt")
    assert read_split(output, "src") == read_split(straight, "src")


def test_killed_run_resumes_without_duplicates(tiny_data_bin, tiny_teacher, straight_run, tmp_path):
    output = tmp_path / "out"
    cmd = [str(BIN / "fairseq-kd-seqkd"), "--data", str(tiny_data_bin), "--teacher-checkpoint",
           str(tiny_teacher), "--output", str(output), *DECODE_FLAGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=QUIET_ENV)
    first_shard = output / seqkd.WORK_DIR_NAME / "shard000000.pt"
    deadline = time.time() + 300
    while not first_shard.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert first_shard.exists() and not (output / "train.src-tgt.tgt.bin").exists()
    done = len(list((output / seqkd.WORK_DIR_NAME).glob("shard*.pt")))
    resumed = seqkd_cli(tiny_data_bin, tiny_teacher, output)
    assert f"resuming: {done} of 7 shards already decoded" in resumed.stdout
    straight, _ = straight_run
    assert read_split(output, "tgt") == read_split(straight, "tgt")


def test_recipe_step_trains_a_student_on_the_seqkd_data(tiny_data_bin, tiny_teacher, straight_run, tmp_path):
    """examples/translation/seqkd.sh: decoding (here a no-op: same flags as straight_run) then
    fairseq-train on the new data, combined with word-level KD by pointing word_kd at it."""
    output, _ = straight_run
    env = {**QUIET_ENV, "PYTHON_BIN": str(BIN), "SEQKD_FLAGS": " ".join(DECODE_FLAGS),
           "STUDENT_ARCH": "transformer",
           "CRITERION": f"--task translation_kd --teacher-checkpoint {tiny_teacher} --criterion word_kd"}
    student_flags = [flag for flag in TINY_STUDENT_ARGS if flag not in ("--arch", "transformer")]
    proc = subprocess.run(["bash", str(REPO / "examples" / "translation" / "seqkd.sh"), str(tiny_data_bin),
                           str(tiny_teacher), str(output), str(tmp_path / "ckpt"), *student_flags,
                           *COMMON_TRAIN_ARGS, "--max-update", "2"],
                          capture_output=True, text=True, env=env, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "nothing to do" in proc.stdout
    assert re.search(rf"{re.escape(str(output))} train src-tgt {SENTENCES} examples", log)
    assert re.search(r"word_kd_loss[ =][\d.]+", log) and "num_updates 2" in log
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").is_file()


# ------------------------------------------------------------------------ flags
def test_the_command_line_flags_are_the_config_fields():
    """fairseq-kd-seqkd's flags are made from SeqKDConfig: the required flags alone give the
    config's own defaults, and every other flag sets its field with the field's type."""
    from fairseq_kd.cli.seqkd_decode import build_parser

    required = {"data": "data-bin", "teacher_checkpoint": "teacher.pt", "output": "out"}
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in required.items()]
    assert seqkd.SeqKDConfig(**vars(build_parser().parse_args(argv))) == seqkd.SeqKDConfig(**required)
    parsed = seqkd.SeqKDConfig(**vars(build_parser().parse_args(
        argv + ["--beam", "3", "--max-len-a", "1.5", "--batch-size", "7", "--fp16", "--source-lang", "de"])))
    assert (parsed.beam, parsed.max_len_a, parsed.batch_size, parsed.fp16, parsed.source_lang) == (3, 1.5, 7, True, "de")
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv[:2])  # --output is required


# ------------------------------------------------------------------------ bad input
def config(data, teacher, output, **overrides):
    values = dict(data=str(data), teacher_checkpoint=str(teacher), output=str(output), max_len_a=1.2,
                  max_len_b=10, shard_size=64)
    values.update(overrides)
    return seqkd.SeqKDConfig(**values)


def test_missing_and_empty_splits_are_refused(tiny_data_bin, tiny_teacher, tmp_path):
    with pytest.raises(seqkd.SeqKDError, match="--split nope: no binarised nope.src-tgt.src"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, tmp_path / "a", split="nope"))
    data = tmp_path / "data"
    shutil.copytree(tiny_data_bin, data)
    for lang in ("src", "tgt"):
        builder = indexed_dataset.make_builder(str(data / f"empty.src-tgt.{lang}.bin"), "mmap", vocab_size=100)
        builder.finalize(str(data / f"empty.src-tgt.{lang}.idx"))
    with pytest.raises(seqkd.SeqKDError, match="--split empty: the split .* has no sentences"):
        seqkd.run(config(data, tiny_teacher, tmp_path / "b", split="empty"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _with_changed_dictionaries(tiny_data_bin, folder, change):
    shutil.copytree(tiny_data_bin, folder)
    for lang in ("src", "tgt"):
        lines = (folder / f"dict.{lang}.txt").read_text().splitlines()
        (folder / f"dict.{lang}.txt").write_text("\n".join(change(lines)) + "\n")
    return folder


def test_teacher_with_another_vocabulary_size_is_refused(tiny_data_bin, tiny_teacher, tmp_path):
    data = _with_changed_dictionaries(tiny_data_bin, tmp_path / "data", lambda lines: lines + ["extra 1"])
    with pytest.raises(TeacherCheckpointError, match="source embedding has 64 symbols but the data's source "
                                                     "dictionary has 65"):
        seqkd.run(config(data, tiny_teacher, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_teacher_with_reordered_dictionaries_is_refused(tiny_data_bin, tiny_teacher, tmp_path):
    def swap_first_two(lines):
        return [lines[1], lines[0], *lines[2:]]

    data = _with_changed_dictionaries(tiny_data_bin, tmp_path / "data", swap_first_two)
    # same size, two symbols swapped: only comparing with the teacher's own dictionary files shows it;
    # they are found through the languages named in the teacher's configuration
    state = safe_load(tiny_teacher)
    state["cfg"]["task"]["source_lang"], state["cfg"]["task"]["target_lang"] = "src", "tgt"
    teacher = tmp_path / "teacher.pt"
    torch.save(state, teacher)
    with pytest.raises(TeacherCheckpointError, match="dictionary .* differs from the data's"):
        seqkd.run(config(data, teacher, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_output_holding_another_dataset_is_refused_without_force(tiny_data_bin, tiny_teacher, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_data_bin, other)
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    proc = seqkd_cli(tiny_data_bin, tiny_teacher, other, check=False)
    assert proc.returncode == 2
    assert "is not empty and was not written by this command" in proc.stderr and "--force" in proc.stderr
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    # --force replaces the binarised files (no stale split left to be read) and keeps the rest
    seqkd.run(config(tiny_data_bin, tiny_teacher, other, force=True, max_shards=1), log=lambda _: None)
    remaining = {p.name for p in other.iterdir()}
    assert remaining == {"preprocess.log", seqkd.MANIFEST_NAME, seqkd.WORK_DIR_NAME}


def test_force_into_a_folder_that_does_not_exist_yet_makes_it(tiny_data_bin, tiny_teacher, tmp_path):
    output = tmp_path / "new" / "seqkd"
    result = seqkd.run(config(tiny_data_bin, tiny_teacher, output, force=True, max_shards=1), log=lambda _: None)
    assert result.output == output and (output / seqkd.MANIFEST_NAME).is_file()


def test_output_made_with_other_settings_or_the_input_folder_is_refused(tiny_data_bin, tiny_teacher,
                                                                        straight_run, tmp_path):
    output, _ = straight_run
    with pytest.raises(seqkd.SeqKDError, match=r"other settings \(differing: beam;"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, output, beam=4))
    with pytest.raises(seqkd.SeqKDError, match="is the --data folder"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, tiny_data_bin, force=True))
    for flag, overrides in (("--beam", dict(beam=0)), ("--shard-size", dict(shard_size=0)),
                            ("--max-tokens", dict(max_tokens=None, batch_size=None))):
        with pytest.raises(seqkd.SeqKDError, match=flag):
            seqkd.run(config(tiny_data_bin, tiny_teacher, tmp_path / "x", **overrides))
    with pytest.raises(seqkd.SeqKDError, match="--teacher-checkpoint"):
        seqkd.run(config(tiny_data_bin, tmp_path / "missing.pt", tmp_path / "x"))
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------ the manifest's fingerprints
def quiet(_line):
    pass


def _old_sha256_of_files(paths):
    """How seqkd.json recorded its inputs before format 2: one digest over names and bytes."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _as_format_1(output: Path, data: Path, teacher: Path) -> dict:
    """Rewrite ``output``'s seqkd.json as the code before format 2 wrote it, and return it."""
    manifest = json.loads((output / seqkd.MANIFEST_NAME).read_text())
    split = sorted(p for p in data.glob("train.src-tgt.*") if p.suffix in (".bin", ".idx"))
    parameters = {"format_version": 1, **manifest["parameters"], "split_sha256": _old_sha256_of_files(split),
                  "dictionaries_sha256": _old_sha256_of_files([data / "dict.src.txt", data / "dict.tgt.txt"]),
                  "teacher_sha256": _old_sha256_of_files([teacher])}
    legacy = {**{k: v for k, v in manifest.items() if k not in ("format", "inputs")}, "parameters": parameters}
    (output / seqkd.MANIFEST_NAME).write_text(json.dumps(legacy, indent=2, sort_keys=True) + "\n")
    return legacy


def test_a_format_1_manifest_is_refused_in_one_line_saying_to_decode_anew(tiny_data_bin, tiny_teacher,
                                                                          straight_run, tmp_path):
    """A record of an older format is one that fails today's check: other settings, named."""
    straight, _ = straight_run
    for name, source in (("done", straight), ("partial", None)):
        output = tmp_path / name
        if source is not None:
            shutil.copytree(source, output)
        else:
            seqkd.run(config(tiny_data_bin, tiny_teacher, output, max_shards=1), log=quiet)
        _as_format_1(output, tiny_data_bin, tiny_teacher)
        before = {path.name: path.stat().st_mtime_ns for path in output.iterdir()}
        with pytest.raises(seqkd.SeqKDError, match=r"made with other settings \(differing: .*pass --force") as refused:
            seqkd.run(config(tiny_data_bin, tiny_teacher, output), log=quiet)
        assert "\n" not in str(refused.value)
        assert {path.name: path.stat().st_mtime_ns for path in output.iterdir()} == before


def test_a_finished_output_changed_on_disk_is_refused_naming_the_file(tiny_data_bin, tiny_teacher, straight_run,
                                                                     tmp_path):
    """A re-run checks the finished output against the digests its record holds (files whose
    modification time changed are hashed), not only their sizes: an edited file of the same size
    is refused in one line naming it, and nothing is written."""
    output = tmp_path / "done"
    shutil.copytree(straight_run[0], output)
    target = output / "train.src-tgt.tgt.bin"
    edited = bytearray(target.read_bytes())
    edited[len(edited) // 2] ^= 1
    target.write_bytes(bytes(edited))
    before = {path.name: path.stat().st_mtime_ns for path in output.iterdir()}
    with pytest.raises(seqkd.SeqKDError) as refused:
        seqkd.run(config(tiny_data_bin, tiny_teacher, output), log=quiet)
    message = str(refused.value)
    assert message == (f"--output {output}: {seqkd.MANIFEST_NAME} says complete but train.src-tgt.tgt.bin is not "
                       "the file it records (its SHA-256 differs): changed on disk; pass --force to decode anew")
    assert {path.name: path.stat().st_mtime_ns for path in output.iterdir()} == before
    target.write_bytes(bytes(edited[:-1]))  # truncated
    with pytest.raises(seqkd.SeqKDError, match=r"train.src-tgt.tgt.bin is \d+ bytes where it records \d+"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, output), log=quiet)
    target.unlink()
    with pytest.raises(seqkd.SeqKDError, match=r"train.src-tgt.tgt.bin is missing; pass --force"):
        seqkd.run(config(tiny_data_bin, tiny_teacher, output), log=quiet)


def test_a_rerun_reads_only_the_inputs_whose_size_or_time_changed(tiny_data_bin, tiny_teacher, straight_run,
                                                                  tmp_path, hashed_files):
    data, teacher = tmp_path / "data", tmp_path / "teacher.pt"
    shutil.copytree(tiny_data_bin, data)  # sizes and modification times kept
    shutil.copy2(tiny_teacher, teacher)
    partial = tmp_path / "partial"
    seqkd.run(config(data, teacher, partial, max_shards=1), log=quiet)
    done = tmp_path / "done"
    shutil.copytree(straight_run[0], done)
    hashed = hashed_files
    hashed.clear()
    # a resumed decoding loads the teacher, and hashes only the shard it skips as done (against its record)
    assert seqkd.run(config(data, teacher, partial, max_shards=1), log=quiet).decoded_now == 64
    assert hashed == ["shard000000.pt"]
    hashed.clear()
    # a finished one, its inputs moved (cp -p), neither
    assert seqkd.run(config(data, teacher, done), log=quiet).status == "up_to_date" and hashed == []
    # a touched teacher is read once, then its new time is recorded
    stat = teacher.stat()
    os.utime(teacher, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert seqkd.run(config(data, teacher, done), log=quiet).status == "up_to_date" and hashed == ["teacher.pt"]
    assert seqkd.run(config(data, teacher, done), log=quiet).status == "up_to_date" and hashed == ["teacher.pt"]
    # another teacher is refused as before
    teacher.write_bytes(teacher.read_bytes() + b"\0")
    with pytest.raises(seqkd.SeqKDError, match=r"other settings \(differing: teacher;"):
        seqkd.run(config(data, teacher, done), log=quiet)
