"""Synthetic parallel corpus between two invented languages, for the teacher -> student demo.

Source: SVO, head-initial, almost no morphology. Target: SOV, head-final, with gender and number
agreement (a lexical gender visible in neither noun form), postpositions, mirrored adjectives,
relative clauses before their head, compounds and light verbs that do not map one to one. The
target is a function of the source string (a perfect system scores BLEU 100); the content words
are invented once from :data:`LEXICON_SEED`, the sentences drawn from the corpus seed. The grammar,
its lexicon and why it is learnable by a tiny Transformer yet hard for a small one:
``docs/design/synthetic_corpus.md``.
"""
from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

from ..errors import FileAccessError, InputError, PathError, UserError, message_of
from ..fingerprint import content, fingerprint_files, read_json, write_json

GRAMMAR_VERSION = 1  # bump whenever the generated sentences change, so stale corpora are not reused
LEXICON_SEED = 20240611
MIN_TOKENS, MAX_TOKENS = 3, 20
SPLITS = ("train", "valid", "test")
MANIFEST_NAME = "corpus.json"
MANIFEST_FORMAT = 2  # corpus.json's "format"

GENDERS = ("m", "f", "n")
AGREEMENT_SUFFIX = {("m", "sg"): "o", ("f", "sg"): "a", ("n", "sg"): "u",
                    ("m", "pl"): "oi", ("f", "pl"): "ai", ("n", "pl"): "ui"}
PERSON_SUFFIX = {"1sg": "e", "2sg": "i", "1pl": "eo", "2pl": "io"}
TARGET_NOUN_PLURAL, SOURCE_NOUN_PLURAL = "en", "s"

PRONOUNS = {"mi": ("ja", "1sg"), "tu": ("ty", "2sg"), "nos": ("my", "1pl"), "vos": ("vy", "2pl")}
# source determiner -> target stem; "un" only occurs in the singular and "kem" in the plural
DETERMINERS = {"la": "d", "un": "n", "kem": "n", "esi": "s"}
SINGULAR_DETERMINERS = (("la", 0.5), ("un", 0.3), ("esi", 0.2))
PLURAL_DETERMINERS = (("la", 0.4), ("kem", 0.25), ("esi", 0.15), (None, 0.2))
PREPOSITIONS = {"en": ("ni",), "sur": ("ge",), "kon": ("pel",), "de": ("ra",), "tras": ("ura", "lim")}
SOURCE_PARTICLES = {"and": "i", "not": "ne", "rel": "ki"}
TARGET_PARTICLES = {"and": "e", "not": "ma", "rel": "ke", "object": "ko"}
LIGHT_VERB_STEM = "kav"

NOUN_COUNT, COMPOUND_COUNT, ADJECTIVE_COUNT = 30, 6, 14
TRANSITIVE_VERB_COUNT, INTRANSITIVE_VERB_COUNT = 10, 6
LIGHT_VERB_COUNT = 2  # per kind (transitive, intransitive)

# Sampling probabilities (tuned for a mean source length of about 9 tokens).
P_PRONOUN_SUBJECT, P_PLURAL, P_COMPOUND = 0.25, 0.35, 0.1
ADJECTIVE_COUNT_WEIGHTS = ((0, 0.55), (1, 0.35), (2, 0.10))
P_RELATIVE, P_PP, P_NEGATION, P_COORDINATION = 0.12, 0.3, 0.1, 0.2


class CorpusError(InputError):
    """Parameters of which no corpus can be made."""


class CorpusExistsError(FileAccessError, FileExistsError):
    """The output folder holds something else than this corpus; nothing was written."""


@dataclass(frozen=True)
class Noun:
    source: tuple[str, ...]  # singular source word(s)
    target: str  # consonant-final target stem
    gender: str

    def source_form(self, plural: bool) -> list[str]:
        return [*self.source[:-1], self.source[-1] + SOURCE_NOUN_PLURAL * plural]

    def target_form(self, plural: bool) -> str:
        return self.target + TARGET_NOUN_PLURAL * plural


@dataclass(frozen=True)
class Adjective:
    source: str
    target: str  # consonant-final stem


@dataclass(frozen=True)
class Verb:
    source: str
    target_stem: str
    transitive: bool
    target_prefix: tuple[str, ...] = ()  # uninflected noun of a light-verb construction

    def target_form(self, suffix: str) -> list[str]:
        return [*self.target_prefix, self.target_stem + suffix]


