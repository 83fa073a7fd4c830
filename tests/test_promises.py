"""The promises of docs/PROMISES.md that are not about safe loading or scoring: a resume is bound
to its teacher and dictionaries, every weight/temperature/rate is checked at start-up, a teacher
that cannot read the task's longest sentences is refused, and an export into a folder writes a
named file there."""
import dataclasses
import hashlib
import json
import math
import shutil

import pytest
import torch

from conftest import run_module, train_student


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _binding(checkpoint):
    state = torch.load(checkpoint, weights_only=False)  # our own test file, trusted
    return state["extra_state"]["TranslationKDTask"]["binding"]


# --------------------------------------------------------------------------- resume bound to its teacher


@pytest.fixture()
def other_teacher(tiny_teacher, tmp_path):
    """A valid teacher of other content: the tiny teacher with one weight changed."""
    state = torch.load(tiny_teacher, weights_only=False)  # our own test file, trusted
    name = next(n for n, t in state["model"].items() if t.is_floating_point())
    state["model"][name] = state["model"][name] + 1e-3
    path = tmp_path / "other_teacher.pt"
    torch.save(state, path)
    return path


def test_resume_is_bound_to_its_teacher(tiny_data_bin, tiny_teacher, other_teacher, tmp_path):
    save = tmp_path / "s"
    train_student(tiny_data_bin, tiny_teacher, save, ["--criterion", "word_kd"], max_update=2)
    last = save / "checkpoint_last.pt"
    recorded = _binding(last)
    assert recorded["teacher_sha256"] == _sha(tiny_teacher)
    from fairseq.data import Dictionary

    from fairseq_kd.fingerprint import dictionary_sha256

    assert recorded["source_dictionary_sha256"] == dictionary_sha256(Dictionary.load(str(tiny_data_bin / "dict.src.txt")))
    assert recorded["target_dictionary_sha256"] == dictionary_sha256(Dictionary.load(str(tiny_data_bin / "dict.tgt.txt")))
    before = _sha(last)

    # another teacher: refused, naming both, nothing written
    proc = train_student(tiny_data_bin, other_teacher, save, ["--criterion", "word_kd"], max_update=3, refused=True)
    assert proc.returncode != 0
    for fragment in ("resume refused", str(tiny_teacher), str(other_teacher), _sha(tiny_teacher)[:12],
                     _sha(other_teacher)[:12], "--allow-teacher-change"):
        assert fragment in proc.stderr, proc.stderr[-3000:]
    assert _sha(last) == before

    # the same teacher moved elsewhere (same content): accepted
    moved = tmp_path / "moved" / "teacher.pt"
    moved.parent.mkdir()
    shutil.copy(tiny_teacher, moved)
    train_student(tiny_data_bin, moved, save, ["--criterion", "word_kd"], max_update=3)
    assert _binding(last)["teacher_sha256"] == _sha(tiny_teacher)

    # a change asked for: accepted and recorded
    train_student(tiny_data_bin, other_teacher, save, ["--criterion", "word_kd"], max_update=4,
                  extra=["--allow-teacher-change"])
    changed = _binding(last)
    assert changed["teacher_sha256"] == _sha(other_teacher)
    assert changed["teacher_changes"] == [{"teacher_sha256": _sha(tiny_teacher), "teacher_path": str(moved)}]


def test_resume_with_other_dictionaries_is_refused(kd_task):
    from fairseq_kd.checkpoints import ResumeMismatchError

    recorded = kd_task.run_binding()
    kd_task.check_resumed_binding(recorded)  # the same run: fine
    for key in ("source_dictionary_sha256", "target_dictionary_sha256"):
        with pytest.raises(ResumeMismatchError, match="dictionary .* is not the one the checkpoint was trained with"):
            kd_task.check_resumed_binding({**recorded, key: "0" * 64})
    with pytest.raises(ResumeMismatchError, match="trained with teacher no teacher"):
        kd_task.check_resumed_binding({**recorded, "teacher_sha256": None, "teacher_path": None})


# --------------------------------------------------------------------------- numeric options


def _kd_configs():
    import fairseq_kd

    fairseq_kd.register()
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY

    from fairseq_kd.criterions.base import KDCriterionConfig

    return {name: dc for name, dc in CRITERION_DATACLASS_REGISTRY.items() if issubclass(dc, KDCriterionConfig)}


