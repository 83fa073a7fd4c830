"""The output folder of fairseq-kd-export --format ctranslate2/hf (fairseq_kd.deploy.model_folder):
``--overwrite`` replaces only a folder that is wholly an unchanged earlier export of the same format
(every file in it listed in its record with that size and SHA-256), never a symbolic link nor
anything a link points to, and leaves nothing behind; anything else is refused in one line naming
the folder and what is in the way, with nothing touched. The folders are built by hand here;
tests/test_ctranslate2_export.py and tests/test_hf_export.py run the same through the command."""
import json
import os

import pytest

from fairseq_kd.deploy.model_folder import ExportFolder, file_inventory

RECORD, FORMAT = "fairseq_kd_export.json", "fairseq-kd-test/1"


class Refused(ValueError):
    pass


def make_export(folder, files=None, record_format=FORMAT):
    """A folder as an export of ``record_format`` writes it: its files, then a record listing them."""
    folder.mkdir(parents=True)
    for name, data in (files or {"model.bin": b"weights", "config.json": b"{}"}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / RECORD).write_text(json.dumps({"format": record_format, "files": file_inventory(folder, RECORD)}))
    return folder


def output(path, overwrite=True):
    return ExportFolder(str(path.parent / "checkpoint.pt"), str(path), overwrite, kind="test", record_name=RECORD,
                        record_format=FORMAT, error=Refused)


def export(path, overwrite=True, during=None):
    """What an export does with its output folder: check, write into the staging folder (running
    ``during`` there, as if the user acted while the export works), record, rename."""
    out = output(path, overwrite)
    out.check()
    with out.staged() as staging:
        staging.mkdir()
        (staging / "model.bin").write_bytes(b"new weights")
        (staging / RECORD).write_text(json.dumps({"format": FORMAT, "files": file_inventory(staging, RECORD)}))
        if during is not None:
            during()
    return path


def snapshot(root):
    """Every entry under ``root`` (links not followed): {relative path: bytes, link target or 'dir'}."""
    entries = {}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = os.path.join(folder, name)
            key = os.path.relpath(path, root)
            if os.path.islink(path):
                entries[key] = "link -> " + os.readlink(path)
            elif os.path.isdir(path):
                entries[key] = "dir"
            elif not os.path.isfile(path):
                entries[key] = "special"
            else:
                with open(path, "rb") as file:
                    entries[key] = file.read()
    return entries


def refused_untouched(path, tmp_path, *expected, overwrite=True, during=None):
    """The export into ``path`` is refused in one line naming the folder and ``expected``, and every
    file under tmp_path is as it was (nothing touched, nothing left)."""
    before = snapshot(tmp_path)
    with pytest.raises(Refused) as refusal:
        export(path, overwrite, during)
    message = str(refusal.value)
    assert "\n" not in message and repr(str(path)) in message, message
    assert all(fragment in message for fragment in expected), message
    after = snapshot(tmp_path)
    if during is None:
        assert after == before
    return message, after


