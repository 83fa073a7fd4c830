"""``--bf16`` under fairseq's own commands with ``--user-dir fairseq_kd`` (fairseq_kd.bf16): it no
longer implies ``--tpu``, so fairseq-train trains in bfloat16 on the CPU (``--cpu``) as on CUDA,
with the plugin's distillation criteria, resumes, and fairseq-generate reads the result.

fairseq's bf16 path, as trained here: the Trainer casts the student, the criterion's parameters
(and the plugin casts the teacher) to bfloat16; ``FP16Optimizer`` keeps float32 master weights and
no loss scale. The checkpoint holds the bfloat16 weights, widened to float32 by fairseq's save,
and the float32 Adam moments, not the master weights: a resume continues from the master weights
rounded to bfloat16, so its first update is the uninterrupted run's and the later ones differ by
bfloat16 rounding.
"""
import math
import re

import pytest
import torch

from conftest import COMMON_TRAIN_ARGS, TINY_STUDENT_ARGS, USER_DIR, run_cli, run_fairseq_train_here, train_student
from fairseq_kd.checkpoints import safe_load

BF16_CPU = ["--bf16", "--cpu"]
A2D = ["--criterion", "a2d_kd"]
WORD_KD = ["--criterion", "word_kd"]


def _logged_updates(log: str) -> dict:
    """update number -> {name: value} of every ``*loss*`` field fairseq's simple log gives for it."""
    updates = {}
    for line in re.findall(r"\| train_inner \|.*", log):
        fields = dict(re.findall(r"(\w+)=([-\w.]+)", line))
        updates[int(fields["num_updates"])] = {k: float(v) for k, v in fields.items() if "loss" in k}
    return updates


def _assert_finite_losses(log: str, updates: int) -> dict:
    logged = _logged_updates(log)
    assert sorted(logged) == list(range(1, updates + 1)), log[-3000:]
    for update, losses in logged.items():
        assert losses and all(math.isfinite(value) for value in losses.values()), (update, losses)
    return logged


def _assert_holds_bf16_weights_widened(state) -> None:
    """What a --bf16 checkpoint holds: the model's (and the criterion's) bfloat16 weights as float32
    tensors (fairseq's save widens them), float32 Adam moments, no loss scale, the precision flags."""
    for part in ("model", "criterion"):
        for name, tensor in (state.get(part) or {}).items():
            if torch.is_tensor(tensor) and tensor.is_floating_point():
                assert tensor.dtype == torch.float32, (part, name, tensor.dtype)
                assert torch.equal(tensor, tensor.bfloat16().float()), (part, name)  # bfloat16 values
    optimizer = state["last_optimizer_state"]
    assert optimizer["state"] and all(s["exp_avg"].dtype == torch.float32 for s in optimizer["state"].values())
    assert "loss_scale" not in optimizer
    common = state["cfg"]["common"]
    assert common["bf16"] and common["cpu"] and not common["tpu"]


# ----------------------------------------------------------------------------- the parse
def _parse_training(arguments):
    from fairseq import options

    return options.parse_args_and_arch(options.get_training_parser(), input_args=list(map(str, arguments)))


@pytest.mark.parametrize("flags, tpu", [
    (["--bf16"], False),
    (["--bf16", "--cpu"], False),
    (["--memory-efficient-bf16"], False),
    (["--bf16", "--tpu"], True),
    (["--tpu"], True),
])
def test_bf16_leaves_tpu_as_the_command_line_gives_it(flags, tpu):
    import fairseq_kd

    fairseq_kd.register()  # what --user-dir fairseq_kd does in a fairseq command
    args = _parse_training(["DATA", "--arch", "transformer", *flags])
    assert args.tpu is tpu and args.bf16 is any("bf16" in flag for flag in flags)


def test_stock_parse_makes_bf16_imply_tpu():
    """What the patch undoes: fairseq's own parse sets tpu for --bf16 (if a fairseq release stops
    doing so, the patch is no longer needed)."""
    import fairseq_kd
    from fairseq import options

    fairseq_kd.register()
    stock = options.parse_args_and_arch.__wrapped__
    args = stock(options.get_training_parser(), input_args=["DATA", "--arch", "transformer", "--bf16", "--cpu"])
    assert args.bf16 and args.tpu


# ----------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def word_kd_bf16(tiny_data_bin, tiny_teacher, tmp_path_factory):
    save = tmp_path_factory.mktemp("word_kd_bf16")
    proc = train_student(tiny_data_bin, tiny_teacher, save, WORD_KD, max_update=3, extra=BF16_CPU)
    return save, proc.stdout + proc.stderr


def test_word_kd_trains_in_bf16_on_the_cpu(word_kd_bf16):
    save, log = word_kd_bf16
    logged = _assert_finite_losses(log, 3)
    assert {"ce_loss", "word_kd_loss"} <= set(logged[3])
    _assert_holds_bf16_weights_widened(safe_load(save / "checkpoint_last.pt"))


