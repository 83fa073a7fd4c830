"""Issue 15's remaining promises: the teacher's dictionaries are always verified (or the teacher is
refused, naming --teacher-data), a best checkpoint is only replaced by one chosen on the same
metric, an A2D resume with other options names them, and user errors are one line."""
import hashlib
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import (BIN, COMMON_TRAIN_ARGS, QUIET_ENV, REPO, TINY_STUDENT_ARGS, USER_DIR, run_cli, run_cli_here, run_module,
                      train_student)


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- teacher dictionaries


@pytest.fixture()
def moved_teacher(tiny_teacher, tmp_path):
    """The tiny teacher as if copied from another machine: its data folder does not exist here."""
    state = torch.load(tiny_teacher, weights_only=False)  # our own test file, trusted
    state["cfg"]["task"]["data"] = "/nonexistent/elsewhere/data-bin"
    path = tmp_path / "moved_teacher.pt"
    torch.save(state, path)
    return path


def _dictionary_check(kd_task, state, **kwargs):
    from fairseq_kd.models.teacher import check_dictionaries
    from fairseq_kd.checkpoints import load_fairseq_checkpoint  # noqa: F401 (allow-list)

    return check_dictionaries("T.pt", state, kd_task.source_dictionary, kd_task.target_dictionary, state["cfg"],
                              data_langs=("src", "tgt"), **kwargs)


def test_dictionaries_are_never_skipped_silently(kd_task, moved_teacher, tiny_data_bin, tmp_path):
    from fairseq_kd.checkpoints import load_fairseq_checkpoint
    from fairseq_kd.models.teacher import TeacherCheckpointError
    from fairseq_kd.fingerprint import dictionary_sha256

    state = load_fairseq_checkpoint(moved_teacher)
    # nothing to verify against: refused, naming the flag and the missing folder
    with pytest.raises(TeacherCheckpointError, match="--teacher-data DIR") as err:
        _dictionary_check(kd_task, state)
    assert "/nonexistent/elsewhere/data-bin" in str(err.value) and "equal sizes are not proof" in str(err.value)
    # --teacher-data: compared symbol for symbol
    assert "--teacher-data" in _dictionary_check(kd_task, state, teacher_data=str(tiny_data_bin))
    reordered = tmp_path / "reordered"
    shutil.copytree(tiny_data_bin, reordered)
    lines = (reordered / "dict.src.txt").read_text().splitlines()
    lines[0], lines[1] = lines[1], lines[0]  # same size, other symbols (index 4: after the 4 specials)
    (reordered / "dict.src.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(TeacherCheckpointError, match="first difference at index 4"):
        _dictionary_check(kd_task, state, teacher_data=str(reordered))
    with pytest.raises(TeacherCheckpointError, match="--teacher-data .*no such folder"):
        _dictionary_check(kd_task, state, teacher_data=str(tmp_path / "nope"))
    (reordered / "dict.tgt.txt").unlink()
    with pytest.raises(TeacherCheckpointError, match="dict.tgt.txt"):
        _dictionary_check(kd_task, state, teacher_data=str(reordered))
    # what the checkpoint carries (a translation_kd checkpoint records its dictionaries' hashes)
    binding = {"source_dictionary_sha256": dictionary_sha256(kd_task.source_dictionary),
               "target_dictionary_sha256": dictionary_sha256(kd_task.target_dictionary)}
    state["extra_state"]["TranslationKDTask"] = {"binding": binding}
    assert "hashes" in _dictionary_check(kd_task, state)
    state["extra_state"]["TranslationKDTask"]["binding"]["source_dictionary_sha256"] = "0" * 64
    with pytest.raises(TeacherCheckpointError, match="source dictionary .*recorded in the checkpoint"):
        _dictionary_check(kd_task, state)


def test_moved_teacher_through_fairseq_train(tiny_data_bin, moved_teacher, tmp_path):
    # a new fairseq-train process: what it prints for the plugin's user error is the claim
    proc = train_student(tiny_data_bin, moved_teacher, tmp_path / "s", ["--criterion", "word_kd"], max_update=1,
                         check=False, warm=False)
    assert proc.returncode != 0 and "--teacher-data DIR" in proc.stderr, proc.stderr[-3000:]
    # one line, as from the plugin's own commands, not a traceback ending in it
    assert proc.stderr.strip().splitlines()[-1].startswith("fairseq-train: error: --teacher-checkpoint ")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "s" / "checkpoint_last.pt").exists()
    proc = train_student(tiny_data_bin, moved_teacher, tmp_path / "s", ["--criterion", "word_kd"], max_update=1,
                         extra=["--teacher-data", tiny_data_bin])
    assert "dictionaries compared symbol for symbol with --teacher-data" in proc.stdout + proc.stderr


