"""Loading a teacher leaves torch's random state untouched, so the student fairseq-train builds after
the task (same --seed) starts from the same weights whatever the teacher: a fairseq checkpoint, the
same teacher as a Hugging Face folder, or none (the no-KD baseline)."""
import torch
from float_bounds import float32_reordering_tolerance

from fairseq_kd.tasks.translation_kd import load_teacher


def draws_after(seed: int, action) -> torch.Tensor:
    torch.manual_seed(seed)
    action()
    return torch.rand(8)


def test_fairseq_teacher_leaves_the_random_state(kd_task, tiny_teacher):
    untouched = draws_after(5, lambda: None)
    assert torch.equal(draws_after(5, lambda: load_teacher(str(tiny_teacher), kd_task)), untouched)


def test_teacher_output_projection_and_first_layers_get_contiguous_inputs(kd_task, tiny_batch):
    """fairseq hands the decoder's output projection and each side's first layer a transposed view;
    with frozen weights torch.matmul would run a batched product against the expanded weight (2.3x
    slower on CPU at a real vocabulary). In the teacher those modules see contiguous inputs, and its
    output equals the model's own forward pass."""
    from fairseq_kd.models.feature_capture import CaptureRequest

    teacher = kd_task.teacher
    projection = teacher.model.decoder.output_projection
    first_layers = (teacher.model.encoder.layers[0], teacher.model.decoder.layers[0])
    seen = []
    handles = [module.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
               for module in (projection, *first_layers)]
    try:
        net_output, _ = teacher.forward(tiny_batch["net_input"], CaptureRequest())
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [True, True, True]
    hooks = {module: dict(module._forward_pre_hooks) for module in teacher.model.modules()}
    for module in hooks:
        module._forward_pre_hooks.clear()
    try:
        with torch.no_grad():
            unhooked = teacher.model(**tiny_batch["net_input"])[0]
        # unhooked, these modules really do get non-contiguous inputs (else this test shows nothing)
        seen.clear()
        handles = [module.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
                   for module in (projection, *first_layers)]
        try:
            with torch.no_grad():
                teacher.model(**tiny_batch["net_input"])
        finally:
            for handle in handles:
                handle.remove()
        assert seen == [False, False, False]
    finally:
        for module, module_hooks in hooks.items():
            module._forward_pre_hooks.update(module_hooks)
    # contiguous inputs take another matmul (and its order of sums) than the transposed views
    torch.testing.assert_close(net_output[0], unhooked, rtol=1e-5, atol=float32_reordering_tolerance(unhooked))


def test_teacher_hooks_only_the_modules_fed_transposed_views_and_only_once(kd_task):
    """A hook sends every call of its module through torch's slower hooked path (beam search makes
    many small calls): the teacher hooks its Transformer layers and output projection only, and a
    teacher built on a copy of a hooked model (deepcopy copies hooks) does not hook it twice."""
    import copy

    from fairseq_kd.models.teacher import FrozenTeacher, _contiguous_input

    def hooked(model):
        return {name for name, module in model.named_modules() if _contiguous_input in module._forward_pre_hooks.values()}

    model = kd_task.teacher.model
    layers = {f"{side}.layers.{i}" for side in ("encoder", "decoder") for i in range(len(getattr(model, side).layers))}
    assert hooked(model) == layers | {"decoder.output_projection"}
    again = FrozenTeacher(copy.deepcopy(model), path="")
    assert all(list(module._forward_pre_hooks.values()).count(_contiguous_input) <= 1 for module in again.model.modules())
    assert hooked(again.model) == hooked(model)


def test_a_teacher_whose_weights_do_not_fit_its_config_is_one_line_with_counts(kd_task, tiny_teacher, tmp_path):
    """A fairseq teacher missing a layer's tensors, holding extra ones and one of another shape is
    refused in one line that counts each kind and names the first, not torch's list of every key."""
    import pytest

    from fairseq_kd.checkpoints import safe_load
    from fairseq_kd.models.teacher import FrozenTeacher, TeacherCheckpointError

    state = safe_load(tiny_teacher)
    weights = state["model"]
    dropped = sorted(key for key in weights if key.startswith("encoder.layers.2."))
    for key in dropped:
        del weights[key]
    weights["encoder.extra.weight"] = torch.zeros(2)
    weights["decoder.layers.0.fc1.bias"] = torch.zeros(3)
    damaged = tmp_path / "damaged.pt"
    torch.save(state, damaged)
    with pytest.raises(TeacherCheckpointError) as refused:
        FrozenTeacher.load(str(damaged), kd_task)
    message = str(refused.value)
    assert "\n" not in message and len(message) < 600, message
    assert f"{len(dropped)} missing tensors (first: encoder.layers.2." in message, message
    assert "1 unexpected tensor (first: encoder.extra.weight)" in message, message
    assert "1 of another shape (first: decoder.layers.0.fc1.bias: [3] in the checkpoint, [64] in the model)" in message