def _numeric_fields(config_class):
    from fairseq_kd.criterions.base import option_ranges

    ranges = option_ranges(config_class=config_class)
    for f in dataclasses.fields(config_class):
        if f.type in (float, int) or str(f.type) in ("Optional[float]", "typing.Optional[float]"):
            if f.name != "seed":
                yield f.name, ranges.get(f.name)


def test_every_default_passes_and_every_non_finite_value_is_refused():
    from fairseq_kd.criterions.base import check_numeric_options

    configs = _kd_configs()
    assert {"word_kd", "selective_kd", "a2d_kd", "minilm"} <= set(configs)
    for name, config_class in configs.items():
        config = config_class()
        check_numeric_options(config, name)
        for field_name, rule in _numeric_fields(config_class):
            # every number of a criterion's config declares its range in its field (base.ranged)
            assert rule is not None, f"{name}: --{field_name.replace('_', '-')} declares no range"
            for bad in (math.nan, math.inf, -math.inf):
                with pytest.raises(ValueError, match="--" + field_name.replace("_", "-")):
                    check_numeric_options(dataclasses.replace(config, **{field_name: bad}), name)
        if "kd_temperature" in {f.name for f in dataclasses.fields(config_class)}:
            with pytest.raises(ValueError, match=r"--kd-temperature must be > 0"):
                check_numeric_options(dataclasses.replace(config, kd_temperature=0.0), name)


@pytest.mark.parametrize("field_name, bad, good", [
    ("label_smoothing", 1.0, 0.0), ("label_smoothing", -0.1, 0.99), ("word_rate", 0.0, 1.0),
    ("a2d_alpha", 1.5, 1.0), ("a2d_lambda_decay", 0.0, 1.0), ("kd_weight", -0.5, 0.0),
    ("tinybert_att_weight", -1.0, 0.0), ("a2d_lambda", -1.0, 0.0), ("queue_size", 0, 1),
])
def test_ranges(field_name, bad, good):
    from fairseq_kd.criterions.base import check_numeric_options

    with pytest.raises(ValueError, match="--" + field_name.replace("_", "-") + " must be (in|>)"):
        check_numeric_options({field_name: bad})
    check_numeric_options({field_name: good})


@pytest.mark.parametrize("flags, fragment", [
    (["--kd-temperature", "nan"], "--kd-temperature must be a finite number"),
    (["--label-smoothing", "1.5"], "--label-smoothing must be in [0, 1)"),
])
def test_bad_numbers_are_refused_at_start_up(tiny_data_bin, tiny_teacher, tmp_path, flags, fragment):
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path / "s", ["--criterion", "word_kd", *flags], refused=True)
    assert proc.returncode != 0 and fragment in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "s" / "checkpoint_last.pt").exists()


def test_teacher_shorter_than_the_task_limits_is_refused(tiny_data_bin, tiny_teacher, tmp_path):
    proc = train_student(tiny_data_bin, tiny_teacher, tmp_path / "s", ["--criterion", "word_kd"],
                         extra=["--max-source-positions", "2048"], check=False)
    assert proc.returncode != 0
    for fragment in ("reads at most 1024 source positions", "--max-source-positions 2048",
                     "Pass --max-source-positions 1024"):
        assert fragment in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "s" / "checkpoint_last.pt").exists()


# --------------------------------------------------------------------------- export into a folder


def test_export_into_a_folder_writes_a_named_file(tiny_teacher, tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    summary = json.loads(run_module("fairseq_kd.cli.export_student", tiny_teacher, str(folder) + "/",
                                    "--overwrite", warm=True).stdout)
    written = folder / tiny_teacher.name
    assert summary["output"] == str(written) and written.is_file()
    # an existing folder given without the trailing slash: the same file, which now exists
    proc = run_module("fairseq_kd.cli.export_student", tiny_teacher, folder, check=False, warm=True)
    assert proc.returncode != 0 and str(written) in proc.stderr and "--overwrite" in proc.stderr
    run_module("fairseq_kd.cli.export_student", tiny_teacher, folder, "--overwrite", warm=True)
    # never onto its input
    proc = run_module("fairseq_kd.cli.export_student", tiny_teacher, tiny_teacher.parent, "--overwrite",
                      check=False, warm=True)
    assert proc.returncode != 0 and "is the input checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
