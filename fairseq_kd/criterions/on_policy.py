"""On-policy distillation (GKD: Agarwal et al., ICLR 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes"), for encoder-decoder students:

    L = (1 - lambda) E_(x,y)~data [L_method(x, y)] + lambda E_x E_y~p_S(.|x) [sum_i w_i L_i(x, y)]

For a share lambda (``--on-policy-rate``) of the training batches the student generates y without
gradient (eval mode, incremental decoding, sampled at ``--on-policy-temperature`` or greedy, at
most ``a * src_len + b`` tokens before EOS); y replaces the batch's target and teacher and student
score it under teacher forcing. The method's terms are taken at every generated position, CE is
not (y is no reference). Which batches, and the samples, are functions of torch's seed for the
update (fairseq sets ``--seed`` + the update number) and the batch's sentence ids: the same after a
resume and on any number of ranks. Choices and deviations: docs/methods/on_policy.md.
"""
import hashlib
import math
from typing import List, Optional, Tuple

import torch
from fairseq.logging import metrics
from torch import Tensor

from ..errors import InputError

#: criterions whose terms need the reference target, and why (refused with --on-policy-rate)
NEEDS_REFERENCE = {"selective_kd": "it chooses the tokens to distil by the student's CE against the reference"}


class OnPolicy:
    """The on-policy part of a criterion: which training batches, and their generated sample."""

    def __init__(self, cfg, pad: int, eos: int):
        self.rate = float(cfg.on_policy_rate)
        self.greedy = str(cfg.on_policy_sampling) == "greedy"
        self.temperature = float(cfg.on_policy_temperature)
        self.max_len = (float(cfg.on_policy_max_len_a), int(cfg.on_policy_max_len_b))
        self.pad, self.eos = pad, eos

    @classmethod
    def from_config(cls, cfg, criterion) -> Optional["OnPolicy"]:
        """None when ``--on-policy-rate`` is 0; refuses what cannot score the student's sequences."""
        if not float(getattr(cfg, "on_policy_rate", 0.0)):
            return None
        name = criterion.criterion_name()
        if criterion.teacher_cache is not None:
            raise InputError("--on-policy-rate cannot read --teacher-cache: the cache holds the teacher on the "
                             "reference targets, not on the student's own outputs; use the live teacher "
                             "(--teacher-checkpoint) or --on-policy-rate 0")
        if name in NEEDS_REFERENCE:
            raise InputError(f"--on-policy-rate does not combine with --criterion {name}: {NEEDS_REFERENCE[name]}, "
                             "and a generated target is none; use word_kd or --on-policy-rate 0")
        return cls(cfg, criterion.padding_idx, criterion.task.target_dictionary.eos())

    def chosen(self, model, sample, source: Optional[str], dummy: bool) -> bool:
        """Whether this batch is on-policy: a training batch with a live teacher signal, drawn with
        probability ``rate`` from :func:`batch_seed`."""
        if source != "live" or not model.training or dummy:
            return False
        draw = torch.Generator().manual_seed(batch_seed(torch.initial_seed(), sample["id"]))
        return bool(torch.rand((), generator=draw) < self.rate)

    def generated_sample(self, model, sample) -> dict:
        """A copy of ``sample`` whose target is the student's own output (the caller's unchanged)."""
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        generator = torch.Generator(device=src_tokens.device)
        generator.manual_seed(batch_seed(torch.initial_seed(), sample["id"], 1))
        tokens = generate(model, src_tokens, net_input["src_lengths"], self.pad, self.eos, *self.max_len,
                          None if self.greedy else self.temperature, generator)
        return with_target(sample, tokens, self.pad, self.eos)

    @staticmethod
    def logs(sample, on_policy: bool, sample_size) -> dict:
        """The batch's on-policy sentences, tokens and sample size (0 on a reference batch)."""
        if not on_policy:
            return {"on_policy": 0, "on_policy_ntokens": 0, "on_policy_sample_size": 0}
        return {"on_policy": sample["target"].size(0), "on_policy_ntokens": sample["ntokens"],
                "on_policy_sample_size": sample_size}


