"""One fixed index mapping between a Hugging Face tokenizer's vocabulary and a fairseq dictionary.

fairseq 0-3 (``<s> <pad> </s> <unk>``) are the tokenizer's tokens of the same role, whatever their
strings (a role the tokenizer lacks, Marian's BOS, has no id: ``NO_ID``); fairseq 4.. are its other
tokens in increasing id, so ``dict.LANG.txt`` lists exactly the teacher's vocabulary. One mapping
serves both sides, or one per side for a Marian tokenizer with ``separate_vocabs=True``. The rules
in full: ``docs/design/teachers.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..errors import InputError

#: fairseq's fixed specials, index = position (fairseq.data.Dictionary's defaults)
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
#: the tokenizer attribute (``<role>_token_id``) that fills each of fairseq's specials
SPECIAL_ROLES = ("bos", "pad", "eos", "unk")
#: the roles a teacher's tokenizer must have (fairseq pads, ends every sentence and maps unknowns)
REQUIRED_ROLES = ("pad", "eos", "unk")
#: each side's vocabulary file of a Marian tokenizer with ``separate_vocabs=True`` (named in refusals)
SEPARATE_VOCABULARY_FILES = {"source": "vocab.json", "target": "target_vocab.json"}
#: "this fairseq index has no Hugging Face token"
NO_ID = -1


class VocabularyError(InputError):
    """The tokenizer's vocabulary cannot be written as a fairseq dictionary."""


@dataclass(frozen=True)
class VocabularyMap:
    """``hf_id_of_fairseq[i]``: the Hugging Face id of fairseq index ``i`` (``NO_ID`` for none)."""

    fairseq_symbols: Tuple[str, ...]
    hf_id_of_fairseq: Tuple[int, ...]
    hf_vocab_size: int

    @classmethod
    def from_vocabulary(cls, vocabulary: Mapping[str, int], special_ids: Mapping[str, Optional[int]],
                        model_rows: int = 0) -> "VocabularyMap":
        """The mapping of ``vocabulary`` (token -> id) with the specials ``special_ids`` (role -> id or
        None); ``model_rows``: the model's rows for this side (every id must be one), 0 if unknown."""
        token_of_id = _tokens_by_id(vocabulary, model_rows)
        for role in REQUIRED_ROLES:
            if special_ids.get(role) is None:
                raise VocabularyError(f"the tokenizer has no {role} token; fairseq needs one")
        special_hf_ids = [special_ids.get(role) for role in SPECIAL_ROLES]
        for role, hf_id in zip(SPECIAL_ROLES, special_hf_ids):
            if hf_id is not None:
                _check_id(f"its {role} token", hf_id, model_rows)
        taken = {hf_id for hf_id in special_hf_ids if hf_id is not None}
        others = [hf_id for hf_id in sorted(token_of_id) if hf_id not in taken]
        symbols = list(FAIRSEQ_SPECIALS) + [_checked_symbol(token_of_id[hf_id]) for hf_id in others]
        hf_ids = [NO_ID if hf_id is None else hf_id for hf_id in special_hf_ids] + others
        return cls(tuple(symbols), tuple(hf_ids), max([*token_of_id, *taken]) + 1)

    @classmethod
    def from_tokenizer(cls, tokenizer, model_vocab_size: int = 0) -> "VocabularyMap":
        """The mapping of a tokenizer: every id below the model's (or tokenizer's) size that round-trips
        through a token, so tokens ``get_vocab()`` leaves out are kept (M2M100's language tags in
        transformers 5), with its ``<role>_token_id`` specials; ``model_vocab_size``: 0 if unknown."""
        vocabulary = dict(tokenizer.get_vocab())
        _tokens_by_id(vocabulary, model_vocab_size)  # refuses an id past the model's rows before probing up to it
        end = max([len(tokenizer), model_vocab_size, *(hf_id + 1 for hf_id in vocabulary.values())])
        known = set(vocabulary.values())
        probed = [i for i in range(end) if i not in known]
        for hf_id, token in zip(probed, tokenizer.convert_ids_to_tokens(probed)):
            if token is not None and token not in vocabulary and tokenizer.convert_tokens_to_ids(token) == hf_id:
                vocabulary[token] = hf_id
        special_ids = {role: getattr(tokenizer, f"{role}_token_id", None) for role in SPECIAL_ROLES}
        return cls.from_vocabulary(vocabulary, special_ids, model_vocab_size)

    @classmethod
    def from_side(cls, vocabulary: Mapping[str, int], tokenizer, model_rows: int = 0) -> "VocabularyMap":
        """The mapping of one side's ``vocabulary`` of a tokenizer with a vocabulary per side: each
        special is the id of its ``<role>_token`` string there (``<role>_token_id`` is a source id)."""
        special_ids = {}
        for role in SPECIAL_ROLES:
            token = getattr(tokenizer, f"{role}_token", None)
            special_ids[role] = None if token is None else vocabulary.get(str(token))
            if role in REQUIRED_ROLES and special_ids[role] is None:
                raise VocabularyError(f"it has no {role} token{f' {str(token)!r}' if token is not None else ''}; "
                                      "fairseq needs one")
        return cls.from_vocabulary(vocabulary, special_ids, model_rows)

    def __len__(self) -> int:
        return len(self.fairseq_symbols)

    @property
    def fairseq_id_of_hf(self) -> Tuple[int, ...]:
        """The fairseq index of each Hugging Face id."""
        inverse = [NO_ID] * self.hf_vocab_size
        for fairseq_id, hf_id in enumerate(self.hf_id_of_fairseq):
            if hf_id != NO_ID:
                inverse[hf_id] = fairseq_id
        return tuple(inverse)

    def to_fairseq(self, hf_ids: Iterable[int]) -> List[int]:
        """Hugging Face ids -> fairseq indices (every token of the tokenizer has one)."""
        inverse, hf_ids = self.fairseq_id_of_hf, list(hf_ids)
        fairseq_ids = [inverse[hf_id] if 0 <= hf_id < len(inverse) else NO_ID for hf_id in hf_ids]
        if NO_ID in fairseq_ids:
            raise VocabularyError(f"id {hf_ids[fairseq_ids.index(NO_ID)]} is no token of the teacher's vocabulary")
        return fairseq_ids

    def to_hf(self, fairseq_ids: Iterable[int]) -> List[int]:
        """fairseq indices -> Hugging Face ids; refuses an index without one (Marian's ``<s>``)."""
        hf_ids = [self.hf_id_of_fairseq[i] for i in fairseq_ids]
        if NO_ID in hf_ids:
            raise VocabularyError(f"fairseq index {hf_ids.index(NO_ID)} has no token in the teacher's vocabulary")
        return hf_ids

    def dictionary(self, counts: Optional[Mapping[str, int]] = None):
        """The fairseq Dictionary of the mapping, with occurrence ``counts`` (0 where not given)."""
        from fairseq.data import Dictionary

        dictionary = Dictionary()
        for symbol in self.fairseq_symbols[len(FAIRSEQ_SPECIALS):]:
            dictionary.add_symbol(symbol, n=(counts or {}).get(symbol, 0))
        if tuple(dictionary.symbols) != self.fairseq_symbols:  # fairseq's defaults changed under us
            raise RuntimeError("fairseq's Dictionary does not put <s> <pad> </s> <unk> at 0-3")
        return dictionary

    def mismatch(self, symbols: Sequence[str]) -> Optional[str]:
        """Why a dictionary with ``symbols`` is not this mapping's, or None when it is."""
        if tuple(symbols) == self.fairseq_symbols:
            return None
        first = first_difference(symbols, self.fairseq_symbols)
        return (f"{len(symbols)} symbols vs the teacher's {len(self)}, first difference at index {first}"
                f" ({_symbol_at(symbols, first)!r} vs {_symbol_at(self.fairseq_symbols, first)!r})")


