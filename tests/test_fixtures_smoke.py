from conftest import build_tiny_student


def test_fixtures_build_teacher_student_and_batch(kd_task, tiny_batch):
    student = build_tiny_student(kd_task)
    assert kd_task.teacher.shape.encoder_layers == 3 and kd_task.student_shape.encoder_layers == 2
    out = student(**tiny_batch["net_input"])
    assert out[0].shape[:2] == tiny_batch["target"].shape
    # left-padded source, right-padded target
    pad = kd_task.source_dictionary.pad()
    assert tiny_batch["net_input"]["src_tokens"][2, 0] == pad
    assert tiny_batch["target"][2, -1] == pad