def test_moved_teacher_through_seqkd(tiny_data_bin, moved_teacher, tmp_path):
    """fairseq-kd-seqkd runs a stock translation task: it too refuses unverifiable dictionaries."""
    args = ["--data", tiny_data_bin, "--teacher-checkpoint", moved_teacher, "--split", "valid",
            "--beam", "1", "--max-len-b", "10", "--cpu"]
    proc = run_cli_here("fairseq-kd-seqkd", *args, "--output", tmp_path / "out")
    assert proc.returncode != 0 and "--teacher-data DIR" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    proc = run_cli("fairseq-kd-seqkd", *args, "--output", tmp_path / "out", "--teacher-data", tiny_data_bin,
                   warm=True)
    assert (tmp_path / "out" / "dict.src.txt").is_file()


# --------------------------------------------------------------------------- best checkpoint


def _train_validated(data, teacher, save, criterion_args, max_update, extra=(), check=True):
    common = [a for a in COMMON_TRAIN_ARGS if a != "--disable-validation"]
    return run_cli("fairseq-train", data, "--user-dir", USER_DIR, "--task", "translation_kd",
                   "--teacher-checkpoint", teacher, *TINY_STUDENT_ARGS, *criterion_args, *common,
                   "--max-update", str(max_update), "--save-dir", save, *extra, check=check, warm=True)


def test_best_checkpoint_is_only_replaced_on_the_same_metric(tiny_data_bin, tiny_teacher, tmp_path):
    save = tmp_path / "s"
    first = _train_validated(tiny_data_bin, tiny_teacher, save, ["--criterion", "word_kd"], 2)
    assert "checkpoint_best.pt is selected by valid loss of criterion word_kd (lower is better)" in first.stdout
    best = save / "checkpoint_best.pt"
    before = _sha(best)
    recorded = torch.load(best, weights_only=False)["extra_state"]["TranslationKDTask"]["best_selection"]
    assert recorded == {"metric": "loss", "maximize": False, "criterion": "word_kd"}
    # another criterion, --reset-optimizer (fairseq forgets the best-so-far): refused, file kept
    proc = _train_validated(tiny_data_bin, tiny_teacher, save, ["--criterion", "selective_kd"], 3,
                            extra=["--reset-optimizer"], check=False)
    assert proc.returncode != 0
    for fragment in ("was selected by valid loss of criterion word_kd", "selects by valid loss of criterion "
                     "selective_kd", "mv ", "--best-checkpoint-metric nll_loss"):
        assert fragment in proc.stderr, proc.stderr[-3000:]
    assert _sha(best) == before
    # a metric that does not depend on the criterion: accepted, the old best's value carried over
    save2 = tmp_path / "s2"
    nll = ["--best-checkpoint-metric", "nll_loss"]
    _train_validated(tiny_data_bin, tiny_teacher, save2, ["--criterion", "word_kd"], 2, extra=nll)
    proc = _train_validated(tiny_data_bin, tiny_teacher, save2, ["--criterion", "selective_kd"], 3,
                            extra=[*nll, "--reset-optimizer"])
    assert "checkpoint_best.pt is selected by valid nll_loss (lower is better)" in proc.stdout
    assert "is replaced only by a better one" in proc.stdout


