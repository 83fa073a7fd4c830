"""fairseq-kd-export --format fairseq (fairseq_kd.deploy.export_fairseq) writes its one file through
a temporary file of this process beside it: a user's ``OUTPUT.tmp`` is never touched, a symbolic
link given as the output is refused in one line (never written through nor replaced, as the
folder exports do), and a failed export leaves nothing behind: no temporary file, no output, no
folder made for it."""
import os

import pytest

from conftest import run_cli_here
from fairseq_kd.deploy import export_fairseq
from fairseq_kd.deploy.export_fairseq import ExportError, export_student


def _entries(root):
    return sorted(os.path.relpath(os.path.join(folder, name), root)
                  for folder, folders, files in os.walk(root) for name in folders + files)


def test_a_users_tmp_file_is_untouched_and_nothing_else_is_left(tiny_teacher, tmp_path):
    out = tmp_path / "student.pt"
    users = tmp_path / "student.pt.tmp"
    users.write_text("my notes\n")
    export_student(str(tiny_teacher), str(out))
    assert users.read_text() == "my notes\n"
    export_student(str(tiny_teacher), str(out), overwrite=True)
    assert users.read_text() == "my notes\n"
    assert _entries(tmp_path) == ["student.pt", "student.pt.tmp"]


def test_a_link_output_is_refused_in_one_line_and_nothing_is_touched(tiny_teacher, tmp_path):
    target = tmp_path / "elsewhere.pt"
    target.write_text("not a checkpoint\n")
    link = tmp_path / "student.pt"
    link.symlink_to(target)
    for overwrite in ((), ("--overwrite",)):
        proc = run_cli_here("fairseq-kd-export", tiny_teacher, link, *overwrite)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("fairseq-kd-export: error: ") and "is a symbolic link" in last, last
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert target.read_text() == "not a checkpoint\n"
    assert _entries(tmp_path) == ["elsewhere.pt", "student.pt"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failed_export_leaves_nothing_behind(tiny_teacher, tmp_path, monkeypatch, overwrite):
    def fail(path, *args, **kwargs):
        raise ExportError("the safe load refused it (simulated)")

    monkeypatch.setattr(export_fairseq, "safe_load", fail)
    out = tmp_path / "made" / "for" / "student.pt"
    if overwrite:
        out.parent.mkdir(parents=True)
        out.write_text("an earlier export\n")
    with pytest.raises(ExportError, match="simulated"):
        export_student(str(tiny_teacher), str(out), overwrite=overwrite)
    if overwrite:
        assert out.read_text() == "an earlier export\n"
        assert _entries(tmp_path) == ["made", "made/for", "made/for/student.pt"]
    else:
        assert _entries(tmp_path) == []


def test_an_output_folder_that_cannot_be_written_is_one_line(tiny_teacher, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        proc = run_cli_here("fairseq-kd-export", tiny_teacher, folder / "student.pt")
    finally:
        folder.chmod(0o700)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert _entries(folder) == []
