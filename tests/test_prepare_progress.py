"""Preparation's bars (learning BPE merges, segmenting and tokenising lines) on a terminal only:
nothing reaches stderr when it is a log file, subword-nmt's own bar included (it wrote carriage
returns into the recipe's prepare.log)."""
import io
import re

from fairseq_kd_recipes.prepare.bpe import apply_bpe_file, learn_joint_bpe
from fairseq_kd_recipes.prepare.textio import iter_lines

# tqdm's bar: "desc: 100%|#####| 40/40 [00:01<00:00, 150.2merge/s]" (elapsed<left, rate)
BAR = r"(\d+)/(\d+) \[[\d:]+<[\d:?]+, +[\d.?]+ ?{unit}/s\]"


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def corpus(folder, lines=300):
    """Lines of made-up words (enough distinct letter pairs for a few hundred merges)."""
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 9))) for _ in range(200)]
    path = folder / "train.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(lines))
                    + "\n")
    return path


def test_learning_bpe_shows_our_bar_on_a_terminal_and_nothing_in_a_log(tmp_path, monkeypatch):
    train = corpus(tmp_path)
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    learn_joint_bpe([train], tmp_path / "codes.log", merges=40, min_frequency=1)
    assert log.getvalue() == ""  # subword-nmt's tqdm wrote "\r  0%|..." here
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    learn_joint_bpe([train], tmp_path / "codes", merges=40, min_frequency=1)
    shown = terminal.getvalue()
    assert "learn BPE merges" in shown and re.findall(BAR.format(unit="merge"), shown)[-1] == ("40", "40"), shown
    assert (tmp_path / "codes").read_text() == (tmp_path / "codes.log").read_text()


def test_segmenting_counts_lines_with_time_left_on_a_terminal_only(tmp_path, monkeypatch):
    train = corpus(tmp_path, lines=3000)
    learn_joint_bpe([train], tmp_path / "codes", merges=20, min_frequency=1)
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    assert apply_bpe_file(tmp_path / "codes", train, tmp_path / "quiet.bpe") == 3000
    assert log.getvalue() == ""
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert apply_bpe_file(tmp_path / "codes", train, tmp_path / "shown.bpe") == 3000
    shown = terminal.getvalue()
    # the total, counted first (in thousands); the finished bar is cleared (a bar per file)
    assert re.search(r"apply BPE train\.txt: +0%\|.*\| 0\.00/3\.00k \[00:00<\?, \?line/s\]", shown), shown
    assert (tmp_path / "shown.bpe").read_text() == (tmp_path / "quiet.bpe").read_text()


def test_reading_lines_shows_rate_and_time_left(tmp_path, monkeypatch):
    import time

    from fairseq_kd_recipes.prepare import textio

    train = corpus(tmp_path, lines=3000)
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(textio, "BAR_STEP", 1)
    lines = []
    for line in iter_lines(train, progress="tokenize train.txt"):
        if len(lines) < 3:
            time.sleep(0.3)  # the bar redraws every 0.5 s
        lines.append(line)
    assert lines == list(iter_lines(train))
    shown = terminal.getvalue()
    assert re.search(r"tokenize train\.txt: +0%\|.*\| [12]\.00/3\.00k \[[\d:]+<[\d:]+, +[\d.]+line/s\]", shown), shown