# --------------------------------------------------------------------------- A2D resume


def test_a2d_resume_with_other_options_names_them(tiny_data_bin, tiny_teacher, tmp_path):
    save = tmp_path / "a2d"
    train_student(tiny_data_bin, tiny_teacher, save, ["--criterion", "a2d_kd", "--a2d-normalization", "row"],
                  max_update=1)
    proc = train_student(tiny_data_bin, tiny_teacher, save, ["--criterion", "a2d_kd", "--a2d-granularity", "layer"],
                         max_update=2, refused=True)
    assert proc.returncode != 0
    assert "--a2d-normalization: 'row' in the checkpoint, 'mixture' in this run" in proc.stderr, proc.stderr[-3000:]
    assert "--a2d-granularity: 'head' in the checkpoint, 'layer' in this run" in proc.stderr
    assert "architectures match" not in proc.stderr


# --------------------------------------------------------------------------- one-line errors


@pytest.mark.parametrize("flags, fragment", [
    (["--fp16"], "--fp16: this machine has no GPU"),
    (["--fp16", "--cpu"], "--fp16 with --cpu"),
    (["--bf16"], "--bf16: this machine has no GPU"),  # --bf16 --cpu trains (tests/test_bf16.py)
])
def test_half_precision_without_gpu_is_refused_at_setup(tiny_data_bin, tiny_teacher, tmp_path, flags, fragment):
    if torch.cuda.is_available() and "--cpu" not in flags:
        pytest.skip("this machine has a GPU")
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path / "s", ["--criterion", "word_kd"], max_update=1,
                         extra=flags, refused=True)
    assert proc.returncode != 0 and fragment in proc.stderr and "--cpu" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "s" / "checkpoint_last.pt").exists()


def _user_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].split(": error: ", 1)[1]
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def _warm_module(module, *args):
    """``python -m module`` refused, in a child of the warm interpreter: the same command line and
    output without importing torch and fairseq once per call."""
    return run_module(module, *args, check=False, warm=True)


def test_command_line_tools_print_one_line_for_user_errors(tmp_path):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    good = tmp_path / "ref.txt"
    good.write_text("cafe\n")
    longer = tmp_path / "hyp2.txt"
    longer.write_text("a\nb\n")
    _user_error(_warm_module("fairseq_kd.cli.score", "--hyp", folder, "--ref", good), "is a folder")
    _user_error(_warm_module("fairseq_kd.cli.score", "--generate-output", folder), "is a folder")
    _user_error(_warm_module("fairseq_kd.cli.score", "--hyp", bad, "--ref", good), str(bad), "UTF-8")
    _user_error(_warm_module("fairseq_kd.cli.score", "--hyp", longer, "--ref", good), "2 lines", "1")
    _user_error(_warm_module("fairseq_kd.cli.report", "--system", f"a={folder}", "--system", f"b={good}"),
                "is a folder")
    _user_error(_warm_module("fairseq_kd.cli.report", "--system", f"a={bad}", "--system", f"b={bad}"),
                str(bad), "UTF-8")
    _user_error(_warm_module("fairseq_kd.cli.plot", "curves", "--log", folder, "--output", tmp_path / "c.png"),
                "is a folder")
    _user_error(run_cli_here("fairseq-kd-export", bad, tmp_path / "out.pt"))


