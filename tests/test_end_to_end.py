"""The main job through the real CLIs: fairseq-train with --user-dir, resume, generate, export, score."""
import json
import re

import pytest
import torch

from conftest import TINY_STUDENT_ARGS, USER_DIR, run_cli, run_cli_here, train_student
from fairseq_kd.checkpoints import safe_load


def _hypotheses(generate_stdout: str):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^H-(\d+)\t\S+\t(.*)$", generate_stdout, re.M)}


def _inner_losses(log: str):
    """Per-update training loss from fairseq's simple log (--log-interval 1)."""
    return {int(m.group(2)): float(m.group(1)) for m in re.finditer(
        r"\| train_inner \|.*?\bloss=([\d.]+),.*?\bnum_updates=(\d+),", log)}


@pytest.fixture(scope="module")
def word_kd_run(tiny_data_bin, tiny_teacher, tmp_path_factory):
    save = tmp_path_factory.mktemp("word_kd_student")
    proc = train_student(tiny_data_bin, tiny_teacher, save, ["--criterion", "word_kd"], max_update=4)
    return save, proc.stdout + proc.stderr


def test_word_kd_trains_and_logs_its_terms(word_kd_run):
    _, log = word_kd_run
    assert re.search(r"\| train \|.*\bce_loss [\d.]+ \| word_kd_loss [\d.]+", log), log[-2000:]
    assert "num_updates 4" in log


def test_teacher_is_not_in_checkpoint_or_optimizer(word_kd_run, kd_task):
    save, _ = word_kd_run
    state = safe_load(save / "checkpoint_last.pt")
    teacher_names = set(kd_task.teacher.model.state_dict())
    from conftest import build_tiny_student

    student_names = set(build_tiny_student(kd_task).state_dict())
    assert set(state["model"]) == student_names
    assert not any(name.startswith("teacher") for name in state["model"])
    assert teacher_names != student_names
    # Adam holds state for exactly the student's trainable parameters (the teacher's never enter)
    student_params = sum(p.numel() for p in build_tiny_student(kd_task).parameters())
    optimizer_state = state["last_optimizer_state"]["state"]
    assert sum(s["exp_avg"].numel() for s in optimizer_state.values()) == student_params
    assert "criterion" not in state or not state["criterion"]  # word_kd has no parameters


def test_generate_with_user_dir_and_exported_student_without(word_kd_run, tiny_data_bin, kd_task, tmp_path):
    save, _ = word_kd_run
    with_plugin = run_cli("fairseq-generate", tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation_kd",
                          "--path", save / "checkpoint_last.pt", "--beam", "2", "--batch-size", "16", "--gen-subset", "test",
                          warm=True)
    hyps = _hypotheses(with_plugin.stdout)
    assert len(hyps) == 40

    exported = tmp_path / "student.pt"
    # the plugin's commands in children of the warm interpreter (their command lines as new processes:
    # test_ctranslate2_export, test_promises)
    summary = json.loads(run_cli("fairseq-kd-export", save / "checkpoint_last.pt", exported, warm=True).stdout)
    from conftest import build_tiny_student

    assert summary["encoder_layers"] == 2
    assert summary["parameters"] == sum(p.numel() for p in build_tiny_student(kd_task).parameters())
    raw = torch.load(exported, weights_only=True)  # plain data only: no Namespace, no plugin class
    assert raw["cfg"]["model"]["arch"] == "transformer" and raw["cfg"]["task"]["_name"] == "translation"
    assert "teacher_checkpoint" not in raw["cfg"]["task"]
    # stock fairseq, no --user-dir (a new process, the plugin nowhere in it): same hypotheses as the
    # training checkpoint gave
    stock = run_cli("fairseq-generate", tiny_data_bin, "--task", "translation", "--path", exported,
                    "--beam", "2", "--batch-size", "16", "--gen-subset", "test")
    assert _hypotheses(stock.stdout) == hyps

    out = tmp_path / "gen.txt"
    out.write_text(stock.stdout)
    score = tmp_path / "score.json"
    run_cli("fairseq-kd-score", "--generate-output", out, "--system", "word_kd",
            "--bootstrap", "200", "--output-json", score, warm=True)
    result = json.loads(score.read_text())
    assert result["mean"] >= 0 and result["ci"] >= 0 and result["n_bootstrap"] == 200
    # refuses to overwrite an existing export
    proc = run_cli_here("fairseq-kd-export", save / "checkpoint_last.pt", exported)
    assert proc.returncode != 0 and "--overwrite" in proc.stderr


