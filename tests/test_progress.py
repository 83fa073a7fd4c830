"""Progress bars of the long commands: count, rate and time left on stderr when it is a terminal,
nothing at all when it is not (a log file, a pipe, CI)."""
import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import termios

import pytest
from conftest import BIN, QUIET_ENV

from fairseq_kd.progress import print_above_bars, progress_bar

# tqdm's bar: "desc:  50%|#####     | 200/400 [00:01<00:01, 150.2sent/s]" (elapsed<left, rate)
BAR = re.compile(r"(\d+)/(\d+) \[[\d:]+<[\d:?]+, +[\d.?]+ ?(\w+)/s")
DECODE_FLAGS = ["--max-len-a", "1.2", "--max-len-b", "10", "--max-tokens", "4096", "--shard-size", "64"]


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_bar_shows_count_rate_and_time_left_on_a_terminal():
    terminal = FakeTerminal()
    with progress_bar(total=3, desc="decoding", unit="sent", stream=terminal) as bar:
        for _ in range(3):
            bar.update(1)
    matches = BAR.findall(terminal.getvalue())
    assert matches and matches[-1] == ("3", "3", "sent"), terminal.getvalue()
    assert "decoding" in terminal.getvalue()


def test_bar_prints_nothing_when_the_stream_is_not_a_terminal(capsys):
    not_terminal = io.StringIO()
    with progress_bar(total=3, desc="decoding", unit="sent", stream=not_terminal) as bar:
        bar.update(3)
    assert not_terminal.getvalue() == ""
    with progress_bar(total=3, desc="decoding") as bar:  # default stream: stderr (captured: no tty)
        bar.update(3)
    print_above_bars(print)("a line")
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == "a line\n"


def _seqkd_command(data, teacher, output):
    return [str(BIN / "fairseq-kd-seqkd"), "--data", str(data), "--teacher-checkpoint", str(teacher),
            "--output", str(output), *DECODE_FLAGS]


def test_seqkd_prints_no_bar_when_stderr_is_not_a_terminal(tiny_data_bin, tiny_teacher, tmp_path):
    proc = subprocess.run(_seqkd_command(tiny_data_bin, tiny_teacher, tmp_path / "out"),
                          capture_output=True, text=True, env=QUIET_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "seq-KD decoding" not in proc.stderr and not BAR.search(proc.stderr), proc.stderr[-2000:]
    assert "\r" not in proc.stderr + proc.stdout
    assert "shard 7/7: 16 sentences" in proc.stdout  # the per-shard lines stay on stdout


def test_seqkd_shows_per_sentence_progress_on_a_terminal(tiny_data_bin, tiny_teacher, tmp_path):
    """stderr is a pseudo-terminal: the bar counts sentences within and across shards."""
    main, secondary = pty.openpty()
    # a fresh pseudo-terminal is 0 columns wide; tqdm sizes its bar to the terminal
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        proc = subprocess.Popen(_seqkd_command(tiny_data_bin, tiny_teacher, tmp_path / "out"),
                                stdout=subprocess.PIPE, stderr=secondary, env=QUIET_ENV)
        os.close(secondary)
        chunks = []
        while True:
            ready, _, _ = select.select([main], [], [], 600)
            if not ready:
                proc.kill()
                pytest.fail("fairseq-kd-seqkd wrote nothing for 600 s")
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's other end closed: the process has exited
                break
            if not chunk:
                break
            chunks.append(chunk)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        os.close(main)
    assert proc.returncode == 0
    terminal = b"".join(chunks).decode(errors="replace")
    counts = [(int(done), int(total)) for done, total, unit in BAR.findall(terminal) if unit == "sent"]
    assert counts and counts[-1] == (400, 400), terminal[-2000:]
    assert "seq-KD decoding" in terminal
    assert b"wrote 400 sentence pairs" in stdout


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_benchmark_counts_its_training_runs(monkeypatch, capsys, terminal):
    """The benchmark's bar counts child training runs; the measurement itself is stubbed out."""
    from fairseq_kd_recipes import benchmark

    monkeypatch.setattr(benchmark, "prepare_config", lambda name, workdir: {})
    monkeypatch.setattr(benchmark, "training_flags", lambda name, paths, method, precision="fp32": [method])
    monkeypatch.setattr(benchmark, "_train_in_child",
                        lambda flags, steps, warmup, teacher_forward=False, epoch=1, top_ops=0, paired_limit=None,
                        shuffle_seed=None:
                        {"step_ms": 10.0, "peak_mb": 1.0})
    monkeypatch.setattr(benchmark, "measure_decoding", lambda *args, **kwargs: {})
    monkeypatch.setattr(benchmark, "config_shapes", lambda name, paths: {})
    stderr = FakeTerminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    report = benchmark.run(["tiny"], ["plain", "word_kd"], steps=1, warmup=0, repeats=2, workdir=None)
    assert report["tiny"]["methods"]["word_kd"]["time_ratio"] == 1.0
    assert capsys.readouterr().out.count("ms/step") == 4
    if terminal:
        assert BAR.findall(stderr.getvalue())[-1] == ("4", "4", "run")
    else:
        assert stderr.getvalue() == ""