def test_preparation_recipe_and_seqkd_print_one_line_for_user_errors(tmp_path):
    """The commands that prepare corpora, run recipes and decode for sequence-level KD refuse bad
    input like the other tools: ``PROG: error: MESSAGE`` naming the flag or file, status 2."""
    prepare = [sys.executable, str(REPO / "examples/translation/multi30k_fr_en/prepare.py")]

    def run(command):
        return subprocess.run([*map(str, command)], capture_output=True, text=True, env=QUIET_ENV, timeout=600)

    a_file = tmp_path / "a_file"
    a_file.write_text("x\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    _user_error(run([*prepare, "--archives", tmp_path / "missing", "--dest", tmp_path / "d1"]),
                "prepare.py: error:", "--archives", "missing")
    _user_error(run([*prepare, "--archives", empty, "--dest", tmp_path / "d2"]), "--archives", "missing from")
    _user_error(run([*prepare, "--archives", empty, "--dest", a_file]), "--dest", "not a directory")
    _user_error(_warm_module("fairseq_kd_recipes.recipe", "multi30k_fr_en", "--teacher", tmp_path / "none.pt"),
                "fairseq-kd-recipe: error:", "--teacher", "no such checkpoint file")
    _user_error(_warm_module("fairseq_kd_recipes.recipe", "multi30k_fr_en", "--archives", tmp_path / "missing"),
                "fairseq-kd-recipe: error:", "--archives")
    _user_error(run_cli_here("fairseq-kd-seqkd", "--data", tmp_path / "missing", "--teacher-checkpoint", a_file,
                             "--output", tmp_path / "out"), "fairseq-kd-seqkd: error:", "--data")


def test_flags_lists_the_plugin_flags():
    proc = run_module("fairseq_kd.cli.flags", "--criterion", "a2d_kd")
    for flag in ("--teacher-checkpoint", "--teacher-data", "--allow-teacher-change", "--a2d-normalization",
                 "--kd-temperature"):
        assert flag in proc.stdout
    # what fairseq-train --help cannot do (fairseq prints help before adding these flags)
    stock = subprocess.run([str(BIN / "fairseq-train"), "--help", "--user-dir", USER_DIR, "--task",
                            "translation_kd", "--criterion", "a2d_kd"], capture_output=True, text=True, env=QUIET_ENV)
    assert "--criterion" in stock.stdout and "--a2d-normalization" not in stock.stdout
    assert sys.executable


def test_fairseq_commands_print_the_plugins_user_errors_in_one_line(monkeypatch, capsys):
    """The excepthook the plugin installs under fairseq's commands: its user errors in one line,
    anything else (a ValueError raised inside another library, a programming error) with the
    hook that was there before, and nothing installed with FAIRSEQ_KD_TRACEBACK=1."""
    from fairseq_kd.cli import user_errors
    from fairseq_kd.teacher_pass.teacher_cache import TeacherCacheError

    assert user_errors.fairseq_command_name("/venv/bin/fairseq-train") == "fairseq-train"
    assert user_errors.fairseq_command_name("/x/fairseq_cli/hydra_train.py") == "fairseq-hydra-train"
    assert user_errors.fairseq_command_name("/venv/bin/fairseq-kd-seqkd") is None
    assert user_errors.fairseq_command_name("/venv/bin/pytest") is None
    seen = []
    monkeypatch.setattr("sys.excepthook", lambda *exc_info: seen.append(exc_info[1]))
    monkeypatch.setenv(user_errors.TRACEBACK_VARIABLE, "1")
    assert not user_errors.install_for_fairseq_command("/venv/bin/fairseq-train")
    monkeypatch.delenv(user_errors.TRACEBACK_VARIABLE)
    assert user_errors.install_for_fairseq_command("/venv/bin/fairseq-train")

    def raised(make):
        try:
            make()
        except Exception as error:  # noqa: BLE001
            return type(error), error, error.__traceback__

    ours = raised(lambda: (_ for _ in ()).throw(TeacherCacheError("--teacher-cache C: cache.json missing")))
    import sys
    sys.excepthook(*ours)
    assert capsys.readouterr().err == (
        "fairseq-train: error: --teacher-cache C: cache.json missing [FAIRSEQ_KD_TRACEBACK=1 shows the traceback]\n")
    theirs = raised(lambda: int("not a number"))  # a ValueError, raised outside the plugin's code
    bug = raised(lambda: [][1])
    sys.excepthook(*theirs)
    sys.excepthook(*bug)
    assert seen == [theirs[1], bug[1]] and capsys.readouterr().err == ""
