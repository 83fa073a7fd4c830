"""fairseq-kd-average: the element-wise mean of the last N checkpoints of a real fairseq-train run,
checked against the mean computed here from the checkpoint files, then decoded by fairseq-generate
and used as a teacher; bad requests refused before anything is written."""
import torch

from conftest import COMMON_TRAIN_ARGS, TINY_STUDENT_ARGS, USER_DIR, run_cli, run_module

EPOCH_ARGS = [arg for arg in COMMON_TRAIN_ARGS if arg != "--no-epoch-checkpoints"]


def load(path):
    """Plain data and fairseq's argparse.Namespace only (the plugin's loader, weights_only=True)."""
    from fairseq_kd.checkpoints import safe_load

    return safe_load(path)


def test_average_of_the_last_epochs_is_their_mean_and_decodes(tiny_data_bin, tiny_teacher, tmp_path):
    save = tmp_path / "run"
    run_cli("fairseq-train", tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation_kd",
            "--teacher-checkpoint", tiny_teacher, *TINY_STUDENT_ARGS, "--criterion", "word_kd",
            *EPOCH_ARGS, "--max-epoch", "3", "--save-dir", save, warm=True)
    assert sorted(p.name for p in save.glob("checkpoint[0-9]*.pt")) == ["checkpoint1.pt", "checkpoint2.pt", "checkpoint3.pt"]
    output = tmp_path / "avg.pt"
    printed = run_module("fairseq_kd.cli.average_checkpoints", save, "--last", "2", "--output", output,
                         warm=True).stdout
    assert "checkpoint2.pt, checkpoint3.pt" in printed

    averaged = load(output)
    second = load(save / "checkpoint2.pt")["model"]
    third = load(save / "checkpoint3.pt")["model"]
    assert set(averaged["model"]) == set(third)
    changed = 0
    for name, value in third.items():
        if value.is_floating_point():
            expected = ((second[name].double() + value.double()) / 2).to(value.dtype)
            torch.testing.assert_close(averaged["model"][name], expected, rtol=0, atol=0)
            changed += int(not torch.equal(second[name], value))
        else:
            assert torch.equal(averaged["model"][name], value)
    assert changed > 0  # the two epochs differ, so the average is not a copy of either
    assert averaged["last_optimizer_state"] is None
    assert averaged["extra_state"]["averaged_checkpoints"] == ["checkpoint2.pt", "checkpoint3.pt"]

    # The average decodes with fairseq-generate and serves as a teacher, like any checkpoint of the run.
    generated = run_cli("fairseq-generate", tiny_data_bin, "--user-dir", USER_DIR, "--path", output,
                        "--beam", "2", "--batch-size", "16", "--gen-subset", "valid", warm=True)
    assert generated.stdout.count("\nH-") == 40
    run_cli("fairseq-train", tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation_kd",
            "--teacher-checkpoint", output, *TINY_STUDENT_ARGS, "--criterion", "word_kd",
            *COMMON_TRAIN_ARGS, "--max-update", "1", "--save-dir", tmp_path / "student", warm=True)


def test_bad_requests_are_refused_before_writing(tmp_path):
    save = tmp_path / "run"
    save.mkdir()
    for epoch in (1, 2):
        (save / f"checkpoint{epoch}.pt").write_bytes(b"not read")
    existing = tmp_path / "mine.pt"
    existing.write_bytes(b"keep me")

    def refused(*args):
        proc = run_module("fairseq_kd.cli.average_checkpoints", *args, check=False, warm=True)
        assert proc.returncode == 2, proc.stderr
        return proc.stderr

    error = refused(save, "--last", "5", "--output", tmp_path / "avg.pt")
    assert "holds 2 epoch checkpoint(s)" in error and "--keep-last-epochs 5" in error
    assert "--overwrite" in refused(save, "--last", "2", "--output", existing)
    assert existing.read_bytes() == b"keep me"
    assert "is one of the checkpoints" in refused(save, "--last", "2", "--output", save / "checkpoint2.pt", "--overwrite")
    assert "update checkpoint" in refused(save, "--kind", "update", "--last", "1", "--output", tmp_path / "avg.pt")
    assert "no such folder" in refused(tmp_path / "nowhere", "--output", tmp_path / "avg.pt")  # the one path wording
    assert not (tmp_path / "avg.pt").exists()
