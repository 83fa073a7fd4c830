"""Selective knowledge distillation (Wang et al. 2021, "Selective Knowledge Distillation for Neural
Machine Translation", ACL-IJCNLP).

    loss = (1 - a) L_CE + a L_KD(selected tokens)

Word-level KD applies only to the hardest fraction ``r`` (``--word-rate``) of the real target
tokens, ranked by the student's detached ``-log p_S(y_t)``; CE applies to every token, so
``--word-rate 1`` is word-level KD. ``--selection batch`` (BLS) takes the ``ceil(r N)`` hardest tokens
of the batch, ties broken by position; ``global`` (GLS) those whose CE reaches the ``(1 - r)``
quantile (an order statistic, ties included) of a FIFO queue of the most recent ``--queue-size``
values, gathered from every data-parallel worker and saved with the checkpoint. Deviations and
details (warm-up, validation, dummy batches, resume): ``docs/methods/selective_kd.md``.
"""
import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import metrics
from torch import Tensor

from .method import DistillationTerms
from .config import ranged
from .chunked import chunked_logsumexp
from .word_kd import WordKDConfig, WordKDCriterion

logger = logging.getLogger(__name__)

SELECTION_CHOICES = ChoiceEnum(["batch", "global"])


@dataclass
class SelectiveKDConfig(WordKDConfig):
    word_rate: float = ranged(
        0.5, 0.0, 1.0, low_open=True, meaning="the share of words distilled",
        help="fraction r in (0, 1] of target tokens, the hardest by the student's CE, that receive "
        "word-level KD (Align-to-Distill: 0.5); 1 is word_kd",
    )
    selection: SELECTION_CHOICES = field(
        default="batch",
        metadata={"help": "'batch': the top r of each batch's tokens; 'global': tokens whose CE "
                  "reaches the (1-r) quantile of a FIFO queue of recent CE values (Wang et al. 2021)"},
    )
    queue_size: int = ranged(
        30000, 1, meaning="a number of tokens",
        help="number of recent token CE values kept by --selection global, summed over all "
        "data-parallel workers (Wang et al. 2021: 30,000)",
    )


# ------------------------------------------------------------------ selection (pure functions)
def token_cross_entropy(student_logits: Tensor, target: Tensor, rows: Optional[int] = None) -> Tensor:
    """``-log p_S(y_t) = logsumexp(z) - z[y]`` per position, ``(batch, tgt_len)``, float32, detached
    (ranking only), without a (positions, vocabulary) log-softmax; ``rows``: for tests."""
    with torch.no_grad():
        logits = student_logits.detach()
        return chunked_logsumexp(logits, rows) - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1).float()


def selection_count(word_rate: float, total: int) -> int:
    """``ceil(r * total)``; the product is rounded to 9 decimals first so that e.g. 0.3 * 10 counts
    as 3, not 4, despite binary floating point."""
    return min(total, math.ceil(round(word_rate * total, 9)))


def select_batch_level(token_ce: Tensor, target_mask: Tensor, word_rate: float) -> Tensor:
    """Mask of the ``ceil(r * N)`` real tokens with the highest CE; ties go to the earlier token in
    row-major order (stable sort), so the count is exact."""
    values = token_ce[target_mask]
    chosen = torch.zeros_like(values, dtype=torch.bool)
    k = selection_count(word_rate, values.numel())
    if k > 0:
        order = torch.sort(values, descending=True, stable=True).indices
        chosen[order[:k]] = True
    selected = torch.zeros_like(target_mask)
    selected[target_mask] = chosen
    return selected


def push_to_queue(queue: Tensor, values: Tensor, queue_size: int) -> Tensor:
    """Append ``values`` (oldest first) to the FIFO ``queue`` and keep the newest ``queue_size``."""
    return torch.cat([queue.to(values.device), values.float()])[-queue_size:]


def queue_threshold(queue: Tensor, word_rate: float) -> Tensor:
    """The ``k``-th largest queue value, ``k = ceil(r * |Q|)``: the (1 - r) quantile as an order
    statistic (no interpolation). ``+inf`` for an empty queue (nothing selected)."""
    size = queue.numel()
    if size == 0:
        return torch.tensor(float("inf"), device=queue.device)
    k = selection_count(word_rate, size)
    return torch.kthvalue(queue, size - k + 1).values


