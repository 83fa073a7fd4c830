"""The accumulator of stateful criterions (criterions/epoch_sums.py EpochSums): float64 sums that survive
a checkpoint, kept when a resumed run begins the same epoch again, emptied by a new epoch."""
import torch

from fairseq_kd.criterions.epoch_sums import EpochSums


def test_sums_survive_a_resume_within_the_epoch_and_reset_at_the_next():
    sums = EpochSums()
    sums.begin_epoch(3)
    sums.add("a", torch.tensor([1.0, 2.0], dtype=torch.float32))
    sums.add("a", torch.tensor([0.5, 0.25], requires_grad=True))
    assert sums.sums["a"].dtype == torch.float64 and not sums.sums["a"].requires_grad
    assert sums.sums["a"].tolist() == [1.5, 2.25]
    resumed = EpochSums()
    resumed.load_state(sums.state())
    resumed.begin_epoch(3)  # the trainer begins the interrupted epoch again
    assert resumed.sums["a"].tolist() == [1.5, 2.25]
    resumed.begin_epoch(4)
    assert resumed.sums == {} and resumed.epoch == 4