def batch_seed(seed: int, ids: Tensor, stream: int = 0) -> int:
    """A 63-bit seed from torch's seed for the update and the batch's sentence ids (not from a
    random stream, which a resume or another rank layout would shift); ``stream`` separates the
    batch's draws."""
    digest = hashlib.blake2b(f"{int(seed)}:{stream}:".encode() + ids.detach().cpu().long().numpy().tobytes(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def generate(model, src_tokens: Tensor, src_lengths: Tensor, pad: int, eos: int, max_len_a: float,
             max_len_b: int, temperature: Optional[float], generator: Optional[torch.Generator] = None) -> Tensor:
    """The student's outputs for a batch, ``(batch, length)``: tokens, EOS, then padding. Each
    sentence has at most ``int(a * src_len + b)`` tokens before EOS (``src_len`` without padding and
    EOS, fairseq's convention, but per sentence) and the decoder's positions allow; EOS is forced
    there. Sampled from ``softmax(logits / temperature)`` with ``generator``, or greedy (None);
    never padding. In eval mode (no dropout), the model's mode restored after."""
    source_length = (src_tokens.ne(pad) & src_tokens.ne(eos)).sum(1)
    max_positions = getattr(model, "max_decoder_positions", lambda: None)()
    max_lens = (max_len_a * source_length.double() + max_len_b).floor().long()
    if max_positions:
        max_lens = max_lens.clamp(max=max_positions - 1)
    tokens = src_tokens.new_full((src_tokens.size(0), int(max_lens.max()) + 2), pad)
    tokens[:, 0] = eos
    done = torch.zeros_like(source_length, dtype=torch.bool)
    training = model.training
    model.eval()
    try:
        encoder_out = model.encoder(src_tokens, src_lengths=src_lengths)
        state = {}
        for step in range(tokens.size(1) - 1):
            logits = model.decoder(tokens[:, :step + 1], encoder_out=encoder_out, incremental_state=state)[0]
            logits = logits[:, -1].float()
            logits[:, pad] = -math.inf
            if temperature is None:
                word = logits.argmax(-1)
            else:  # shifted by the maximum first: a tiny temperature divides zero, not a large logit
                shifted = (logits - logits.max(-1, keepdim=True)[0]) / temperature
                word = torch.multinomial(torch.softmax(shifted, -1), 1, generator=generator).squeeze(1)
            word = torch.where(max_lens.le(step), torch.full_like(word, eos), word).masked_fill(done, pad)
            tokens[:, step + 1] = word
            done |= word.eq(eos)
            if bool(done.all()):
                break
    finally:
        model.train(training)
    return tokens[:, 1:step + 2]


def with_target(sample: dict, target: Tensor, pad: int, eos: int) -> dict:
    """A shallow copy of ``sample`` with ``target`` (right-padded, EOS-terminated), its decoder
    input (EOS, then the target shifted right, fairseq's convention) and token count."""
    shifted = target[:, :-1].masked_fill(target[:, :-1].eq(eos), pad)
    prev_output_tokens = torch.cat([target.new_full((target.size(0), 1), eos), shifted], 1)
    net_input = dict(sample["net_input"], prev_output_tokens=prev_output_tokens)
    return dict(sample, target=target, net_input=net_input, ntokens=int(target.ne(pad).sum()))


def reduce_on_policy(logging_outputs) -> Tuple[List[dict], float]:
    """For the criterion's reduce: logs the share of on-policy sentences (``on_policy``) and their
    mean generated length (``gen_len``, EOS included); returns the logging outputs with ``ntokens``
    counting the reference batches' tokens only (fairseq's nll is over those), and CE's sample size
    (the reference batches'). Unchanged, and the whole sample size, on a step without reference."""
    sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
    if not any("on_policy" in log for log in logging_outputs):
        return logging_outputs, sample_size
    sentences = sum(log.get("nsentences", 0) for log in logging_outputs)
    generated = sum(log.get("on_policy", 0) for log in logging_outputs)
    if sentences:
        metrics.log_scalar("on_policy", generated / sentences, sentences, round=3)
    if generated:
        tokens = sum(log.get("on_policy_ntokens", 0) for log in logging_outputs)
        metrics.log_scalar("gen_len", tokens / generated, generated, round=2)
    reference = [dict(log, ntokens=log.get("ntokens", 0) - log.get("on_policy_ntokens", 0)) for log in logging_outputs]
    if not sum(log["ntokens"] for log in reference):
        return logging_outputs, sample_size
    return reference, sample_size - sum(log.get("on_policy_sample_size", 0) for log in logging_outputs)
