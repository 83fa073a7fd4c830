"""Loading a teacher leaves torch's random state untouched, so the student fairseq-train builds after
the task (same --seed) starts from the same weights whatever the teacher: a fairseq checkpoint, the
same teacher as a Hugging Face folder, or none (the no-KD baseline)."""
import torch

from fairseq_kd.tasks.translation_kd import load_teacher


def draws_after(seed: int, action) -> torch.Tensor:
    torch.manual_seed(seed)
    action()
    return torch.rand(8)


def test_fairseq_teacher_leaves_the_random_state(kd_task, tiny_teacher):
    untouched = draws_after(5, lambda: None)
    assert torch.equal(draws_after(5, lambda: load_teacher(str(tiny_teacher), kd_task)), untouched)
