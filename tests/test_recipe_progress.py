"""The recipe's steps on a terminal: a training step shows a bar of its updates (rate, time left,
loss) read from fairseq-train's log lines, a child draws its own bars on the recipe's terminal,
and the libraries' INFO lines of in-process steps stay off it; every log file holds the step's
output and no bar (no carriage return). Without a terminal nothing is drawn anywhere."""
import fcntl
import io
import logging
import os
import pty
import re
import struct
import sys
import termios
import threading

import pytest

from conftest import COMMON_TRAIN_ARGS, TINY_STUDENT_ARGS, USER_DIR
from fairseq_kd_recipes.execute import CommandExecutor, TrainingProgress, logging_into

# tqdm's bar: "desc: 100%|#####| 6/6 [00:01<00:00, 4.20upd/s, epoch 2, loss 7.123]"
# tqdm's rate: "12.5upd/s", or "3.72s/upd" when an update takes longer than a second (a loaded machine)
BAR_PATTERN = re.compile(r"(\d+)/(\d+) \[[\d:]+<[\d:?]+, +[\d.?]+ ?(?:(\w+)/s|s/(\w+))")


def bars(text):
    """(done, total, unit) of every tqdm bar state drawn in ``text``."""
    return [(done, total, unit or slow_unit) for done, total, unit, slow_unit in BAR_PATTERN.findall(text)]


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def json_line(updates, epochs_done, loss, epoch=1):
    return (f'2024-05-01 10:00:01 | INFO | train_inner | {{"epoch": {epoch}, "update": {epochs_done}, '
            f'"loss": "{loss}", "nll_loss": "1.0", "num_updates": "{updates}", "lr": "0.001"}}\n')