@dataclass(frozen=True)
class Lexicon:
    nouns: tuple[Noun, ...]
    compounds: tuple[Noun, ...]
    adjectives: tuple[Adjective, ...]
    verbs: tuple[Verb, ...]


def _inventor(rng: random.Random, used: set[str], consonants: str):
    """Return a function inventing a fresh stem none of whose inflected forms is used so far."""
    def invent(syllables: Sequence[int], final: str, suffixes: Sequence[str]) -> str:
        while True:
            stem = "".join(rng.choice(consonants) + rng.choice("aeiou")
                           for _ in range(rng.choice(syllables)))
            stem += rng.choice(final) if final else ""
            forms = {stem + suffix for suffix in suffixes}
            if used.isdisjoint(forms):
                used.update(forms)
                return stem
    return invent


@functools.lru_cache(maxsize=1)
def build_lexicon() -> Lexicon:
    """The fixed lexicon (a pure function of LEXICON_SEED); every surface form is unique per language."""
    rng = random.Random(LEXICON_SEED)
    agreeing = tuple(AGREEMENT_SUFFIX.values())
    conjugating = agreeing + tuple(PERSON_SUFFIX.values())
    noun_plural, target_noun_plural = ("", SOURCE_NOUN_PLURAL), ("", TARGET_NOUN_PLURAL)
    src_used = {*PRONOUNS, *DETERMINERS, *PREPOSITIONS, *SOURCE_PARTICLES.values(), "."}
    tgt_used = {pronoun for pronoun, _ in PRONOUNS.values()}
    tgt_used |= {word for words in PREPOSITIONS.values() for word in words}
    tgt_used |= {*TARGET_PARTICLES.values(), ".", *(LIGHT_VERB_STEM + s for s in conjugating)}
    tgt_used |= {stem + s for stem in DETERMINERS.values() for s in agreeing}
    src_word = _inventor(rng, src_used, "bdfgklmnprstvz")
    tgt_word = _inventor(rng, tgt_used, "bcdfghjklmnprstvz")
    consonant_final = "bdgklmnprst"

    nouns = tuple(Noun((src_word((2, 2, 3), "", noun_plural),),
                       tgt_word((1, 2), consonant_final, target_noun_plural), GENDERS[i % len(GENDERS)])
                  for i in range(NOUN_COUNT))
    compounds = []
    while len(compounds) < COMPOUND_COUNT:
        modifier, head = rng.sample(nouns, 2)
        forms = {modifier.target + head.target + suffix for suffix in target_noun_plural}
        if tgt_used.isdisjoint(forms):  # else a repeated pair or a clash with a noun: redraw
            tgt_used |= forms
            compounds.append(Noun(modifier.source + head.source, modifier.target + head.target,
                                  head.gender))
    adjectives = tuple(Adjective(src_word((2,), "lnr", ("",)), tgt_word((1, 2), consonant_final, agreeing))
                       for _ in range(ADJECTIVE_COUNT))
    verbs = []
    for transitive, count in ((True, TRANSITIVE_VERB_COUNT), (False, INTRANSITIVE_VERB_COUNT)):
        for index in range(count):
            source = src_word((2,), "", ("",))
            if index >= count - LIGHT_VERB_COUNT:  # the last few of each kind are light verbs
                light_noun = tgt_word((1,), consonant_final, ("",))
                verbs.append(Verb(source, LIGHT_VERB_STEM, transitive, (light_noun,)))
            else:
                verbs.append(Verb(source, tgt_word((1, 2), consonant_final, conjugating), transitive))
    return Lexicon(nouns, tuple(compounds), adjectives, tuple(verbs))


# --------------------------------------------------------------------------- sentence structure
@dataclass(frozen=True)
class NounPhrase:
    noun: Noun
    plural: bool
    determiner: Optional[str]  # a key of DETERMINERS, or None for a bare plural
    adjectives: tuple[Adjective, ...]
    relative: Optional["RelativeClause"] = None

    @property
    def agreement(self) -> str:
        return AGREEMENT_SUFFIX[(self.noun.gender, "pl" if self.plural else "sg")]


@dataclass(frozen=True)
class RelativeClause:
    verb: Verb
    obj: Optional[NounPhrase]


@dataclass(frozen=True)
class Clause:
    subject: Union[str, NounPhrase]  # a source pronoun or a noun phrase
    negated: bool
    verb: Verb
    obj: Optional[NounPhrase]
    pp: Optional[tuple[str, NounPhrase]]


def _weighted(rng: random.Random, options):
    values, weights = zip(*options)
    return rng.choices(values, weights)[0]