def test_generate_reads_a_bf16_checkpoint_with_bf16_on_the_cpu(word_kd_bf16, tiny_data_bin):
    save, _ = word_kd_bf16
    proc = run_cli("fairseq-generate", tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation_kd",
                   "--path", save / "checkpoint_last.pt", "--beam", "2", "--batch-size", "16",
                   "--gen-subset", "test", *BF16_CPU, warm=True)
    assert len(re.findall(r"^H-\d+\t", proc.stdout, re.M)) == 40


def test_plain_translation_trains_in_bf16_with_the_plugin(tiny_data_bin, tmp_path):
    proc = run_cli("fairseq-train", tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation",
                   *TINY_STUDENT_ARGS, "--criterion", "cross_entropy", *COMMON_TRAIN_ARGS, "--max-update", "2",
                   "--save-dir", tmp_path, *BF16_CPU, warm=True)
    _assert_finite_losses(proc.stdout + proc.stderr, 2)
    _assert_holds_bf16_weights_widened(safe_load(tmp_path / "checkpoint_last.pt"))


def test_a2d_trains_with_bf16_parameters_and_float32_masters(tiny_data_bin, tiny_teacher, tmp_path, monkeypatch):
    """During training the student, the criterion's alignment maps and the teacher are bfloat16; the
    optimizer updates float32 master copies; the loss the criterion returns is float32."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer
    from fairseq.trainer import Trainer

    from fairseq_kd.tasks.translation_kd import TranslationKDTask

    seen = []
    task_train_step, trainer_train_step = TranslationKDTask.train_step, Trainer.train_step

    def recording_task_step(task, sample, model, criterion, *args, **kwargs):
        loss, sample_size, log = task_train_step(task, sample, model, criterion, *args, **kwargs)
        seen.append({"loss": loss.dtype, "student": {p.dtype for p in model.parameters()},
                     "criterion": {p.dtype for p in criterion.parameters()},
                     "teacher": {p.dtype for p in task.teacher.model.parameters()}})
        return loss, sample_size, log

    def recording_trainer_step(trainer, *args, **kwargs):
        result = trainer_train_step(trainer, *args, **kwargs)
        seen[-1].update(optimizer=type(trainer.optimizer), scaler=trainer.optimizer.scaler,
                        masters={p.dtype for p in trainer.optimizer.fp32_params}, device=trainer.device.type)
        return result

    monkeypatch.setattr(TranslationKDTask, "train_step", recording_task_step)
    monkeypatch.setattr(Trainer, "train_step", recording_trainer_step)
    # fairseq-train's cli_main in this process, where the spies are
    proc = run_fairseq_train_here(tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation_kd",
                                  "--teacher-checkpoint", tiny_teacher, *TINY_STUDENT_ARGS, *A2D, *COMMON_TRAIN_ARGS,
                                  "--max-update", "2", "--save-dir", tmp_path, *BF16_CPU)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(seen) == 2
    for step in seen:
        assert step["student"] == step["criterion"] == step["teacher"] == {torch.bfloat16}, step
        assert step["loss"] == torch.float32 and step["masters"] == {torch.float32}, step
        assert step["optimizer"] is FP16Optimizer and step["scaler"] is None and step["device"] == "cpu", step


def test_a2d_bf16_resume_continues_the_uninterrupted_run(tiny_data_bin, tiny_teacher, tmp_path):
    """Stopped after 2 updates (mid-epoch) and resumed to 5: update 3 starts from the same bfloat16
    weights and Adam moments, so it logs the uninterrupted run's losses; later updates differ only
    by the master weights' rounding to bfloat16 at the stop (measured: up to 0.002)."""
    straight = train_student(tiny_data_bin, tiny_teacher, tmp_path / "straight", A2D, max_update=5, extra=BF16_CPU)
    first = train_student(tiny_data_bin, tiny_teacher, tmp_path / "resumed", A2D, max_update=2, extra=BF16_CPU)
    resumed = train_student(tiny_data_bin, tiny_teacher, tmp_path / "resumed", A2D, max_update=5, extra=BF16_CPU)
    log = resumed.stdout + resumed.stderr
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 2 updates\)", log), log[-3000:]
    expected = _assert_finite_losses(straight.stdout + straight.stderr, 5)
    before = _assert_finite_losses(first.stdout + first.stderr, 2)
    after = _logged_updates(log)
    assert sorted(after) == [3, 4, 5] and all(math.isfinite(v) for u in after.values() for v in u.values())
    assert before == {u: expected[u] for u in (1, 2)} and after[3] == expected[3]
    for update in (4, 5):
        for name, value in after[update].items():
            assert value == pytest.approx(expected[update][name], abs=0.01), (update, name)
    assert expected[1]["loss"] - after[5]["loss"] > 0.3  # not a restart from the initial state

    resumed_state = safe_load(tmp_path / "resumed" / "checkpoint_last.pt")
    _assert_holds_bf16_weights_widened(resumed_state)
    assert resumed_state["optimizer_history"][-1]["num_updates"] == 5
