"""A path of the wrong kind is said as such, naming the flag: a folder where a checkpoint file is
expected (fairseq-kd-export, the teachers of fairseq-train, fairseq-kd-seqkd and
fairseq-kd-teacher-cache), a file where a data folder is expected, a file in the way of an output
folder; never "no such file" for a folder, nor the system's bare "Not a directory"."""
import errno
import os
import shutil

import pytest

from conftest import BIN, run_cli_here, train_student
from fairseq_kd.errors import FILE, FOLDER, OUTPUT_FILE, OUTPUT_FOLDER, PathError, message_of, path_problem, require_path


@pytest.fixture()
def paths(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x\n")
    return folder, a_file


def test_path_problem_says_what_the_path_is(paths, tmp_path):
    folder, a_file = paths
    assert path_problem(folder, FILE) == "is a folder, not a file"
    assert path_problem(a_file, FOLDER) == "is a file, not a folder"
    assert path_problem(tmp_path / "nope", FILE) == "no such file"
    assert path_problem(tmp_path / "nope", FOLDER) == "no such folder"
    assert path_problem(a_file / "x", FOLDER) == f"no such folder: {str(a_file)!r} is a file, not a folder"
    assert path_problem(a_file, OUTPUT_FOLDER) == "is a file, not a folder"
    assert path_problem(a_file / "x" / "y", OUTPUT_FOLDER) == f"cannot be made: {str(a_file)!r} is a file, not a folder"
    assert path_problem(folder, OUTPUT_FILE) == "is a folder, not a file"
    for fine in ((folder, FOLDER), (a_file, FILE), (tmp_path / "new", OUTPUT_FOLDER), (folder, OUTPUT_FOLDER),
                 (folder / "new.pt", OUTPUT_FILE)):
        assert path_problem(*fine) is None, fine
    with pytest.raises(PathError, match=r"^--data '.*a_file': is a file, not a folder; give the binarised folder$"):
        require_path(a_file, "--data", FOLDER, hint="give the binarised folder")
    assert require_path(folder, "--data", FOLDER) == folder


def test_the_systems_not_a_directory_is_said_in_words(paths):
    folder, a_file = paths
    with pytest.raises(OSError) as under_a_file:
        os.listdir(a_file)
    assert under_a_file.value.errno == errno.ENOTDIR
    assert message_of(under_a_file.value) == f"{a_file}: is a file, not a folder (a folder is expected here)"
    with pytest.raises(OSError) as deeper:
        open(a_file / "x" / "y", "w")
    assert message_of(deeper.value) == f"{a_file / 'x' / 'y'}: {str(a_file)!r} is a file, not a folder (a folder is expected here)"
    with pytest.raises(OSError) as a_folder:
        open(folder)
    assert message_of(a_folder.value) == f"{folder}: is a folder, not a file (a file is expected here)"


def test_a_folder_given_as_checkpoint_names_the_checkpoints_it_holds(paths):
    from fairseq_kd.models.from_checkpoint import checkpoint_file_problem

    folder, _ = paths
    assert checkpoint_file_problem(folder) == (
        "is a folder, not a file; give the checkpoint file, e.g. " + str(folder / "checkpoint_best.pt"))
    (folder / "checkpoint_last.pt").write_bytes(b"")
    assert checkpoint_file_problem(folder) == (
        "is a folder, not a file (it holds checkpoint_last.pt); give the checkpoint file, e.g. "
        + str(folder / "checkpoint_last.pt"))
    assert checkpoint_file_problem(folder / "nope.pt") == "no such file"


def _one_line_error(proc, prog, *fragments):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in last, last
    return last


def test_export_refuses_a_folder_and_an_output_under_a_file(tiny_teacher, paths, tmp_path):
    folder, a_file = paths
    shutil.copy(tiny_teacher, folder / "checkpoint_best.pt")
    proc = run_cli_here("fairseq-kd-export", folder, tmp_path / "out.pt")
    _one_line_error(proc, "fairseq-kd-export", f"checkpoint {str(folder)!r}: is a folder, not a file",
                    "checkpoint_best.pt")
    proc = run_cli_here("fairseq-kd-export", tiny_teacher, a_file / "out.pt")
    _one_line_error(proc, "fairseq-kd-export", f"{str(a_file)!r} is a file, not a folder")
    assert not (tmp_path / "out.pt").exists()


def test_training_teacher_checkpoint_that_is_a_folder(tiny_data_bin, tiny_teacher, paths, tmp_path):
    folder, a_file = paths
    proc = train_student(tiny_data_bin, folder, tmp_path / "s", ["--criterion", "word_kd"], refused=True)
    assert proc.returncode != 0
    assert f"--teacher-checkpoint {str(folder)!r}: is a folder, not a file" in proc.stderr, proc.stderr[-3000:]
    assert "no such file" not in proc.stderr
    assert not (tmp_path / "s" / "checkpoint_last.pt").exists()


def test_teacher_data_that_is_a_file(kd_task, tiny_teacher, paths):
    from fairseq_kd.models.teacher import FrozenTeacher, TeacherCheckpointError

    _, a_file = paths
    with pytest.raises(TeacherCheckpointError, match=r"--teacher-data '.*a_file': is a file, not a folder\."):
        FrozenTeacher.load(str(tiny_teacher), kd_task, teacher_data=str(a_file))


def test_teacher_cache_teacher_checkpoint_that_is_a_folder(tiny_data_bin, paths, tmp_path):
    folder, _ = paths
    proc = run_cli_here("fairseq-kd-teacher-cache", "--data", tiny_data_bin, "--teacher-checkpoint", folder,
                        "--output", tmp_path / "cache", "--cpu")
    _one_line_error(proc, "fairseq-kd-teacher-cache", f"--teacher-checkpoint {str(folder)!r}: is a folder, not a file")


# The teacher passes (fairseq_kd/teacher_pass/, cli/seqkd_decode.py, cli/teacher_cache.py) call
# the same shared checks (fairseq_kd.cli.user_errors, models.teacher.teacher_file_problem).
def test_seqkd_teacher_checkpoint_that_is_a_folder(tiny_data_bin, paths, tmp_path):
    folder, _ = paths
    proc = run_cli_here("fairseq-kd-seqkd", "--data", tiny_data_bin, "--teacher-checkpoint", folder,
                        "--output", tmp_path / "out", "--cpu", "--split", "valid")
    _one_line_error(proc, "fairseq-kd-seqkd", f"--teacher-checkpoint {str(folder)!r}: is a folder, not a file")


@pytest.mark.parametrize("command", ["fairseq-kd-seqkd", "fairseq-kd-teacher-cache"])
def test_teacher_pass_data_that_is_a_file(command, tiny_teacher, paths, tmp_path):
    _, a_file = paths
    proc = run_cli_here(command, "--data", a_file, "--teacher-checkpoint", tiny_teacher, "--output", tmp_path / "out",
                        "--cpu")
    _one_line_error(proc, command, f"--data {str(a_file)!r}: is a file, not a folder")


@pytest.mark.parametrize("command", ["fairseq-kd-seqkd", "fairseq-kd-teacher-cache"])
def test_teacher_pass_output_that_is_a_file(command, tiny_data_bin, tiny_teacher, paths):
    _, a_file = paths
    proc = run_cli_here(command, "--data", tiny_data_bin, "--teacher-checkpoint", tiny_teacher, "--output", a_file,
                        "--cpu")
    _one_line_error(proc, command, f"--output {str(a_file)!r}: is a file, not a folder")


def _decode_error(read, path):
    with pytest.raises(UnicodeDecodeError) as error:
        read(path)
    return message_of(error.value)


def _read_text(path):
    return path.read_text(encoding="utf-8")


def _read_lines(path):
    with open(path, encoding="utf-8") as lines:
        return list(lines)


@pytest.mark.parametrize("read", [_read_text, _read_lines])
def test_text_that_is_not_utf8_names_the_file_and_a_binary_one_is_never_to_be_converted(tmp_path, read):
    """A file that is not UTF-8 is named, however it was read; converting it (iconv) is advised only
    for text in another encoding, never for binary data (a model file given as text, a damaged file)."""
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x06\x00\x00\x00\x10\x00Transformer\xff\xfe" + bytes(range(256)) * 4)
    message = _decode_error(read, latin)
    assert message.startswith(f"{latin} is not valid UTF-8 (byte 0xe9)") and "iconv" in message, message
    message = _decode_error(read, binary)
    assert message.startswith(f"{binary} is binary data, not UTF-8 text") and "iconv" not in message, message
    assert "convert" not in message, message


def test_the_scoring_commands_word_an_undecodable_file_the_same_way(tmp_path):
    """fairseq-kd-score's and fairseq-kd-report's readers (scoring.files.naming_decode_errors) name
    the file and advise converting text in another encoding, never binary data."""
    from fairseq_kd.scoring.files import UndecodableFileError, load_json

    latin = tmp_path / "sidecar.json"
    latin.write_bytes('{"a": "caf\xe9"}'.encode("latin-1"))
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x06\x00\x00\x00\x10\x00Transformer\xff\xfe" + bytes(range(256)) * 4)
    with pytest.raises(UndecodableFileError) as error:
        load_json(latin, "--sidecar file")
    assert str(error.value).startswith(f"--sidecar file: {latin} is not valid UTF-8") and "iconv" in str(error.value)
    with pytest.raises(UndecodableFileError) as error:
        load_json(binary, "--sidecar file")
    assert str(error.value).startswith(f"--sidecar file: {binary} is binary data") and "convert" not in str(error.value)


def test_undecodable_bytes_of_no_known_file_are_not_advised_to_be_converted_when_binary():
    with pytest.raises(UnicodeDecodeError) as error:
        (b"\x00\x01\xff" * 8).decode("utf-8")
    assert "iconv" not in message_of(error.value) and "convert" not in message_of(error.value)


def test_scoring_and_plot_outputs_under_a_file_are_one_line_before_work(paths, tmp_path):
    """An output whose folder cannot be made (a file is in the way) is refused by the one path
    wording before any scoring or drawing, not the system's error when it is written."""
    folder, a_file = paths
    hyp = tmp_path / "hyp.txt"
    hyp.write_text("a b\n")
    proc = run_cli_here("fairseq-kd-score", "--hyp", hyp, "--ref", hyp, "--output-json", a_file / "s.json")
    _one_line_error(proc, "fairseq-kd-score", "--output-json", f"cannot be made: {str(a_file)!r} is a file, not a folder")
    proc = run_cli_here("fairseq-kd-report", "--system", f"a={hyp}", "--out-prefix", a_file / "r")
    _one_line_error(proc, "fairseq-kd-report", "--out-prefix", f"cannot be made: {str(a_file)!r} is a file, not a folder")
    log = tmp_path / "train.log"
    log.write_text('{"epoch": 1, "update": 1.0, "loss": "2.0", "num_updates": "1"}\n')
    proc = run_cli_here("fairseq-kd-plot", "curves", "--log", log, "--output", a_file / "c.png")
    _one_line_error(proc, "fairseq-kd-plot", "--output", f"cannot be made: {str(a_file)!r} is a file, not a folder")
    proc = run_cli_here("fairseq-kd-plot", "curves", "--log", folder, "--output", tmp_path / "c.png")
    _one_line_error(proc, "fairseq-kd-plot", f"training log {str(folder)!r}: is a folder, not a file")
    assert not (tmp_path / "c.png").exists()


def test_scoring_inputs_of_the_wrong_kind_are_path_errors(paths):
    """The scoring readers' refusals are the plugin's user errors (PathError), in the one wording."""
    from fairseq_kd.scoring.detok import read_generate_output
    from fairseq_kd.scoring.files import load_json

    folder, a_file = paths
    with pytest.raises(PathError, match="is a folder, not a file"):
        read_generate_output(folder)
    with pytest.raises(PathError, match=f"--sidecar file {str(a_file / 'x')!r}: no such file: "):
        load_json(a_file / "x", "--sidecar file")