def _sample_np(rng: random.Random, lex: Lexicon, allow_relative: bool) -> NounPhrase:
    noun = rng.choice(lex.compounds if rng.random() < P_COMPOUND else lex.nouns)
    plural = rng.random() < P_PLURAL
    determiner = _weighted(rng, PLURAL_DETERMINERS if plural else SINGULAR_DETERMINERS)
    adjectives = tuple(rng.sample(lex.adjectives, _weighted(rng, ADJECTIVE_COUNT_WEIGHTS)))
    relative = None
    if allow_relative and rng.random() < P_RELATIVE:
        verb = rng.choice(lex.verbs)
        relative = RelativeClause(verb, _sample_np(rng, lex, False) if verb.transitive else None)
    return NounPhrase(noun, plural, determiner, adjectives, relative)


def _sample_clause(rng: random.Random, lex: Lexicon) -> Clause:
    subject = (rng.choice(list(PRONOUNS)) if rng.random() < P_PRONOUN_SUBJECT
               else _sample_np(rng, lex, True))
    negated = rng.random() < P_NEGATION
    verb = rng.choice(lex.verbs)
    obj = _sample_np(rng, lex, True) if verb.transitive else None
    pp = (rng.choice(list(PREPOSITIONS)), _sample_np(rng, lex, False)) if rng.random() < P_PP else None
    return Clause(subject, negated, verb, obj, pp)


def _source_np(phrase: NounPhrase) -> list[str]:
    words = [phrase.determiner] if phrase.determiner else []
    words += phrase.noun.source_form(phrase.plural) + [a.source for a in phrase.adjectives]
    if phrase.relative:
        words += [SOURCE_PARTICLES["rel"], phrase.relative.verb.source]
        words += _source_np(phrase.relative.obj) if phrase.relative.obj else []
    return words


def _target_np(phrase: NounPhrase) -> list[str]:
    words = []
    if phrase.relative:
        if phrase.relative.obj:
            words += _target_np(phrase.relative.obj) + [TARGET_PARTICLES["object"]]
        words += phrase.relative.verb.target_form(phrase.agreement) + [TARGET_PARTICLES["rel"]]
    words += [DETERMINERS[phrase.determiner] + phrase.agreement] if phrase.determiner else []
    words += [a.target + phrase.agreement for a in reversed(phrase.adjectives)]
    return words + [phrase.noun.target_form(phrase.plural)]


def _source_clause(clause: Clause) -> list[str]:
    subject = [clause.subject] if isinstance(clause.subject, str) else _source_np(clause.subject)
    words = subject + [SOURCE_PARTICLES["not"]] * clause.negated + [clause.verb.source]
    words += _source_np(clause.obj) if clause.obj else []
    return words + (([clause.pp[0]] + _source_np(clause.pp[1])) if clause.pp else [])


def _target_clause(clause: Clause) -> list[str]:
    if isinstance(clause.subject, str):
        pronoun, person = PRONOUNS[clause.subject]
        words, agreement = [pronoun], PERSON_SUFFIX[person]
    else:
        words, agreement = _target_np(clause.subject), clause.subject.agreement
    words += (_target_np(clause.pp[1]) + list(PREPOSITIONS[clause.pp[0]])) if clause.pp else []
    words += (_target_np(clause.obj) + [TARGET_PARTICLES["object"]]) if clause.obj else []
    words += [TARGET_PARTICLES["not"]] * clause.negated
    return words + clause.verb.target_form(agreement)


def sample_sentence_pair(rng: random.Random, lexicon: Optional[Lexicon] = None) -> tuple[str, str]:
    """One (source, target) pair of space-separated tokens, both MIN_TOKENS..MAX_TOKENS long."""
    lex = lexicon or build_lexicon()
    while True:
        clauses = [_sample_clause(rng, lex)]
        if rng.random() < P_COORDINATION:
            clauses.append(_sample_clause(rng, lex))
        source = _join(map(_source_clause, clauses), SOURCE_PARTICLES["and"])
        target = _join(map(_target_clause, clauses), TARGET_PARTICLES["and"])
        if all(MIN_TOKENS <= len(side) <= MAX_TOKENS for side in (source, target)):
            return " ".join(source), " ".join(target)


def _join(clauses, conjunction: str) -> list[str]:
    words = []
    for clause in clauses:
        words += ([conjunction] if words else []) + clause
    return words + ["."]


