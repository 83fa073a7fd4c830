"""Checkpoints are never unpickled beyond plain data, even with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1.

Many fairseq users set that variable to load old checkpoints; torch then unpickles anything in
every ``torch.load`` call that does not pass ``weights_only`` explicitly. Every checkpoint-reading
path of the plugin (and fairseq's own loaders once the plugin is imported) passes
``weights_only=True`` explicitly. Each test below hands a checkpoint carrying a real pickle gadget
(``os.mkdir`` of a marker folder when unpickled) to one path, with the variable set, and checks
that the path refused it clearly and that the marker was never created. A control test shows the
gadget does run under the variable when ``weights_only`` is left out.
"""
import os
import pickle
import subprocess
import sys

import pytest
import torch

from conftest import BIN, COMMON_TRAIN_ARGS, QUIET_ENV, TINY_STUDENT_ARGS, USER_DIR

UNSAFE_ENV = {**QUIET_ENV, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


class _MakesMarkerWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture()
def gadget(tiny_teacher, tmp_path):
    """(checkpoint path, marker path): a real fairseq checkpoint plus a gadget in extra_state."""
    marker = tmp_path / "gadget_ran"
    state = torch.load(tiny_teacher, weights_only=False)  # our own test file, trusted
    state["extra_state"]["payload"] = _MakesMarkerWhenUnpickled(marker)
    evil = tmp_path / "evil.pt"
    torch.save(state, evil)
    return evil, marker


def _run(cmd, **kwargs):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=UNSAFE_ENV,
                          timeout=600, **kwargs)


def _refused(proc, marker, *fragments):
    assert not marker.exists(), "the pickle gadget ran"
    assert proc.returncode != 0, proc.stdout[-2000:]
    for fragment in ("refusing to load checkpoint", *fragments):
        assert fragment in proc.stderr, proc.stderr[-4000:]


def test_control_the_gadget_runs_when_weights_only_is_left_out(gadget):
    """Proves the gadget is live: a bare torch.load under the variable executes it."""
    evil, marker = gadget
    proc = _run([sys.executable, "-c", f"import torch; torch.load({str(evil)!r})"])
    assert marker.exists(), proc.stderr[-2000:]


def test_numeric_numpy_arrays_load_but_object_arrays_stay_refused(tiny_teacher, tmp_path):
    """fairseq's --eval-bleu stores numpy count arrays in a checkpoint: those load; an object array
    carrying the gadget is refused, and the gadget does not run."""
    import numpy as np

    from fairseq_kd.checkpoints import UnsafeCheckpointError, safe_load

    state = torch.load(tiny_teacher, weights_only=False)  # our own test file, trusted
    state["extra_state"]["counts"] = np.array([5, 3, 1, 0])
    numeric = tmp_path / "numeric.pt"
    torch.save(state, numeric)
    assert safe_load(numeric)["extra_state"]["counts"].tolist() == [5, 3, 1, 0]
    marker = tmp_path / "gadget_ran"
    state["extra_state"]["counts"] = np.array([_MakesMarkerWhenUnpickled(marker)], dtype=object)
    evil = tmp_path / "object_array.pt"
    torch.save(state, evil)
    with pytest.raises(UnsafeCheckpointError, match="refusing to load checkpoint") as refusal:
        safe_load(evil)
    assert not marker.exists()
    # the element's class, read from the pickle's opcodes without running them
    assert f"a numpy array of Python objects (dtype object) holding the class or function {MKDIR}" in str(refusal.value)


MKDIR = f"{os.mkdir.__module__}.mkdir"  # posix.mkdir


@pytest.mark.parametrize("how", ["raw pickle", "legacy torch format", "pickle protocol 0"])
def test_refusals_name_the_class_read_from_the_pickle_without_running_it(tiny_teacher, tmp_path, how):
    """A raw pickle, or a checkpoint in torch's legacy (non-zip) format, whose gadget torch's
    refusal does not name: the class is read from the GLOBAL / STACK_GLOBAL opcodes."""
    import pickle

    from fairseq_kd.checkpoints import UnsafeCheckpointError, refused_globals, safe_load

    marker = tmp_path / "gadget_ran"
    evil = tmp_path / "evil.pt"
    if how == "legacy torch format":
        state = torch.load(tiny_teacher, weights_only=False)  # our own test file, trusted
        state["extra_state"]["payload"] = _MakesMarkerWhenUnpickled(marker)
        torch.save(state, evil, _use_new_zipfile_serialization=False)
    else:
        evil.write_bytes(pickle.dumps({"model": _MakesMarkerWhenUnpickled(marker)},
                                      protocol=0 if how == "pickle protocol 0" else 4))
    assert refused_globals(evil) == [MKDIR]
    with pytest.raises(UnsafeCheckpointError, match=f"it contains the class or function {MKDIR}, which is not"):
        safe_load(evil)
    assert not marker.exists()
    assert refused_globals(tiny_teacher) == []  # fairseq's own classes are all allowed