def test_resume_continues_from_the_same_state(tiny_data_bin, tiny_teacher, tmp_path):
    """Stop after 3 updates (past the end of epoch 1), resume to 6: the run continues at update 4
    from the saved state, on the uninterrupted run's batches, so every loss and weight is the
    uninterrupted run's. (fairseq-fixed builds a resumed run's batches with the epoch it resumes in;
    fairseq's own translation task there differed by up to 0.035 a loss.)"""
    straight = train_student(tiny_data_bin, tiny_teacher, tmp_path / "straight", ["--criterion", "word_kd"],
                             max_update=6)
    first = train_student(tiny_data_bin, tiny_teacher, tmp_path / "resumed", ["--criterion", "word_kd"],
                          max_update=3)
    resumed = train_student(tiny_data_bin, tiny_teacher, tmp_path / "resumed", ["--criterion", "word_kd"],
                            max_update=6)
    log = resumed.stdout + resumed.stderr
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch 2 @ 3 updates\)", log), log[-3000:]
    expected = _inner_losses(straight.stdout + straight.stderr)
    before, after = _inner_losses(first.stdout + first.stderr), _inner_losses(log)
    assert sorted(before) == [1, 2, 3] and sorted(after) == [4, 5, 6]
    assert before == {u: expected[u] for u in (1, 2, 3)}  # same start, same data, same teacher
    assert after == {u: expected[u] for u in (4, 5, 6)}
    assert expected[1] - after[4] > 0.3  # not a restart from the initial state
    state = safe_load(tmp_path / "resumed" / "checkpoint_last.pt")
    straight_state = safe_load(tmp_path / "straight" / "checkpoint_last.pt")
    assert all(torch.equal(value, straight_state["model"][name]) for name, value in state["model"].items())
    assert state["optimizer_history"][-1]["num_updates"] == 6
    assert all(int(s["step"]) == 6 for s in state["last_optimizer_state"]["state"].values())


def test_fairseq_hydra_train_with_a_yaml_config(tiny_data_bin, tiny_teacher, tmp_path):
    """The criterion and task configs are FairseqDataclasses, so a YAML file works like flags."""
    config = tmp_path / "config"
    config.mkdir()
    (config / "word_kd.yaml").write_text(f"""
common:
  user_dir: {USER_DIR}
  seed: 1
  log_format: simple
  log_interval: 1
  no_progress_bar: true
task:
  _name: translation_kd
  data: {tiny_data_bin}
  teacher_checkpoint: {tiny_teacher}
model:
  _name: transformer
  encoder_layers: 2
  decoder_layers: 2
  encoder_embed_dim: 16
  decoder_embed_dim: 16
  encoder_ffn_embed_dim: 32
  decoder_ffn_embed_dim: 32
  encoder_attention_heads: 2
  decoder_attention_heads: 2
criterion:
  _name: word_kd
  kd_weight: 0.25
  kd_temperature: 2.0
optimizer:
  _name: adam
lr_scheduler:
  _name: fixed
optimization:
  lr: [0.003]
  max_update: 2
dataset:
  max_tokens: 1500
  num_workers: 0
  disable_validation: true
checkpoint:
  save_dir: {tmp_path / "save"}
  no_epoch_checkpoints: true
""")
    proc = run_cli("fairseq-hydra-train", "--config-dir", config, "--config-name", "word_kd",
                   f"hydra.run.dir={tmp_path / 'hydra'}", warm=True)
    log = proc.stdout + proc.stderr
    assert re.search(r"'criterion': \{'_name': 'word_kd'.*'kd_weight': 0\.25, 'kd_temperature': 2\.0", log)
    assert "word_kd_loss" in log and (tmp_path / "save" / "checkpoint_last.pt").exists()