# --------------------------------------------------------------------------- corpus and files
def generate_corpus(seed: int, sizes: Mapping[str, int]) -> dict[str, list[tuple[str, str]]]:
    """Disjoint splits of distinct source sentences (in the order of ``sizes``), a pure function of
    ``seed`` and ``sizes``."""
    rng, lexicon = random.Random(seed), build_lexicon()
    total = sum(sizes.values())
    translations: dict[str, str] = {}
    for _ in range(20 * total + 1000):
        if len(translations) == total:
            break
        source, target = sample_sentence_pair(rng, lexicon)
        if translations.setdefault(source, target) != target:
            raise AssertionError(f"grammar is ambiguous: {source!r} has two translations")
    if len(translations) < total:
        raise CorpusError(f"could not draw {total} distinct sentences; ask for a smaller corpus")
    pairs = list(translations.items())
    rng.shuffle(pairs)
    splits, start = {}, 0
    for name, size in sizes.items():
        splits[name], start = pairs[start:start + size], start + size
    return splits


def _existing_corpus_matches(out_dir: Path, parameters: dict) -> bool:
    """Whether ``out_dir`` holds the corpus of ``parameters``, its files unchanged."""
    try:
        manifest = read_json(out_dir / MANIFEST_NAME)
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return False
    if manifest.get("grammar_version") != GRAMMAR_VERSION or manifest.get("parameters") != parameters:
        return False
    recorded = manifest.get("files") or {}
    paths = [out_dir / name for name in recorded.get("files", {})]
    return (bool(paths) and all(path.is_file() for path in paths)
            and content(fingerprint_files(paths, recorded)) == content(recorded))


def write_corpus(out_dir: Union[str, Path], seed: int = 1, train_size: int = 20000,
                 valid_size: int = 500, test_size: int = 500, source_lang: str = "src",
                 target_lang: str = "tgt", force: bool = False) -> str:
    """Write ``{train,valid,test}.{source_lang,target_lang}`` and ``corpus.json`` into ``out_dir``:
    "reused" when it holds this corpus unchanged, else "written". Another non-empty ``out_dir`` is
    refused (:class:`CorpusExistsError`) unless ``force``: the corpus files and the manifest are
    then overwritten, other files kept."""
    out_dir = Path(out_dir)
    for name, size in (("train_size", train_size), ("valid_size", valid_size), ("test_size", test_size)):
        if not isinstance(size, int) or size < 1:
            raise CorpusError(f"{name} (--{name.replace('_', '-')}) must be a positive integer, "
                              f"got {size!r}")
    for name, lang in (("source_lang", source_lang), ("target_lang", target_lang)):
        if not re.fullmatch(r"[A-Za-z0-9_-]+", lang):
            raise CorpusError(f"{name} (--{name.replace('_', '-')}) must be a non-empty file suffix of "
                              f"letters, digits, '_' or '-', got {lang!r}")
    if source_lang == target_lang:
        raise CorpusError(f"source_lang and target_lang (--source-lang, --target-lang) must differ, "
                          f"both are {source_lang!r}")
    if out_dir.exists() and not out_dir.is_dir():
        raise PathError(f"output folder {out_dir} (--output-dir) exists and is not a folder")

    parameters = {"seed": seed, "train_size": train_size, "valid_size": valid_size,
                  "test_size": test_size, "source_lang": source_lang, "target_lang": target_lang}
    try:
        if out_dir.is_dir() and any(out_dir.iterdir()):
            if _existing_corpus_matches(out_dir, parameters):
                return "reused"
            if not force:
                raise CorpusExistsError(
                    f"output folder {out_dir} is not empty and holds no corpus made with these parameters "
                    f"(see {MANIFEST_NAME}); choose another folder or pass --force to overwrite")
        splits = generate_corpus(seed, dict(zip(SPLITS, (train_size, valid_size, test_size))))
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for split, pairs in splits.items():
            for side, lang in enumerate((source_lang, target_lang)):
                path = out_dir / f"{split}.{lang}"
                path.write_text("".join(pair[side] + "\n" for pair in pairs), encoding="utf-8")
                written.append(path)
        # the manifest is written last, so an interrupted run is never mistaken for a finished one
        manifest = {"format": MANIFEST_FORMAT, "generator": __name__, "grammar_version": GRAMMAR_VERSION,
                    "parameters": parameters, "files": fingerprint_files(written)}
        write_json(out_dir / MANIFEST_NAME, manifest)
    except UserError:
        raise
    except OSError as error:  # the system's refusal to read or write the user's folder
        raise FileAccessError(f"output folder {out_dir} (--output-dir): {message_of(error)}") from error
    return "written"