def test_an_unchanged_earlier_export_is_replaced_whole_leaving_nothing(tmp_path):
    make_export(tmp_path / "m", {"model.bin": b"old", "config.json": b"{}", "vocab/shared.json": b"[]"})
    export(tmp_path / "m")
    assert sorted(snapshot(tmp_path)) == ["m", f"m{os.sep}{RECORD}", f"m{os.sep}model.bin"]
    assert (tmp_path / "m" / "model.bin").read_bytes() == b"new weights"
    export(tmp_path / "m")  # the new export is an earlier export in turn
    export(tmp_path / "fresh", overwrite=False)
    (tmp_path / "empty").mkdir()
    export(tmp_path / "empty", overwrite=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _user_file(folder):
    (folder / "results.txt").write_text("precious\n")


def _user_folder(folder):
    (folder / "runs").mkdir()
    (folder / "runs" / "log.txt").write_text("x\n")


def _edited(folder):
    (folder / "model.bin").write_bytes(b"WEIGHTS")  # same size, other bytes


def _truncated(folder):
    (folder / "model.bin").write_bytes(b"wei")


def _link_inside(folder):
    (folder.parent / "mine.txt").write_text("mine\n")
    os.symlink(folder.parent / "mine.txt", folder / "notes.txt")


def _linked_model(folder):
    (folder.parent / "mine.bin").write_bytes(b"weights")  # what the record lists, through a link
    (folder / "model.bin").unlink()
    os.symlink(folder.parent / "mine.bin", folder / "model.bin")


def _fifo_inside(folder):
    os.mkfifo(folder / "pipe")  # never opened: hashing it would wait for a writer


def _empty_folder(folder):
    (folder / "runs").mkdir()


def _other_format(folder):
    (folder / RECORD).write_text(json.dumps({"format": "fairseq-kd-hf/1", "files": file_inventory(folder, RECORD)}))


def _no_file_list(folder):
    (folder / RECORD).write_text(json.dumps({"format": FORMAT}))


def _record_not_json(folder):
    (folder / RECORD).write_bytes(b"\x00\xff")


def _no_record(folder):
    (folder / RECORD).unlink()


def _user_file_in_the_record_with_its_own_size(folder):
    (folder / "results.txt").write_text("precious\n")
    record = json.loads((folder / RECORD).read_text())
    record["files"]["results.txt"] = {"bytes": 9, "sha256": "0" * 64}
    (folder / RECORD).write_text(json.dumps(record))


@pytest.mark.parametrize("change, named", [
    (_user_file, "'results.txt'"), (_user_folder, "'runs'"), (_edited, "'model.bin'"), (_truncated, "'model.bin'"),
    (_link_inside, "'notes.txt', a symbolic link"), (_fifo_inside, "'pipe', which is not a regular file"), (_linked_model, "'model.bin', a symbolic link"),
    (_empty_folder, "'runs'"), (_other_format, "fairseq-kd-hf/1"), (_no_file_list, "lists no files"),
    (_record_not_json, "damaged record"), (_no_record, f"no {RECORD}"),
    (_user_file_in_the_record_with_its_own_size, "'results.txt'"),
])
def test_overwrite_refuses_a_folder_that_is_not_wholly_an_unchanged_export(tmp_path, change, named):
    folder = make_export(tmp_path / "m")
    change(folder)
    refused_untouched(folder, tmp_path, named, "--overwrite replaces only")


def test_the_issues_folders_are_refused_untouched(tmp_path):
    """Issue 41: a folder holding a file named model.bin (no record) and a user's files beside it."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.bin").write_text("notes\n")
    _user_file(folder)
    _user_folder(folder)
    refused_untouched(folder, tmp_path, f"no {RECORD}")
    refused_untouched(folder, tmp_path, "already exists", overwrite=False)


@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("target", ["export", "empty", "missing"])
def test_an_output_that_is_a_symbolic_link_is_refused_and_the_link_kept(tmp_path, overwrite, target):
    if target == "export":
        make_export(tmp_path / "real")
    elif target == "empty":
        (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    refused_untouched(tmp_path / "link", tmp_path, "symbolic link", overwrite=overwrite)


def test_without_overwrite_a_non_empty_folder_is_refused(tmp_path):
    make_export(tmp_path / "m")
    refused_untouched(tmp_path / "m", tmp_path, "already exists and is not empty", "--overwrite", overwrite=False)


def test_a_file_written_into_the_output_during_the_export_is_kept(tmp_path):
    """The output is checked again when the export is done (moved aside under a name of its own, so
    nothing written to it after that is lost): a file the user put there meanwhile stops the
    replacement, and the folder is put back as it is."""
    folder = make_export(tmp_path / "m")
    _, after = refused_untouched(folder, tmp_path, "'results.txt'", during=lambda: _user_file(folder))
    assert (folder / "results.txt").read_text() == "precious\n"
    assert (folder / "model.bin").read_bytes() == b"weights"
    assert sorted(after) == sorted(["m", *(os.path.join("m", name) for name in ("model.bin", "config.json",
                                                                                  RECORD, "results.txt"))])


def test_an_output_made_a_link_during_the_export_is_kept(tmp_path):
    (tmp_path / "real").mkdir()

    def link():
        os.symlink(tmp_path / "real", tmp_path / "m")

    _, after = refused_untouched(tmp_path / "m", tmp_path, "symbolic link", during=link)
    assert after == {"real": "dir", "m": "link -> " + str(tmp_path / "real")}


def test_a_failed_export_leaves_nothing_not_even_the_folders_it_made(tmp_path):
    out = output(tmp_path / "a" / "b" / "m")
    out.check()
    with pytest.raises(RuntimeError):
        with out.staged() as staging:
            staging.mkdir()
            (staging / "model.bin").write_bytes(b"half")
            raise RuntimeError("the export failed")
    assert list(tmp_path.iterdir()) == []
    make_export(tmp_path / "m")
    before = snapshot(tmp_path)
    with pytest.raises(RuntimeError):
        with output(tmp_path / "m").staged() as staging:
            staging.mkdir()
            raise RuntimeError("the export failed")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", [".", "..", "m/.."])
def test_an_output_named_dot_is_refused(tmp_path, monkeypatch, name):
    make_export(tmp_path / "m" / "m")
    monkeypatch.chdir(tmp_path / "m")
    before = snapshot(tmp_path)
    out = ExportFolder(str(tmp_path / "checkpoint.pt"), name, True, kind="test", record_name=RECORD,
                       record_format=FORMAT, error=Refused)
    with pytest.raises(Refused, match="give the folder by its name"):
        out.check()
    assert snapshot(tmp_path) == before
