"""Every start-up error named by the foundation: clear, early, and nothing written."""
import os
import pickle

import pytest
import torch

from conftest import (COMMON_TRAIN_ARGS, TINY_STUDENT_ARGS, USER_DIR, run_cli, run_fairseq_train_here,
                      train_student, write_reverse_corpus)


def _fails_before_work(proc, save_dir, *fragments):
    assert proc.returncode != 0
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr[-3000:]
    assert not (save_dir / "checkpoint_last.pt").exists()


def test_missing_teacher_path(tiny_data_bin, tmp_path):
    proc = train_student(tiny_data_bin, tmp_path / "nope.pt", tmp_path / "s", ["--criterion", "word_kd"], refused=True)
    _fails_before_work(proc, tmp_path / "s", "--teacher-checkpoint", "no such file")


def test_corrupt_teacher_file(tiny_data_bin, tmp_path):
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(b"this is not a checkpoint")
    proc = train_student(tiny_data_bin, bad, tmp_path / "s", ["--criterion", "word_kd"], refused=True)
    _fails_before_work(proc, tmp_path / "s", "--teacher-checkpoint", "not a readable fairseq checkpoint")


def test_teacher_with_other_dictionaries(tiny_teacher, tmp_path):
    raw = write_reverse_corpus(tmp_path / "raw", sizes=(("train", 50), ("valid", 5)), seed=3)
    # a different vocabulary: the source words get a suffix
    for split in ("train", "valid"):
        path = raw / f"{split}.src"
        path.write_text("\n".join(" ".join(w + "x" for w in line.split()) for line in path.read_text().splitlines()) + "\n")
    data = tmp_path / "bin"
    run_cli("fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", raw / "train",
            "--validpref", raw / "valid", "--destdir", data, "--workers", "1", warm=True)
    proc = train_student(data, tiny_teacher, tmp_path / "s", ["--criterion", "word_kd"], refused=True)
    _fails_before_work(proc, tmp_path / "s", "--teacher-checkpoint", "dictionar", "--srcdict")


def test_teacher_that_is_not_a_transformer(tiny_data_bin, tmp_path):
    lstm = tmp_path / "lstm"
    made = run_cli("fairseq-train", tiny_data_bin, "--task", "translation", "--arch", "lstm", "--encoder-embed-dim", "8",
                   "--decoder-embed-dim", "8", "--encoder-hidden-size", "8", "--decoder-hidden-size", "8",
                   "--decoder-out-embed-dim", "8", "--criterion", "cross_entropy", *COMMON_TRAIN_ARGS,
                   "--max-update", "1", "--save-dir", lstm, "--user-dir", USER_DIR, check=False, warm=True)
    # fairseq's LSTM sometimes aborts at interpreter exit ("terminate called without an active
    # exception") after saving; only the saved checkpoint matters here.
    assert (lstm / "checkpoint_last.pt").exists(), made.stderr[-3000:]
    proc = train_student(tiny_data_bin, lstm / "checkpoint_last.pt", tmp_path / "s", ["--criterion", "word_kd"], refused=True)
    _fails_before_work(proc, tmp_path / "s", "not an encoder-decoder Transformer")


def test_distillation_criterion_without_teacher_or_without_kd_task(tiny_data_bin, tmp_path):
    proc = run_fairseq_train_here(tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation_kd",
                                  *TINY_STUDENT_ARGS, "--criterion", "word_kd", *COMMON_TRAIN_ARGS, "--max-update", "1",
                                  "--save-dir", tmp_path / "s")
    _fails_before_work(proc, tmp_path / "s", "--teacher-checkpoint")
    proc = run_fairseq_train_here(tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation",
                                  *TINY_STUDENT_ARGS, "--criterion", "word_kd", *COMMON_TRAIN_ARGS, "--max-update", "1",
                                  "--save-dir", tmp_path / "s2")
    _fails_before_work(proc, tmp_path / "s2", "--task translation_kd")


class _RunsCodeWhenUnpickled:
    marker = None

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_checkpoint_needing_an_unlisted_class_is_refused_never_unpickled(tiny_data_bin, tiny_teacher, tmp_path):
    state = torch.load(tiny_teacher, weights_only=False)  # our own test file, trusted
    payload = _RunsCodeWhenUnpickled()
    _RunsCodeWhenUnpickled.marker = tmp_path / "code_ran"
    state["extra_state"]["evil"] = payload
    evil = tmp_path / "evil.pt"
    torch.save(state, evil)
    proc = train_student(tiny_data_bin, evil, tmp_path / "s", ["--criterion", "word_kd"], refused=True)
    _fails_before_work(proc, tmp_path / "s", "refusing to load checkpoint", "allow-list")
    assert not (tmp_path / "code_ran").exists()

    import fairseq_kd
    from fairseq import checkpoint_utils

    from fairseq_kd.checkpoints import UnsafeCheckpointError

    fairseq_kd.register()
    with pytest.raises(UnsafeCheckpointError, match="posix.mkdir|os.mkdir|mkdir"):
        checkpoint_utils.load_checkpoint_to_cpu(str(evil))
    assert not (tmp_path / "code_ran").exists()
    assert pickle  # the payload above is a real pickle gadget, not a mock


def test_teacher_with_reordered_dictionary_of_the_same_size(tiny_data_bin, tiny_teacher, tmp_path):
    """The teacher was trained without --source-lang/--target-lang; its languages are inferred
    from its data folder, whose dictionary is then compared symbol for symbol."""
    import shutil

    data = tmp_path / "reordered"
    shutil.copytree(tiny_data_bin, data)
    lines = (data / "dict.src.txt").read_text().splitlines()
    lines[0], lines[1] = lines[1], lines[0]
    (data / "dict.src.txt").write_text("\n".join(lines) + "\n")
    proc = train_student(data, tiny_teacher, tmp_path / "s", ["--criterion", "word_kd"], refused=True)
    _fails_before_work(proc, tmp_path / "s", "--teacher-checkpoint", "dictionary", "first difference at index")