def test_training_bar_counts_updates_of_max_update_with_the_loss(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    command = ["/env/bin/fairseq-train", "data", "--max-update", "300", "--log-format", "json"]
    with TrainingProgress.of(command, "train-word_kd") as training:
        for updates, loss in ((100, 9.1), (200, 8.7), (300, 8.3)):
            training.feed(json_line(updates, updates / 200, loss, epoch=1 + (updates > 200)))
        training.feed('2024-05-01 10:00:04 | INFO | valid | {"epoch": 2, "valid_loss": "8.2", "valid_nll_loss": '
                      '"8", "valid_num_updates": "300"}\n')
        training.feed("2024-05-01 10:00:05 | INFO | fairseq_cli.train | done training\n")
    shown = terminal.getvalue()
    assert "train-word_kd" in shown and bars(shown)[-1] == ("300", "300", "upd"), shown
    assert "epoch 2, loss 8.300, valid_nll 8.000" in shown, shown
    assert TrainingProgress.of(["/env/bin/fairseq-generate", "data"], "generate") is None


def test_training_bar_estimates_the_updates_of_max_epoch(monkeypatch):
    """fairseq says how far into its epochs it is (the fractional 'update'): 100 updates at 0.25
    epoch make 1,600 updates for 4 epochs; --max-update caps the estimate."""
    monkeypatch.setattr("sys.stderr", FakeTerminal())
    training = TrainingProgress.of([sys.executable, "-m", "fairseq_cli.train", "d", "--max-epoch", "4"], "t")
    assert training.total(100, 0.25) == 1600 and training.total(100, None) is None
    capped = TrainingProgress.of(["fairseq-train", "d", "--max-epoch", "4", "--max-update", "1000"], "t")
    assert capped.total(100, 0.25) == 1000
    with training:
        training.feed(json_line(100, 0.25, 5.0))
        assert (training.bar.n, training.bar.total) == (100, 1600)


def test_in_process_steps_keep_library_lines_in_their_log_not_on_the_terminal(tmp_path):
    """A library's basicConfig (fairseq's) put a handler on the root logger writing to the
    terminal; during an in-process step (a command run in-process, or a step's action) its INFO
    lines (sacreBLEU's, fairseq's) go to the step's log only, the plugin's own progress to both."""
    from types import SimpleNamespace

    from fairseq_kd_recipes.execute import _as_step

    terminal, log = FakeTerminal(), io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers = [logging.StreamHandler(terminal)]
    root.setLevel(logging.DEBUG)
    plugin = logging.getLogger("fairseq_kd")
    plugin_handler = logging.StreamHandler(terminal)
    plugin.addHandler(plugin_handler)
    plugin.propagate, plugin_level = False, plugin.level
    plugin.setLevel(logging.INFO)
    try:
        with logging_into(log):
            logging.getLogger("sacrebleu").info("Pre-computing BLEU statistics")
            logging.getLogger("matplotlib.font_manager").debug("findfont: scores")
            logging.getLogger("fairseq_kd.cli.score").info("scored 40 sentences")
        logging.getLogger("sacrebleu").info("after the step")
        action = SimpleNamespace(name="systems", commands=[], inputs=[], outputs=[], settings={},
                                 log=tmp_path / "logs" / "systems.log",
                                 action=lambda: logging.getLogger("fairseq.tasks.translation").info("[fr] dictionary"))
        _as_step(action, execute=None).action()
    finally:
        root.handlers, _ = saved[0], root.setLevel(saved[1])
        plugin.removeHandler(plugin_handler)
        plugin.propagate = True
        plugin.setLevel(plugin_level)
    assert "INFO | sacrebleu | Pre-computing BLEU statistics" in log.getvalue()
    assert "scored 40 sentences" in log.getvalue() and "findfont" not in log.getvalue()
    assert "Pre-computing" not in terminal.getvalue()
    assert "scored 40 sentences" in terminal.getvalue() and "after the step" in terminal.getvalue()
    assert "INFO | fairseq.tasks.translation | [fr] dictionary" in (tmp_path / "logs" / "systems.log").read_text()
    assert "dictionary" not in terminal.getvalue()


# ----------------------------------------------------------------------- a real terminal


@pytest.fixture()
def pseudo_terminal():
    """(a pseudo-terminal of 120 columns (tqdm sizes its bar to it), a function returning
    everything written to it so far). The test makes it stderr: pytest sets its own capture at
    the start of the test's call, after the fixtures."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    terminal = os.fdopen(secondary, "w", buffering=1)
    chunks = []

    def drain():
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the other end closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()

    def written():
        terminal.flush()
        return b"".join(chunks).decode(errors="replace")

    yield terminal, written
    terminal.close()
    reader.join(timeout=10)
    os.close(main)


CHILD_WITH_A_BAR = ("import time; from fairseq_kd.progress import progress_bar\n"
                    "print('preparing', flush=True)\n"
                    "with progress_bar(total=5, desc='child bar', unit='file') as bar:\n"
                    "    for _ in range(5):\n"
                    "        time.sleep(0.05); bar.update(1)\n"
                    "print('prepared', flush=True)\n")


def _train_command(data, teacher, save_dir):
    return [os.path.join(os.path.dirname(sys.executable), "fairseq-train"), str(data), "--user-dir", USER_DIR,
            "--task", "translation_kd", "--teacher-checkpoint", str(teacher), *TINY_STUDENT_ARGS,
            "--criterion", "word_kd", *[a for a in COMMON_TRAIN_ARGS if a not in ("--log-format", "simple")],
            "--log-format", "json", "--max-update", "6", "--save-dir", str(save_dir)]


def _steps(tiny_data_bin, tiny_teacher, tmp_path, name):
    executor = CommandExecutor()
    executor([sys.executable, "-c", CHILD_WITH_A_BAR], tmp_path / name / "prepare.log")
    executor(_train_command(tiny_data_bin, tiny_teacher, tmp_path / name / "ckpt"), tmp_path / name / "train-x.log")
    return [(tmp_path / name / log).read_text() for log in ("prepare.log", "train-x.log")]


def test_a_recipes_steps_on_a_terminal_and_in_a_log(tiny_data_bin, tiny_teacher, tmp_path, pseudo_terminal, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    terminal, written = pseudo_terminal
    # the terminal as descriptor 2, as a recipe started from a shell has it: a child's own 2 is its log
    saved = os.dup(2)
    os.dup2(terminal.fileno(), 2)
    try:
        monkeypatch.setattr("sys.stderr", os.fdopen(2, "w", buffering=1, closefd=False))
        shown_logs = _steps(tiny_data_bin, tiny_teacher, tmp_path, "terminal")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    shown = written()
    assert "child bar" in shown and ("5", "5", "file") in bars(shown), shown[-3000:]
    updates = [(done, total) for done, total, unit in bars(shown) if unit == "upd"]
    assert updates and updates[-1] == ("6", "6") and "train-x" in shown and "loss " in shown, shown[-3000:]
    assert "num_updates" not in shown  # fairseq's own lines stay in the log

    monkeypatch.setattr("sys.stderr", io.StringIO())  # no terminal: the children write to their logs
    quiet_logs = _steps(tiny_data_bin, tiny_teacher, tmp_path, "log")
    for prepare_log, train_log in (shown_logs, quiet_logs):
        assert "preparing" in prepare_log and "prepared" in prepare_log
        assert "child bar:" not in prepare_log and "5/5" not in prepare_log
        assert '"num_updates": "6"' in train_log and "done training" in train_log
        assert "\r" not in prepare_log + train_log