def test_fairseq_loader_passes_weights_only_explicitly_once_the_plugin_is_imported(gadget):
    evil, marker = gadget
    code = (
        "import fairseq_kd; fairseq_kd.register()\n"
        "from fairseq import checkpoint_utils\n"
        "from fairseq_kd.checkpoints.safe_loading import UnsafeCheckpointError, fairseq_loader_is_safe\n"
        "assert fairseq_loader_is_safe()\n"
        f"try:\n    checkpoint_utils.load_checkpoint_to_cpu({str(evil)!r})\n"
        "except UnsafeCheckpointError as err:\n    import sys; print(err, file=sys.stderr); sys.exit(3)\n"
    )
    proc = _run([sys.executable, "-c", code])
    _refused(proc, marker, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    assert proc.returncode == 3


def test_teacher_checkpoint(gadget, tiny_data_bin, tmp_path):
    evil, marker = gadget
    proc = _run([BIN / "fairseq-train", tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation_kd",
                 "--teacher-checkpoint", evil, *TINY_STUDENT_ARGS, "--criterion", "word_kd", *COMMON_TRAIN_ARGS,
                 "--max-update", "1", "--save-dir", tmp_path / "s"])
    _refused(proc, marker, "--teacher-checkpoint")
    assert not (tmp_path / "s" / "checkpoint_last.pt").exists()


def test_restore_file_in_fairseq_train(gadget, tiny_data_bin, tiny_teacher, tmp_path):
    evil, marker = gadget
    proc = _run([BIN / "fairseq-train", tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation_kd",
                 "--teacher-checkpoint", tiny_teacher, *TINY_STUDENT_ARGS, "--criterion", "word_kd",
                 *COMMON_TRAIN_ARGS, "--max-update", "1", "--save-dir", tmp_path / "s", "--restore-file", evil])
    _refused(proc, marker)
    assert not (tmp_path / "s" / "checkpoint_last.pt").exists()


def test_fairseq_generate_path_with_user_dir(gadget, tiny_data_bin):
    evil, marker = gadget
    proc = _run([BIN / "fairseq-generate", tiny_data_bin, "--user-dir", USER_DIR, "--task", "translation",
                 "--path", evil, "--gen-subset", "test", "--beam", "1", "--batch-size", "8"])
    _refused(proc, marker)


def test_export(gadget, tmp_path):
    evil, marker = gadget
    proc = _run([BIN / "fairseq-kd-export", evil, tmp_path / "out.pt"])
    _refused(proc, marker, "error:")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out.pt").exists()


def test_ctranslate2_export(gadget, tiny_data_bin, tmp_path):
    pytest.importorskip("ctranslate2")
    evil, marker = gadget
    proc = _run([BIN / "fairseq-kd-export", evil, tmp_path / "out", "--format", "ctranslate2",
                 "--data", tiny_data_bin])
    _refused(proc, marker, "error:")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_seqkd(gadget, tiny_data_bin, tmp_path):
    evil, marker = gadget
    proc = _run([BIN / "fairseq-kd-seqkd", "--data", tiny_data_bin, "--teacher-checkpoint", evil,
                 "--output", tmp_path / "out", "--cpu", "--split", "valid"])
    _refused(proc, marker, "error:", "--teacher-checkpoint")
    assert "Traceback" not in proc.stderr


def test_translate_refuses_a_hugging_face_folder_with_a_gadget_naming_its_own_flag(tiny_data_bin, tmp_path):
    """fairseq-kd-translate --model DIR, DIR a Hugging Face folder whose pickled weights carry a gadget
    (pickle protocol 4): one line naming --model (the flag the folder came with, not training's
    --teacher-checkpoint), nothing before it (no note of torch's on the protocol), the gadget never run."""
    import json

    marker = tmp_path / "gadget_ran"
    folder = tmp_path / "hf"
    folder.mkdir()
    with open(folder / "pytorch_model.bin", "wb") as weights:
        pickle.dump({"model.shared.weight": _MakesMarkerWhenUnpickled(marker)}, weights, protocol=4)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "marian", "vocab_size": 50, "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
        "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1, "max_position_embeddings": 64}))
    proc = _run([BIN / "fairseq-kd-translate", tiny_data_bin, "--model", folder])
    assert not marker.exists(), "the pickle gadget ran"
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith(f"fairseq-kd-translate: error: --model {str(folder)!r}: refusing to load its "
                                  "pickled weights"), proc.stderr


@pytest.mark.parametrize("figure", ["alp", "alignment"])
def test_figures_from_checkpoints(gadget, tmp_path, figure):
    evil, marker = gadget
    proc = _run([sys.executable, "-m", "fairseq_kd.cli.plot", figure, "--checkpoint", evil,
                 "--output", tmp_path / "w.png", "--weights-output", tmp_path / "w.json"])
    _refused(proc, marker, "error:")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "w.json").exists() and not (tmp_path / "w.png").exists()


def test_safe_load_ignores_the_variable_in_process(gadget, monkeypatch):
    from fairseq_kd.checkpoints import UnsafeCheckpointError, safe_load

    evil, marker = gadget
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UnsafeCheckpointError, match="mkdir"):
        safe_load(evil)
    assert not marker.exists()


def test_the_allow_list_survives_torchs_safe_globals_context(tiny_teacher):
    """torch's ``safe_globals`` context manager restores torch's own list when it exits; a plugin
    load afterwards (in the same process) still reads fairseq's Namespace."""
    import argparse

    from fairseq_kd.checkpoints.safe_loading import install, safe_load

    install()
    with torch.serialization.safe_globals([argparse.Namespace]):
        pass
    assert "model" in safe_load(tiny_teacher)
