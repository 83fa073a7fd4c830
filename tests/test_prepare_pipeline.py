"""The step runner (skip finished steps, re-run on changed inputs/params/outputs), archive
extraction, and the order-preserving parallel line mapping."""
from __future__ import annotations

import gzip
import io
import os
import tarfile
import zipfile

import pytest

from fairseq_kd_recipes.prepare.archive import extract, find_file
from fairseq_kd_recipes.prepare.errors import PrepareError
from fairseq_kd_recipes.prepare.parallel import map_lines
from fairseq_kd_recipes.prepare.pipeline import Step, StepRunner


class _Upper:
    """A step action that upper-cases a file and counts its calls."""

    def __init__(self, source, destination):
        self.source, self.destination, self.calls = source, destination, 0

    def __call__(self):
        self.calls += 1
        self.destination.write_text(self.source.read_text().upper())


def _chain(tmp_path):
    source = tmp_path / "a.txt"
    source.write_text("hello\n")
    middle, final = tmp_path / "b.txt", tmp_path / "c.txt"
    first, second = _Upper(source, middle), _Upper(middle, final)
    steps = lambda params=None: [  # noqa: E731
        Step("first", first, inputs=[source], outputs=[middle], params=params or {"n": 1}),
        Step("second", second, inputs=[middle], outputs=[final]),
    ]
    return source, middle, final, first, second, steps


def _run_all(tmp_path, steps, force=False):
    runner = StepRunner(tmp_path / "stamps", force=force)
    for step in steps:
        runner.run(step)
    return runner


def test_finished_steps_are_skipped_on_rerun(tmp_path):
    source, middle, final, first, second, steps = _chain(tmp_path)
    assert _run_all(tmp_path, steps()).executed == ["first", "second"]
    assert final.read_text() == "HELLO\n"
    runner = _run_all(tmp_path, steps())
    assert runner.executed == [] and runner.skipped == ["first", "second"]
    assert (first.calls, second.calls) == (1, 1)


def test_touched_but_unchanged_input_is_still_done(tmp_path):
    source, middle, final, first, second, steps = _chain(tmp_path)
    _run_all(tmp_path, steps())
    os.utime(source, ns=(10**9, 10**9))  # new mtime, same bytes: the checksum decides
    assert _run_all(tmp_path, steps()).executed == []


def test_changed_input_reruns_the_step_and_its_dependants(tmp_path):
    source, middle, final, first, second, steps = _chain(tmp_path)
    _run_all(tmp_path, steps())
    source.write_text("changed\n")
    assert _run_all(tmp_path, steps()).executed == ["first", "second"]
    assert final.read_text() == "CHANGED\n"


def test_changed_params_rerun(tmp_path):
    *_, first, second, steps = _chain(tmp_path)
    _run_all(tmp_path, steps())
    runner = _run_all(tmp_path, steps({"n": 2}))
    # The output of "first" is byte-identical, so "second" stays done.
    assert runner.executed == ["first"] and runner.skipped == ["second"]


def test_deleted_or_edited_output_reruns(tmp_path):
    source, middle, final, first, second, steps = _chain(tmp_path)
    _run_all(tmp_path, steps())
    final.unlink()
    assert _run_all(tmp_path, steps()).executed == ["second"]
    final.write_text("edited by hand\n")
    assert _run_all(tmp_path, steps()).executed == ["second"]
    assert final.read_text() == "HELLO\n"


