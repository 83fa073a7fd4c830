"""Every KD loss term reaches TensorBoard (``--tensorboard-logdir``) and fairseq's JSON log
(``--log-format json``, what ``fairseq-kd-plot curves`` reads), through fairseq-train itself.

The event files are read here without TensorFlow or tensorboard: they are TFRecord files (length,
masked CRC, payload, masked CRC) of ``Event`` protobufs, whose schema tensorboardX ships.
"""
import struct
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import train_student

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2",
                                reason="tensorboardX is not installed (scripts/setup_env.sh installs it)")


def read_scalars(logdir: Path):
    """{subdirectory (fairseq's tag: train_inner, train, valid): {scalar name: [(step, value)]}}."""
    scalars = defaultdict(lambda: defaultdict(list))
    files = sorted(logdir.rglob("events.out.tfevents.*"))
    assert files, f"no event files under {logdir}: {sorted(p.name for p in logdir.rglob('*'))}"
    for path in files:
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            payload = data[offset + 12: offset + 12 + length]  # skip the length and its CRC
            assert len(payload) == length, f"{path}: truncated record at byte {offset}"
            offset += 12 + length + 4  # payload and its CRC
            event = event_pb2.Event()
            event.ParseFromString(payload)
            for value in event.summary.value:
                scalars[path.parent.name][value.tag].append((event.step, value.simple_value))
    return scalars


@pytest.mark.parametrize("criterion", ["word_kd", "a2d_kd"])
def test_every_kd_term_reaches_tensorboard_and_json_log(tiny_data_bin, tiny_teacher, tmp_path, criterion):
    import fairseq_kd
    from fairseq.criterions import CRITERION_REGISTRY

    from fairseq_kd.figures.training_log import parse_fairseq_log

    fairseq_kd.register()
    terms = CRITERION_REGISTRY[criterion].TERM_NAMES  # what the criterion says it logs
    assert "word_kd" in terms
    expected = {f"{name}_loss" for name in ("ce",) + tuple(terms)} | {"loss", "nll_loss"}

    logdir = tmp_path / "tb"
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path / "ckpt", ["--criterion", criterion], max_update=3,
                         extra=["--tensorboard-logdir", logdir, "--log-format", "json"])
    assert "tensorboard or required dependencies not found" not in proc.stdout + proc.stderr

    scalars = read_scalars(logdir)
    for tag in ("train_inner", "train"):
        missing = expected - set(scalars[tag])
        assert not missing, f"TensorBoard {tag}: no scalar {sorted(missing)} (has {sorted(scalars[tag])})"
    steps = [step for step, _ in scalars["train_inner"]["word_kd_loss"]]
    assert steps == [1, 2, 3], steps  # --log-interval 1, x axis = updates

    records = parse_fairseq_log((proc.stdout + proc.stderr).splitlines())
    inner = [r for r in records if r.split == "train_inner"]
    assert [r.num_updates for r in inner] == [1, 2, 3], records
    for record in inner:
        assert expected <= set(record.values), f"JSON log lacks {sorted(expected - set(record.values))}"
    # TensorBoard and the JSON log carry the same numbers (fairseq rounds the JSON to 3 decimals)
    by_step = dict(scalars["train_inner"]["word_kd_loss"])
    for record in inner:
        assert by_step[int(record.num_updates)] == pytest.approx(record.values["word_kd_loss"], abs=1e-3)


def test_a2d_lambda_is_logged_at_its_scheduled_value_every_update(tiny_data_bin, tiny_teacher, tmp_path):
    """lambda_e = lambda_0 * decay^(e - 1), 0 after --a2d-attention-epochs: the value of each
    update's epoch in the JSON log and in TensorBoard (about 3 updates per epoch here)."""
    from fairseq_kd.figures.training_log import parse_fairseq_log

    lambda_0, decay, last_epoch = 0.5, 0.5, 2
    logdir = tmp_path / "tb"
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path / "ckpt",
                         ["--criterion", "a2d_kd", "--a2d-lambda", str(lambda_0), "--a2d-lambda-decay", str(decay),
                          "--a2d-attention-epochs", str(last_epoch)], max_update=8,
                         extra=["--tensorboard-logdir", logdir, "--log-format", "json"])

    def scheduled(epoch):
        return lambda_0 * decay ** (epoch - 1) if epoch <= last_epoch else 0.0

    inner = [r for r in parse_fairseq_log((proc.stdout + proc.stderr).splitlines()) if r.split == "train_inner"]
    assert [r.num_updates for r in inner] == list(range(1, 9))
    assert {r.epoch for r in inner} >= {1, 2, 3}, "the run must reach the epoch after the attention phase"
    for record in inner:
        assert record.values["a2d_lambda"] == pytest.approx(scheduled(record.epoch), rel=1e-9, abs=1e-12), record
    logged = dict(read_scalars(logdir)["train_inner"]["a2d_lambda"])
    assert sorted(logged) == list(range(1, 9))
    for record in inner:
        assert logged[int(record.num_updates)] == pytest.approx(scheduled(record.epoch), rel=1e-6), record
    epochs = {r.epoch: r.values["a2d_lambda"] for r in parse_fairseq_log(proc.stdout.splitlines()) if r.split == "train"}
    assert epochs[1] == pytest.approx(lambda_0) and epochs[2] == pytest.approx(lambda_0 * decay)
