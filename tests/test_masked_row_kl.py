"""The one masked row-wise KL (criterions/losses.py) against a slow loop over rows and entries."""
import math

import pytest
import torch

from fairseq_kd.criterions.losses import masked_row_kl


def slow_row_kl(p, q, mask):
    """sum over True entries of p log(p / q), one value per row (0 log 0 = 0)."""
    rows = []
    for row_p, row_q, row_mask in zip(p.reshape(-1, p.size(-1)), q.reshape(-1, q.size(-1)),
                                      mask.expand_as(p).reshape(-1, p.size(-1))):
        rows.append(sum(float(a) * math.log(float(a) / float(b))
                        for a, b, keep in zip(row_p, row_q, row_mask) if keep and a > 0))
    return torch.tensor(rows).reshape(p.shape[:-1])


def masked_softmax(logits, mask):
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)


def test_masked_row_kl_matches_a_slow_loop_and_ignores_masked_entries():
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])[None]  # (1, 3, 3)
    teacher_logits = torch.randn(2, 3, 3, generator=generator)
    student_logits = torch.randn(2, 3, 3, generator=generator)
    p, q = masked_softmax(teacher_logits, mask), masked_softmax(student_logits, mask)
    log_q = torch.where(mask, q.clamp_min(1e-30).log(), 1e9)  # garbage outside the mask
    expected = slow_row_kl(p, q, mask)
    by_probs = masked_row_kl(log_q, mask, teacher_probs=torch.where(mask, p, 7.0))
    by_logs = masked_row_kl(log_q, mask, teacher_log_probs=torch.where(mask, p.clamp_min(1e-30).log(), 5.0))
    torch.testing.assert_close(by_probs, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(by_logs, expected, rtol=1e-5, atol=1e-6)
    assert by_probs[:, 2].eq(0).all()  # a row with no True entry (a padded query) is exactly 0
    assert by_probs[:, 1].eq(0).all()  # a one-entry row: both distributions are that entry
    with pytest.raises(ValueError, match="exactly one"):
        masked_row_kl(log_q, mask)