def test_failed_step_leaves_no_stamp(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("x")
    output = tmp_path / "out.txt"

    def fail():
        output.write_text("half")
        raise KeyboardInterrupt

    runner = StepRunner(tmp_path / "stamps")
    with pytest.raises(KeyboardInterrupt):
        runner.run(Step("s", fail, inputs=[source], outputs=[output]))
    assert not runner.stamp_path("s").exists()
    done = _Upper(source, output)
    assert runner.run(Step("s", done, inputs=[source], outputs=[output])) is True


def test_force_reruns_everything(tmp_path):
    *_, steps = _chain(tmp_path)
    _run_all(tmp_path, steps())
    assert _run_all(tmp_path, steps(), force=True).executed == ["first", "second"]


def test_missing_input_and_missing_output_are_errors(tmp_path):
    runner = StepRunner(tmp_path / "stamps")
    with pytest.raises(PrepareError, match="input file.*nowhere.txt"):
        runner.run(Step("s", lambda: None, inputs=[tmp_path / "nowhere.txt"]))
    with pytest.raises(PrepareError, match="without writing.*never.txt"):
        runner.run(Step("t", lambda: None, outputs=[tmp_path / "never.txt"]))


def test_folder_outputs_are_fingerprinted(tmp_path):
    folder = tmp_path / "out"

    def make():
        folder.mkdir(exist_ok=True)
        (folder / "x").write_text("1")

    runner = StepRunner(tmp_path / "stamps")
    runner.run(Step("dir", make, outputs=[folder]))
    assert runner.run(Step("dir", make, outputs=[folder])) is False
    (folder / "extra").write_text("2")
    assert runner.run(Step("dir", make, outputs=[folder])) is True


# ----------------------------------------------------------------------------- archives
def _tar_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_tgz_extraction_and_find_file(tmp_path):
    archive = tmp_path / "c.tgz"
    archive.write_bytes(_tar_bytes({"training/europarl.de": b"Hallo\n", "training/europarl.en": b"Hello\n", "README": b"r"}))
    folder = extract(archive, tmp_path / "out")
    assert find_file(folder, "europarl.de", "c.tgz").read_text() == "Hallo\n"
    with pytest.raises(PrepareError, match=r"c.tgz holds no file named news.de \(it holds: README, training/europarl.de"):
        find_file(folder, "news.de", "c.tgz")
    assert not (tmp_path / "out.partial").exists()


def test_find_file_refuses_ambiguity(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "x.txt").write_text(sub)
    with pytest.raises(PrepareError, match="several files named x.txt"):
        find_file(tmp_path, "x.txt", "archive")


def test_truncated_tgz_is_a_clear_error(tmp_path):
    data = _tar_bytes({"big.txt": os.urandom(200_000)})
    archive = tmp_path / "broken.tgz"
    archive.write_bytes(data[: len(data) // 2])
    with pytest.raises(PrepareError, match=r"broken.tgz is truncated or corrupt"):
        extract(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_tar_member_outside_the_folder_is_refused(tmp_path):
    archive = tmp_path / "evil.tgz"
    archive.write_bytes(_tar_bytes({"../evil.txt": b"x"}))
    with pytest.raises(PrepareError, match="unsafe member"):
        extract(archive, tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists()


def test_tar_extraction_without_extraction_filters_is_refused(tmp_path, monkeypatch):
    """A Python released before tarfile's filters (3.8.16, 3.9.16...) says which it needs and
    extracts nothing."""
    archive = tmp_path / "c.tgz"
    archive.write_bytes(_tar_bytes({"a.txt": b"a"}))
    monkeypatch.delattr(tarfile, "data_filter")
    with pytest.raises(PrepareError, match=r"c.tgz: .* no tar extraction filters.* Python >= 3.8.17"):
        extract(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_zip_and_gz_extraction(tmp_path):
    archive = tmp_path / "en-zh.zip"
    with zipfile.ZipFile(archive, "w") as package:
        package.writestr("en-zh/train.tags.en-zh.en", "Hello\n")
    assert (extract(archive, tmp_path / "z") / "en-zh" / "train.tags.en-zh.en").read_text() == "Hello\n"
    single = tmp_path / "train.dsb.gz"
    single.write_bytes(gzip.compress("Dobry źeń\n".encode()))
    assert (extract(single, tmp_path / "g") / "train.dsb").read_text(encoding="utf-8") == "Dobry źeń\n"


def test_corrupt_zip_and_gz_are_clear_errors(tmp_path):
    archive = tmp_path / "bad.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as package:
        package.writestr("a.txt", "a" * 10000 + "b" * 10000)
    data = bytearray(archive.read_bytes())
    data[60] ^= 0xFF  # inside the compressed member
    archive.write_bytes(bytes(data))
    with pytest.raises(PrepareError, match="bad.zip is truncated or corrupt"):
        extract(archive, tmp_path / "z")
    single = tmp_path / "x.gz"
    single.write_bytes(gzip.compress(b"hello world" * 1000)[:-8])  # CRC/size trailer cut off
    with pytest.raises(PrepareError, match="x.gz is truncated or corrupt"):
        extract(single, tmp_path / "g")


# ----------------------------------------------------------------------------- parallel map
class _ReverseWithPid:
    def __call__(self, line):
        return f"{os.getpid()}:{line[::-1]}"


def test_map_lines_keeps_order_across_workers():
    lines = [f"line {i}" for i in range(5003)]
    results = list(map_lines(iter(lines), _ReverseWithPid, workers=2, chunk_size=97))
    assert [r.split(":", 1)[1] for r in results] == [line[::-1] for line in lines]
    assert all(r.split(":", 1)[0] != str(os.getpid()) for r in results)  # done in worker processes
    serial = list(map_lines(lines, _ReverseWithPid, workers=1))
    assert serial == [f"{os.getpid()}:{line[::-1]}" for line in lines]