def select_global_level(token_ce: Tensor, target_mask: Tensor, threshold: Tensor) -> Tensor:
    """Real tokens whose CE reaches the threshold (ties with it included)."""
    return target_mask & (token_ce >= threshold)


def gather_from_workers(values: Tensor) -> Tensor:
    """Concatenation, in rank order, of every data-parallel worker's 1-D ``values`` (of any length:
    padded to the longest for ``all_gather``); ``values`` itself with one worker."""
    group = distributed_utils.get_data_parallel_group()
    if distributed_utils.get_world_size(group) <= 1:
        return values
    count = torch.tensor([values.numel()], dtype=torch.long, device=values.device)
    counts = [int(c.item()) for c in distributed_utils.all_gather(count, group)]
    longest = max(counts)
    if longest == 0:
        return values
    padded = values.new_zeros(longest)
    padded[: values.numel()] = values
    gathered = distributed_utils.all_gather(padded, group)
    return torch.cat([part[:n] for part, n in zip(gathered, counts)])


# ------------------------------------------------------------------------------- criterion
@register_criterion("selective_kd", dataclass=SelectiveKDConfig)
class SelectiveKDCriterion(WordKDCriterion):
    """Word-level KD restricted to the hardest tokens; see the module docstring."""

    TERM_NAMES = ("selective_kd",)
    KD_TERM = "selective_kd"
    WEIGHT_FLAGS = {"ce": "1 - --kd-weight", "selective_kd": "--kd-weight"}
    LOG_KEYS = ("kd_selected_tokens",)

    def __init__(self, cfg: SelectiveKDConfig, task):
        super().__init__(cfg, task)
        self.word_rate = cfg.word_rate
        self.selection = str(cfg.selection)
        self.queue_size = cfg.queue_size
        self.queue = torch.zeros(0)

    def loss_weights(self):
        return {"ce": 1.0 - self.kd_weight, "selective_kd": self.kd_weight}

    def select(self, token_ce: Tensor, target_mask: Tensor) -> Tensor:
        """Which real target tokens receive KD in this batch (updates the queue in training)."""
        if self.selection == "batch":
            return select_batch_level(token_ce, target_mask, self.word_rate)
        local_values = token_ce[target_mask]
        if self.is_dummy_batch:
            local_values = local_values[:0]
        if self.training:
            self.queue = push_to_queue(self.queue, gather_from_workers(local_values), self.queue_size)
            queue = self.queue
        else:
            queue = push_to_queue(self.queue, local_values, self.queue_size)
        return select_global_level(token_ce, target_mask, queue_threshold(queue, self.word_rate))

    def kd_positions(self, batch):
        """The selected tokens, chosen (and the queue updated) once per forward pass."""
        return self.select(token_cross_entropy(batch.student_logits, batch.sample["target"]), batch.target_mask)

    def terms(self, batch):
        return DistillationTerms({}, logs={"kd_selected_tokens": batch.kd_mask.sum().data})

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        tokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        if tokens > 0:
            selected = utils.item(sum(log.get("kd_selected_tokens", 0) for log in logging_outputs))
            # the fraction of target tokens that received KD (== word rate for batch selection)
            metrics.log_scalar("kd_selected_rate", selected / tokens, tokens, round=3)

    # ----------------------------------------------------------------- checkpointing
    def checkpoint_state(self) -> dict:
        if self.selection != "global":
            return {}
        return {"selective_kd_queue": self.queue.detach().cpu().clone()}

    def load_checkpoint_state(self, state: dict) -> None:
        if self.selection != "global":
            return
        saved = state.get("selective_kd_queue")
        if saved is None:
            logger.warning("selective_kd: the checkpoint holds no CE queue; global selection starts empty")
            return
        if saved.numel() > self.queue_size:
            logger.warning(
                f"selective_kd: the checkpoint's queue holds {saved.numel()} values but --queue-size is "
                f"{self.queue_size}; keeping the most recent {self.queue_size}"
            )
        self.queue = saved.float()[-self.queue_size:].clone()
        logger.info(
            f"selective_kd: restored the global CE queue: {self.queue.numel()} values, "
            f"sum {self.queue.double().sum().item():.6f}"
        )
