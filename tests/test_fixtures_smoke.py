import re
import subprocess

import pytest

from conftest import (BIN, COMMON_TRAIN_ARGS, QUIET_ENV, TINY_STUDENT_ARGS, USER_DIR, WarmInterpreter, build_tiny_student,
                      run_cli, run_module)


def test_fixtures_build_teacher_student_and_batch(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    assert kd_task.teacher.shape.encoder_layers == 3 and kd_task.student_shape.encoder_layers == 2
    out = student(**tiny_batch["net_input"])
    assert out[0].shape[:2] == tiny_batch["target"].shape
    # left-padded source, right-padded target
    pad = kd_task.source_dictionary.pad()
    assert tiny_batch["net_input"]["src_tokens"][2, 0] == pad
    assert tiny_batch["target"][2, -1] == pad


def test_a_warm_child_does_what_a_new_process_does(tiny_data_bin, tiny_teacher, tmp_path):
    """run_cli(..., warm=True) (tests/warm_interpreter.py): the same output streams and lines as a new
    process, numbers aside, and the same hypotheses; the same exit status and one line (no
    traceback) for the plugin's user error; a timeout kills the child."""
    runs = {}
    for warm in (False, True):
        runs[warm] = [run_cli("fairseq-generate", tiny_data_bin, "--path", tiny_teacher, "--gen-subset", "valid",
                              "--beam", "2", "--cpu", "--user-dir", USER_DIR, warm=warm),
                      run_cli("fairseq-train", tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation_kd",
                              *TINY_STUDENT_ARGS, *COMMON_TRAIN_ARGS, "--criterion", "word_kd", "--teacher-checkpoint",
                              tmp_path / "absent.pt", "--save-dir", tmp_path / "never", warm=warm, check=False)]
    numbers = lambda text: re.sub(r"[0-9]+(\.[0-9]+)?", "N", text)  # noqa: E731
    for new, warm in zip(runs[False], runs[True]):
        assert new.returncode == warm.returncode
        assert numbers(new.stdout).splitlines() == numbers(warm.stdout).splitlines()
        assert numbers(new.stderr).splitlines() == numbers(warm.stderr).splitlines()
    assert runs[True][0].returncode == 0 and runs[True][0].stdout.count("\nH-") == 40
    assert [line for line in runs[True][0].stdout.splitlines() if line.startswith("H-")] == \
        [line for line in runs[False][0].stdout.splitlines() if line.startswith("H-")]
    refused = runs[True][1]
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("fairseq-train: error: --teacher-checkpoint ")
    assert not list((tmp_path / "never").glob("*.pt"))
    server = WarmInterpreter.for_script("fairseq-train", QUIET_ENV)
    pid = server.start([str(BIN / "fairseq-train"), "--help"], QUIET_ENV, tmp_path / "out", tmp_path / "out")
    assert server.wait(pid) == 0 and "usage: fairseq-train" in (tmp_path / "out").read_text()
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("fairseq-generate", tiny_data_bin, "--path", tiny_teacher, "--gen-subset", "train", "--beam", "50",
                "--cpu", "--user-dir", USER_DIR, warm=True, timeout=0.5)


def test_a_warm_python_m_child_does_what_python_m_does(tmp_path):
    """run_module(..., warm=True): ``python -m MODULE`` run anew as ``__main__`` in a warm interpreter's
    child writes the same files and prints the same output, with the same exit status, as a new
    ``python -m`` process, for work and for a refusal (relative paths: each in a folder of its own)."""
    runs = {}
    for warm in (False, True):
        folder = tmp_path / ("warm" if warm else "new")
        folder.mkdir()
        runs[warm] = [
            run_module("fairseq_kd.cli.make_corpus", "--output-dir", "corpus", "--train-size", "20", "--valid-size", "4",
                       "--test-size", "4", cwd=folder, warm=warm),
            run_module("fairseq_kd.cli.score", "--hyp", "corpus/test.tgt", "--ref", "corpus/valid.tgt", cwd=folder,
                       warm=warm, check=False),
            run_module("fairseq_kd.cli.score", "--hyp", "absent.txt", "--ref", "corpus/test.tgt", cwd=folder,
                       warm=warm, check=False)]
    for new, warm in zip(runs[False], runs[True]):
        assert (new.returncode, new.stdout, new.stderr) == (warm.returncode, warm.stdout, warm.stderr)
    assert [run.returncode for run in runs[True]] == [0, 0, 2] and "absent.txt" in runs[True][2].stderr
    untimed = lambda path: re.sub(rb'"mtime_ns": \d+', b"", path.read_bytes())  # noqa: E731 - corpus.json's times
    made = {warm: {path.relative_to(tmp_path / name): untimed(path) for path in (tmp_path / name).rglob("*")
                   if path.is_file()} for warm, name in ((False, "new"), (True, "warm"))}
    assert len(made[True]) > 6 and made[True] == made[False]