def test_a_corrupt_value_in_a_teachers_config_is_one_line_naming_the_file_and_key(kd_task, tiny_teacher, tmp_path):
    """A teacher whose config says ``encoder_layers: "three"`` is a user error (issue 41, 6): one line
    naming the file and the key, not fairseq's TypeError from deep inside building the model."""
    import pytest

    from fairseq_kd.errors import UserError
    from fairseq_kd.models.teacher import FrozenTeacher, TeacherCheckpointError

    state = torch.load(tiny_teacher, weights_only=False)
    state["cfg"]["model"].encoder_layers = "three"
    damaged = tmp_path / "three.pt"
    torch.save(state, damaged)
    with pytest.raises(TeacherCheckpointError) as refused:
        FrozenTeacher.load(str(damaged), kd_task)
    message = str(refused.value)
    assert isinstance(refused.value, UserError) and "\n" not in message, message
    assert str(damaged) in message and "encoder_layers is 'three', not a number" in message, message


def test_the_model_and_task_errors_a_user_can_fix_are_user_errors():
    """Issue 41's rule: what a user's input causes is one of the plugin's UserError classes (and the
    built-in class callers catch); a broken invariant of the plugin is not."""
    from fairseq_kd.errors import FileAccessError, MissingDependencyError, UserError
    from fairseq_kd.models.feature_capture import NotATransformerError
    from fairseq_kd.models.from_checkpoint import CheckpointModelError, ModelConfigError, WeightsMismatchError
    from fairseq_kd.models.hf_teacher import TransformersMissingError
    from fairseq_kd.models.hf_vocabulary import VocabularyError
    from fairseq_kd.models.teacher import TeacherCheckpointError

    for kind in (TeacherCheckpointError, CheckpointModelError, ModelConfigError, WeightsMismatchError,
                 VocabularyError, NotATransformerError, TransformersMissingError):
        assert issubclass(kind, UserError) and issubclass(kind, ValueError), kind
    assert issubclass(NotATransformerError, TypeError)
    assert issubclass(TransformersMissingError, MissingDependencyError)
    assert issubclass(FileAccessError, OSError)


def test_a_teacher_dictionary_that_is_no_text_is_one_line_naming_the_file(kd_task, tiny_teacher, tiny_data_bin, tmp_path):
    """--teacher-data's dict.LANG.txt holding binary data (or a line fairseq cannot read) is a user
    error naming the file, not fairseq's UnicodeDecodeError or ValueError."""
    import shutil

    import pytest

    from fairseq_kd.errors import UserError
    from fairseq_kd.models.teacher import FrozenTeacher, TeacherCheckpointError

    for name, content in (("binary", b"\x00\xff\xfe\x00 1\n"), ("malformed", b"w1\n")):
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(tiny_data_bin / "dict.tgt.txt", folder / "dict.tgt.txt")
        (folder / "dict.src.txt").write_bytes(content)
        with pytest.raises(TeacherCheckpointError) as refused:
            FrozenTeacher.load(str(tiny_teacher), kd_task, teacher_data=str(folder))
        message = str(refused.value)
        assert isinstance(refused.value, UserError) and "\n" not in message, message
        assert str(folder / "dict.src.txt") in message, message


def test_a_file_that_is_no_fairseq_checkpoint_is_one_line_and_a_bug_keeps_its_traceback(
        kd_task, tiny_teacher, tmp_path, monkeypatch):
    """A teacher file cut short, text, a pickle of something else and another program's dict are one
    line naming the file, from the errors torch's reader and fairseq's upgrade of old checkpoints
    raise for them; any other error of the loading code (a bug) keeps its own class and traceback."""
    import pickle

    import pytest

    import fairseq_kd.models.from_checkpoint as from_checkpoint
    from fairseq_kd.errors import UserError
    from fairseq_kd.models.teacher import FrozenTeacher, TeacherCheckpointError

    whole = open(tiny_teacher, "rb").read()
    (tmp_path / "cut_short.pt").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "text.pt").write_bytes("a text file\n".encode())
    torch.save([1, 2, 3], tmp_path / "a_list.pt")
    (tmp_path / "plain_pickle.pt").write_bytes(pickle.dumps({"cfg": None, "model": {}}))
    torch.save({"state_dict": {"weight": torch.zeros(2)}}, tmp_path / "foreign_dict.pt")
    torch.save({"cfg": {"task": {}}, "model": {}, "optimizer_history": [{"best_loss": 1.0}],
                "extra_state": {"train_iterator": None}}, tmp_path / "no_model_config.pt")
    for name in ("cut_short", "empty", "text", "a_list", "plain_pickle", "foreign_dict", "no_model_config"):
        path = str(tmp_path / f"{name}.pt")
        with pytest.raises(TeacherCheckpointError) as refused:
            FrozenTeacher.load(path, kd_task)
        message = str(refused.value)
        assert isinstance(refused.value, UserError) and "\n" not in message, message
        assert message.startswith(f"--teacher-checkpoint {path!r}") and "fairseq" in message, message

    def a_bug(*args, **kwargs):
        return 1 / 0

    monkeypatch.setattr(from_checkpoint, "load_fairseq_checkpoint", a_bug)
    with pytest.raises(ZeroDivisionError):
        FrozenTeacher.load(str(tiny_teacher), kd_task)