def tokenizer_maps(tokenizer, model_vocab_size: int = 0,
                   target_model_vocab_size: int = 0) -> Tuple[VocabularyMap, VocabularyMap]:
    """``(source, target)`` mappings: one object twice for one vocabulary; for a Marian tokenizer with
    ``separate_vocabs=True``, ``get_src_vocab()`` and ``target_encoder`` (transformers 5's
    ``get_tgt_vocab()`` fails on its added specials). Sizes: the model's rows (encoder's, decoder's),
    0 if unknown."""
    if not getattr(tokenizer, "separate_vocabs", False):
        shared = VocabularyMap.from_tokenizer(tokenizer, model_vocab_size)
        return shared, shared
    target = getattr(tokenizer, "target_encoder", None)
    if not isinstance(target, Mapping):
        raise VocabularyError("the tokenizer has separate vocabularies but no target vocabulary (target_encoder)")
    source = {token: hf_id for token, hf_id in tokenizer.get_src_vocab().items() if isinstance(token, str)}
    maps = []
    for side, vocabulary, rows in (("source", source, model_vocab_size), ("target", dict(target), target_model_vocab_size)):
        try:
            maps.append(VocabularyMap.from_side(vocabulary, tokenizer, rows))
        except VocabularyError as err:
            raise VocabularyError(f"the {side} vocabulary ({SEPARATE_VOCABULARY_FILES[side]}): {err}") from None
    return maps[0], maps[1]


def first_difference(a: Sequence, b: Sequence) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter one's length when one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _symbol_at(symbols: Sequence[str], index: int) -> Optional[str]:
    return symbols[index] if index < len(symbols) else None


def _check_id(what: str, hf_id, model_rows: int) -> None:
    """``hf_id`` is a row of the model (``model_rows``; 0: any non-negative integer)."""
    if isinstance(hf_id, bool) or not isinstance(hf_id, int) or hf_id < 0 or (model_rows and hf_id >= model_rows):
        rows = f" of the model's {model_rows} rows" if model_rows else ""
        raise VocabularyError(f"{what} has the id {hf_id!r}, which is not one{rows}; the model and tokenizer do not "
                              "belong together")


def _tokens_by_id(vocabulary: Mapping[str, int], model_rows: int = 0) -> Dict[int, str]:
    """The vocabulary as id -> token; no two tokens may share an id."""
    tokens: Dict[int, str] = {}
    for token, hf_id in vocabulary.items():
        _check_id(f"the token {token!r}", hf_id, model_rows)
        if hf_id in tokens:
            raise VocabularyError(f"tokens {tokens[hf_id]!r} and {token!r} share id {hf_id}")
        tokens[hf_id] = token
    if not tokens:
        raise VocabularyError("the tokenizer's vocabulary is empty")
    return tokens


def _checked_symbol(token: str) -> str:
    """A token as a line of dict.LANG.txt: not a fairseq special in another role, no whitespace."""
    if token in FAIRSEQ_SPECIALS:
        raise VocabularyError(f"the token {token!r} is an ordinary token of the tokenizer but a special symbol "
                              "of fairseq's dictionary")
    if not token or any(character.isspace() for character in token):
        raise VocabularyError(f"the token {token!r} is empty or holds whitespace, which dict.LANG.txt cannot hold")
    return token
