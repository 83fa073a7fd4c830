"""``--bf16`` under fairseq's own commands with ``--user-dir fairseq_kd`` (fairseq_kd.half_precision):
it no longer implies ``--tpu``, so fairseq-train trains in bfloat16 on the CPU (``--cpu``) as on
CUDA, with the plugin's distillation criteria; a resume continues exactly as the uninterrupted run;
fairseq-generate reads the result.

fairseq's bf16 path, as trained here: the Trainer casts the student and the criterion's parameters
(and the plugin the teacher) to bfloat16; ``FP16Optimizer`` updates float32 master weights, with no
loss scale. The checkpoint holds the bfloat16 weights (widened to float32 by fairseq's save), the
float32 Adam moments and, added by the plugin, the float32 master weights.
"""
import math
import re

import pytest
import torch

from conftest import COMMON_TRAIN_ARGS, TINY_STUDENT_ARGS, USER_DIR, run_cli, run_fairseq_train_here, train_student
from fairseq_kd.checkpoints import safe_load
from fairseq_kd.half_precision import MASTERS_KEY

BF16_CPU = ["--bf16", "--cpu"]
A2D = ["--criterion", "a2d_kd"]
WORD_KD = ["--criterion", "word_kd"]


def _logged_updates(log: str) -> dict:
    """update number -> {name: value} of every ``*loss*`` field fairseq's simple log (or
    fairseq-hydra-train's) gives for it."""
    updates = {}
    for line in re.findall(r"train_inner(?: \||\]\[INFO\] -) .*", log):
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
    tensors (fairseq's save widens them), float32 Adam moments and master weights (one per trained
    parameter), no loss scale, the precision flags."""
    for part in ("model", "criterion"):
        for name, tensor in (state.get(part) or {}).items():
            if torch.is_tensor(tensor) and tensor.is_floating_point():
                assert tensor.dtype == torch.float32, (part, name, tensor.dtype)
                assert torch.equal(tensor, tensor.bfloat16().float()), (part, name)  # bfloat16 values
    optimizer = state["last_optimizer_state"]
    assert optimizer["state"] and all(s["exp_avg"].dtype == torch.float32 for s in optimizer["state"].values())
    assert "loss_scale" not in optimizer
    masters, moments = optimizer[MASTERS_KEY], list(optimizer["state"].values())
    assert [m.shape for m in masters] == [s["exp_avg"].shape for s in moments]  # one per trained parameter
    assert all(m.dtype == torch.float32 for m in masters)
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)  # finer than bfloat16
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


# ----------------------------------------------------------------------------- the master weights
class _OptimizerStandIn:
    """What the master-weight restore uses of an FP16Optimizer: its masters and the sync to the model."""

    def __init__(self, masters):
        self.fp32_params, self.synced, self.loaded = masters, 0, None

    def _sync_fp32_params_to_fp16(self):
        self.synced += 1


@pytest.mark.parametrize("masters, saved", [
    ([torch.zeros(2, 3), torch.zeros(4)], [torch.ones(2, 3), torch.ones(4)]),  # --bf16: one per parameter
    ({0: torch.zeros(10)}, [torch.ones(10)]),  # --fp16 on CUDA: one flat tensor per device
], ids=["per parameter", "flat per device"])
def test_masters_are_restored_when_they_fit_and_left_to_the_model_when_not(masters, saved, caplog):
    from fairseq_kd.half_precision import master_tensors, restoring_masters

    def stock_load(optimizer, state_dict, optimizer_overrides=None):
        optimizer.loaded = state_dict

    load = restoring_masters(stock_load)
    optimizer = _OptimizerStandIn(masters)
    load(optimizer, {"state": {}, MASTERS_KEY: saved})
    assert all(torch.equal(m, torch.ones_like(m)) for m in master_tensors(masters)) and optimizer.synced == 1
    assert optimizer.loaded == {"state": {}}  # fairseq's own load never sees the key

    other = _OptimizerStandIn([torch.zeros(3)])
    load(other, {"state": {}, MASTERS_KEY: saved})
    assert torch.equal(other.fp32_params[0], torch.zeros(3)) and other.synced == 0
    assert "do not fit" in caplog.text


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


def test_hydra_train_trains_in_bf16_on_the_cpu(tiny_data_bin, tiny_teacher, tmp_path):
    """fairseq-hydra-train never made bf16 imply tpu: its config trains in bf16 on the CPU as well."""
    (tmp_path / "bf16.yaml").write_text(f"""
common: {{user_dir: {USER_DIR}, seed: 1, log_format: simple, log_interval: 1, no_progress_bar: true,
         bf16: true, cpu: true}}
task: {{_name: translation_kd, data: {tiny_data_bin}, teacher_checkpoint: {tiny_teacher}}}
model: {{_name: transformer, encoder_layers: 2, decoder_layers: 2, encoder_embed_dim: 16, decoder_embed_dim: 16,
        encoder_ffn_embed_dim: 32, decoder_ffn_embed_dim: 32, encoder_attention_heads: 2,
        decoder_attention_heads: 2}}
