"""Decoding fairseq-binarised data with a Hugging Face teacher's own ``generate``: ids in, ids out.

The engine of a ``save_pretrained`` teacher folder for ``fairseq-kd-seqkd`` (``--engine
transformers``) and ``fairseq-kd-translate --model DIR``, on data binarised in the teacher's
vocabulary (``fairseq-kd-hf-data``). Hugging Face's beam search is given fairseq-generate's rules
as the CTranslate2 engine is; the folder's own ``generation_config.json`` is not read. Design
notes: ``docs/design/deploy.md``.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import torch

from ..errors import InputError
from .ctranslate2_engine import DecodingSettings, Hypothesis, fairseq_length_limit

logger = logging.getLogger(__name__)


class HuggingFaceDecodingError(InputError):
    """The Hugging Face teacher cannot decode this data."""


def first_target_symbol(folder, dataset, target_dictionary, flag: str) -> Optional[int]:
    """The fairseq index every hypothesis of the teacher in ``folder`` must start with: for a
    multilingual tokenizer (M2M100, NLLB) the target-language tag that starts every target sentence
    of ``dataset``; None for a tokenizer without languages (Marian). Refuses, in one line, a
    multilingual teacher's split whose targets are missing or do not all start with one tag."""
    from ..models.hf_teacher import load_tokenizer

    tokenizer = load_tokenizer(folder)
    if not (hasattr(tokenizer, "src_lang") and hasattr(tokenizer, "tgt_lang")):
        return None
    targets = getattr(dataset, "tgt", None)
    if targets is None or len(targets) == 0:
        raise HuggingFaceDecodingError(
            f"{flag} {str(folder)!r} is a multilingual teacher whose target-language tag is read from the first "
            "token of the split's target sentences, but the split has no target side; binarise it with "
            "fairseq-kd-hf-data --teacher-target-lang CODE")
    firsts = {int(targets[i][0]) for i in range(len(targets))}
    tags = {symbol for symbol in firsts if _is_language_tag(tokenizer, target_dictionary[symbol])}
    if len(firsts) != 1 or len(tags) != 1:
        shown = ", ".join(sorted(target_dictionary[s] for s in firsts)[:5])
        raise HuggingFaceDecodingError(
            f"{flag} {str(folder)!r} is a multilingual teacher, but the split's target sentences do not all start "
            f"with one language tag (first tokens: {shown}); binarise the data with fairseq-kd-hf-data "
            "--teacher-target-lang CODE, which puts the tag first in every target sentence")
    return tags.pop()


def _is_language_tag(tokenizer, symbol: str) -> bool:
    """Whether ``symbol`` is one of the tokenizer's language tags: M2M100's ``lang_token_to_id``
    (``__en__``; transformers 5 lists them among no special tokens), or a special token that is none
    of ``<s> <pad> </s> <unk> <mask>`` (NLLB's ``eng_Latn``)."""
    if symbol in (getattr(tokenizer, "lang_token_to_id", None) or {}):
        return True
    specials = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    plain = {getattr(tokenizer, f"{role}_token", None) for role in ("bos", "pad", "eos", "unk", "mask")}
    return symbol in specials and symbol not in plain


class HuggingFaceEngine:
    """Beam search of a :class:`fairseq_kd.models.hf_teacher.HuggingFaceTeacherModel` over batches of
    fairseq source ids (see the module docstring). ``first_target`` is :func:`first_target_symbol`'s
    answer for the data (None: no forced first token)."""

    def __init__(self, model, first_target: Optional[int] = None):
        from transformers import GenerationConfig

        self.model = model.eval()
        target, self.hf_model = model.vocabulary, model.hf_model
        hf_of_fairseq = target.hf_id_of_fairseq
        self.hf_eos, self.hf_pad = hf_of_fairseq[2], hf_of_fairseq[1]  # fairseq's </s> and <pad>
        self.fairseq_of_hf = torch.tensor(target.fairseq_id_of_hf, dtype=torch.long)
        rows = self.hf_model.get_output_embeddings().weight.size(0)
        unwritable = [i for i in range(rows) if i >= len(self.fairseq_of_hf) or int(self.fairseq_of_hf[i]) < 0]
        self.forced_first = None if first_target is None else hf_of_fairseq[first_target]
        self.max_positions = model.max_positions()[1]
        # the only generation settings the model keeps: token ids; every search setting is given per call
        self.hf_model.generation_config = GenerationConfig(
            decoder_start_token_id=model.decoder_start_token_id, eos_token_id=self.hf_eos, pad_token_id=self.hf_pad)
        self.suppressed = sorted({self.hf_pad, *unwritable})

    def generation_config(self, settings: DecodingSettings, limit: int):
        from transformers import GenerationConfig

        return GenerationConfig(
            num_beams=settings.beam, length_penalty=settings.lenpen, do_sample=False,
            early_stopping=True if settings.beam > 1 else None,
            num_return_sequences=settings.nbest, max_new_tokens=limit + 1, min_new_tokens=settings.min_len,
            decoder_start_token_id=self.model.decoder_start_token_id, eos_token_id=self.hf_eos,
            pad_token_id=self.hf_pad, forced_eos_token_id=self.hf_eos, forced_bos_token_id=self.forced_first,
            suppress_tokens=self.suppressed, output_scores=True, return_dict_in_generate=True, use_cache=True)

    @torch.no_grad()
    def translate(self, sources: Sequence[Sequence[int]], settings: DecodingSettings,
                  longest_source: int) -> List[Hypothesis]:
        """As :meth:`fairseq_kd.deploy.ctranslate2_engine.CTranslate2Engine.translate`."""
        if not sources:
            return []
        limit = fairseq_length_limit(longest_source, settings, self.max_positions)
        pad = self.model.fairseq_pad
        device = next(self.hf_model.parameters()).device
        src_tokens = torch.full((len(sources), max(len(s) for s in sources)), pad, dtype=torch.long)
        for row, ids in zip(src_tokens, sources):
            row[:len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        input_ids, attention_mask = self.model.encoder_inputs(src_tokens.to(device))
        config = self.generation_config(settings, limit)
        output = self.hf_model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        sequences = output.sequences[:, 1:].cpu()  # without the decoder start token
        if settings.beam > 1:
            scores = output.sequences_scores.float().cpu().tolist()
        else:  # each chosen token's log-probability under the processed logits, one step at a time
            # (transformers' compute_transition_scores reshapes by config.vocab_size, which is the source
            # vocabulary's size for a Marian model with separate vocabularies)
            scores = None
            chosen = output.sequences[:, 1:]
            step_scores = torch.stack([step.float().log_softmax(-1).gather(1, chosen[:, t:t + 1]).squeeze(1)
                                       for t, step in enumerate(output.scores)], 1).cpu()
        hypotheses = []
        for row, hf_ids in enumerate(sequences.tolist()):
            tokens = hf_ids[:hf_ids.index(self.hf_eos) + 1] if self.hf_eos in hf_ids else hf_ids + [self.hf_eos]
            fairseq_ids = self.fairseq_of_hf[torch.tensor(tokens)].tolist()
            if scores is not None:
                score = scores[row]
            else:  # greedy: the tokens' log-probabilities, normalised as beam search normalises them
                taken = step_scores[row, :min(len(tokens), step_scores.size(1))]
                score = float(taken[torch.isfinite(taken)].sum()) / len(tokens) ** settings.lenpen
            hypotheses.append(Hypothesis(fairseq_ids, score))
        return hypotheses
