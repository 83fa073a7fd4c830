"""Teacher data beyond the 1-best for sequence-level KD: which of the teacher's n-best hypotheses
of a source become training targets, and which (source, hypothesis) pairs the cross-entropy
filter removes. ``best``: the teacher's order (Kim & Rush 2016); ``chrf``/``bleu``: sacreBLEU's
sentence chrF / BLEU against the pair's reference (mozilla/translations); ``mbr``: the mean chrF
against the other hypotheses (minimum Bayes risk, Finkelstein et al. 2023). Ties keep the
teacher's order. Rationale and references: ``docs/design/teacher_passes.md``.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from ..scoring.detok import BPE_SCHEMES, remove_bpe

SELECTIONS = ("best", "chrf", "bleu", "mbr")


def selection_problem(config) -> Optional[str]:
    """What is wrong with the n-best flags of a ``SeqKDConfig``, in one line (None: nothing)."""
    if not 1 <= config.nbest <= config.beam:
        return f"--nbest must be between 1 and --beam ({config.beam}), got {config.nbest}"
    if config.select not in SELECTIONS:
        return f"--select {config.select!r}: choose one of {', '.join(SELECTIONS)}"
    if config.select != "best" and config.nbest < 2:
        return f"--select {config.select} chooses among the n-best: give --nbest 2 or more"
    if config.select != "best" and config.remove_bpe not in BPE_SCHEMES:
        return (f"--select {config.select} compares text: give --remove-bpe, one of {', '.join(BPE_SCHEMES)} "
                f"(how --data's subwords are undone), got {config.remove_bpe}")
    if not 1 <= config.keep_hypotheses <= config.nbest:
        return f"--keep-hypotheses must be between 1 and --nbest ({config.nbest}), got {config.keep_hypotheses}"
    if config.filter_max_ce is not None and config.filter_keep_share is not None:
        return "give --filter-max-ce or --filter-keep-share, not both"
    if config.filter_max_ce is not None and not 0 <= config.filter_max_ce < math.inf:
        return f"--filter-max-ce must be a cross-entropy >= 0, got {config.filter_max_ce}"
    if config.filter_keep_share is not None and not 0 < config.filter_keep_share <= 1:
        return f"--filter-keep-share must be in (0, 1], got {config.filter_keep_share}"
    return None


def utilities(select: str, hypotheses: Sequence[str], reference: Optional[str] = None) -> List[float]:
    """Each hypothesis' utility under ``select`` (higher is better), in the teacher's order."""
    from sacrebleu.metrics import BLEU, CHRF

    if select == "best":
        return [0.0] * len(hypotheses)
    if select in ("chrf", "bleu"):
        metric = CHRF() if select == "chrf" else BLEU(effective_order=True)  # sentence_chrf's / sentence_bleu's
        return [metric.sentence_score(hypothesis, [reference]).score for hypothesis in hypotheses]
    if select != "mbr":
        raise ValueError(f"unknown selection {select!r}")
    chrf, count = CHRF(), len(hypotheses)
    return [sum(chrf.sentence_score(hypothesis, [other]).score for j, other in enumerate(hypotheses) if j != i)
            / max(count - 1, 1) for i, hypothesis in enumerate(hypotheses)]


def ranking(values: Sequence[float]) -> List[int]:
    """Indices by decreasing utility, ties in increasing index (the teacher's rank)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def choose(config, dictionary, scored: Sequence[Tuple[torch.Tensor, float]], reference=None) -> list:
    """``(teacher rank, tokens, cross-entropy)`` of the ``--keep-hypotheses`` best by ``--select``
    of one source's ``scored`` n-best (``(tokens, cross-entropy)``, the teacher's order)."""
    order = range(len(scored))
    if config.select != "best":
        def text(tokens):
            return remove_bpe(dictionary.string(tokens), config.remove_bpe)

        order = ranking(utilities(config.select, [text(tokens) for tokens, _ in scored],
                                  text(reference) if config.select != "mbr" else None))
    return [(rank, *scored[rank]) for rank in list(order)[:config.keep_hypotheses]]


def kept_by_cross_entropy(cross_entropy: Sequence[float], max_ce: Optional[float] = None,
                          keep_share: Optional[float] = None) -> List[bool]:
    """Which pairs the filter keeps: those of cross-entropy at most ``max_ce``, or the
    ``keep_share`` of them (the nearest whole number, halves up) of lowest cross-entropy, ties
    in order; all without either."""
    if max_ce is not None:
        return [value <= max_ce for value in cross_entropy]
    if keep_share is None:
        return [True] * len(cross_entropy)
    kept = set(ranking([-value for value in cross_entropy])[:int(math.floor(keep_share * len(cross_entropy) + 0.5))])
    return [i in kept for i in range(len(cross_entropy))]


@torch.no_grad()
def teacher_cross_entropy(model, sample: dict, hypotheses: Sequence[torch.Tensor], per_source: int, pad: int,
                          eos: int) -> torch.Tensor:
    """The teacher's per-token cross-entropy (nats, ``</s>`` included) of each hypothesis under
    teacher forcing; hypotheses ``per_source`` at a time for each source row of ``sample``."""
    from fairseq.data import data_utils

    net_input = sample["net_input"]
    device = net_input["src_tokens"].device
    target = data_utils.collate_tokens([h.long() for h in hypotheses], pad, eos).to(device)
    previous = data_utils.collate_tokens([h.long() for h in hypotheses], pad, eos, move_eos_to_beginning=True)
    logits = model(net_input["src_tokens"].repeat_interleave(per_source, 0),
                   net_input["src_lengths"].repeat_interleave(per_source, 0), previous.to(device))[0]
    nll = -torch.log_softmax(logits.float(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    mask = target.ne(pad)
    return (nll.masked_fill(~mask, 0.0).sum(1) / mask.sum(1)).cpu()