criterion: {{_name: word_kd}}
optimizer: {{_name: adam}}
lr_scheduler: {{_name: fixed}}
optimization: {{lr: [0.003], max_update: 2}}
dataset: {{max_tokens: 1500, num_workers: 0, disable_validation: true}}
checkpoint: {{save_dir: {tmp_path / "save"}, no_epoch_checkpoints: true}}
""")
    proc = run_cli("fairseq-hydra-train", "--config-dir", tmp_path, "--config-name", "bf16",
                   f"hydra.run.dir={tmp_path / 'hydra'}", warm=True)
    assert "word_kd_loss" in _assert_finite_losses(proc.stdout + proc.stderr, 2)[2]
    _assert_holds_bf16_weights_widened(safe_load(tmp_path / "save" / "checkpoint_last.pt"))


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


def _float_tensors(state) -> dict:
    """Every floating-point tensor a checkpoint holds for training: the model's, the criterion's,
    the optimizer's (Adam moments, master weights)."""
    tensors = {}
    for part in ("model", "criterion"):
        tensors.update({(part, name): t for name, t in (state.get(part) or {}).items()
                        if torch.is_tensor(t) and t.is_floating_point()})
    optimizer = state["last_optimizer_state"]
    for index, moments in optimizer["state"].items():
        tensors.update({("adam", index, key): moments[key] for key in ("exp_avg", "exp_avg_sq")})
    tensors.update({("master", index): t for index, t in enumerate(optimizer[MASTERS_KEY])})
    return tensors


def test_a2d_bf16_resume_continues_exactly_as_the_uninterrupted_run(tiny_data_bin, tiny_teacher, tmp_path):
    """Stopped after 2 updates (mid-epoch) and resumed to 5: the same logged losses at every update
    and, at the end, the same weights, criterion maps, Adam moments and master weights, bit for bit.
    Resumed from the same checkpoint without its master weights (what fairseq itself saves), the run
    trains on from the masters rounded to bfloat16 and ends elsewhere."""
    import shutil

    straight = train_student(tiny_data_bin, tiny_teacher, tmp_path / "straight", A2D, max_update=5, extra=BF16_CPU)
    first = train_student(tiny_data_bin, tiny_teacher, tmp_path / "resumed", A2D, max_update=2, extra=BF16_CPU)
    mid = safe_load(tmp_path / "resumed" / "checkpoint_last.pt")
    _assert_holds_bf16_weights_widened(mid)
    del mid["last_optimizer_state"][MASTERS_KEY]
    (tmp_path / "without_masters").mkdir()
    torch.save(mid, tmp_path / "without_masters" / "checkpoint_last.pt")
    shutil.copy(tmp_path / "resumed" / "checkpoint_last.pt", tmp_path / "mid.pt")

    resumed = train_student(tiny_data_bin, tiny_teacher, tmp_path / "resumed", A2D, max_update=5, extra=BF16_CPU)
    log = resumed.stdout + resumed.stderr
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 2 updates\)", log), log[-3000:]
    expected = _assert_finite_losses(straight.stdout + straight.stderr, 5)
    before = _assert_finite_losses(first.stdout + first.stderr, 2)
    assert before == {u: expected[u] for u in (1, 2)}
    assert _logged_updates(log) == {u: expected[u] for u in (3, 4, 5)}
    assert expected[1]["loss"] - expected[5]["loss"] > 0.3  # it learns: the comparison is not of a standstill

    straight_state = safe_load(tmp_path / "straight" / "checkpoint_last.pt")
    resumed_state = safe_load(tmp_path / "resumed" / "checkpoint_last.pt")
    _assert_holds_bf16_weights_widened(resumed_state)
    assert resumed_state["optimizer_history"][-1]["num_updates"] == 5
    straight_tensors, resumed_tensors = _float_tensors(straight_state), _float_tensors(resumed_state)
    assert straight_tensors.keys() == resumed_tensors.keys()
    for key, tensor in straight_tensors.items():
        assert torch.equal(resumed_tensors[key], tensor), key
    mid_tensors = _float_tensors(safe_load(tmp_path / "mid.pt"))
    assert not all(torch.equal(t, mid_tensors[k]) for k, t in straight_tensors.items())  # updates 3-5 changed them

    without = train_student(tiny_data_bin, tiny_teacher, tmp_path / "without_masters", A2D, max_update=5,
                            extra=BF16_CPU)
    assert _logged_updates(without.stdout + without.stderr)[3] == expected[3]  # the same bfloat16 weights
    without_model = safe_load(tmp_path / "without_masters" / "checkpoint_last.pt")["model"]
    assert not all(torch.equal(tensor, straight_state["model"][name]) for name, tensor in without_model.items()
                   if torch.is_tensor(tensor) and tensor.is_floating_point())
