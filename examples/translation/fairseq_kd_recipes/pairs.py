"""Per-language-pair recipe settings: preparation entry point, models, schedule, scoring.

The training hyper-parameters shared by every pair are the papers' (A2D Sec. 5.2, CKD Sec. 4,
following Vaswani et al. 2017): Adam (0.9, 0.98), lr 5e-4, inverse_sqrt with 4,000 warm-up updates,
dropout 0.3, weight decay 1e-4, label smoothing 0.1, max-tokens 4,096, beam 5. A pair overrides
only what its paper states differently; every override says why.

What the papers leave open is chosen here and marked "our choice".

Design notes: ``docs/design/recipes.md``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .prepare.corpora import iwslt14_de_en, iwslt_spm, multi30k_fr_en, wmt14_en_de, wmt22_de_dsb
from .methods import METHODS, STUDENT_ROLES, Method

#: the package of the per-corpus preparation commands (one module per examples/translation/ folder)
PREPARE_SCRIPTS = "fairseq_kd_recipes.prepare.scripts"
#: fairseq-train flags shared by every model of every pair (methods.md, "Settings from the papers")
PAPER_TRAINING: Mapping[str, str] = {
    "--optimizer": "adam",
    "--adam-betas": "(0.9, 0.98)",
    "--lr": "5e-4",
    "--lr-scheduler": "inverse_sqrt",
    "--warmup-updates": "4000",
    "--dropout": "0.3",
    "--weight-decay": "1e-4",
    "--clip-norm": "0.0",
    "--max-tokens": "4096",
}
LABEL_SMOOTHING = "0.1"
BEAM = 5
#: checkpoint selection: best validation nll_loss, or best validation BLEU (fairseq's --eval-bleu)
SELECTIONS = ("nll", "bleu")
#: the longest output of a decoding, max_len_a * source length + max_len_b tokens, as fairseq's IWSLT'14
#: example: the validation BLEU's decoding (where a pair selects checkpoints by BLEU) and the test
#: decoding share it, so a student that loops stops at the same length in both
MAX_LEN_A, MAX_LEN_B = 1.2, 10
#: fairseq's --eval-bleu decoding during validation (beam 5)
EVAL_BLEU_ARGS = json.dumps({"beam": BEAM, "max_len_a": MAX_LEN_A, "max_len_b": MAX_LEN_B})

_LOW_RESOURCE_TEACHER = ("--arch", "transformer_kd_iwslt_teacher")
_LOW_RESOURCE_STUDENTS = {
    "student": ("--arch", "transformer_kd_iwslt_student_3l"),
    "student_4h": ("--arch", "transformer_kd_iwslt_student_3l"),
    "student_8h": ("--arch", "transformer_kd_iwslt_student_3l_8h"),
    "student_2l": ("--arch", "transformer_kd_iwslt_student_2l"),
}
_SHARE_DECODER_EMBEDDINGS = ("--share-decoder-input-output-embed",)
_SHARE_ALL_EMBEDDINGS = ("--share-all-embeddings",)
# A small corpus has too few pairs for the full-size subword models; these settings make the
# smoke profile work on a test archive (override them with --prepare-args).
_SMOKE_BPE = ("--bpe-merges", "200")
_SMOKE_SPM = ("--spm-vocab-size", "200")


@dataclass(frozen=True)
class PairRecipe:
    """Everything a recipe needs to know about one language pair."""

    name: str
    title: str
    #: the corpus's folder under examples/translation/ (its ``prepare.py``), which is also the name of
    #: its preparation module, ``fairseq_kd_recipes.prepare.scripts.<name>``; and that command's fixed flags
    corpus_folder: str
    prepare_args: tuple[str, ...]
    smoke_prepare_args: tuple[str, ...]
    #: the files ``--archives`` must hold (the preparation's default sets)
    archive_files: tuple[str, ...]
    source: str
    target: str
    teacher: tuple[str, ...]
    #: student role -> architecture flags; a role a pair lacks disables the methods that use it
    students: Mapping[str, tuple[str, ...]]
    #: model flags added to teacher and students alike
    model_args: tuple[str, ...]
    #: training length of the gpu profile
    schedule: tuple[str, ...]
    #: target size of one update in tokens; ``--update-freq`` is derived from it and the GPU count
    tokens_per_update: int = 4096
    #: flags that replace PAPER_TRAINING values for this pair
    training_overrides: Mapping[str, str] = field(default_factory=dict)
    #: profile name -> flags replacing the training values under that profile (after the profile's own)
    profile_training: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: profile name -> training length under that profile (replaces the profile's budget)
    profile_schedules: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: method name -> criterion flags added for this pair (its paper's values; on the benchmark pair,
    #: values chosen on its validation set)
    criterion_overrides: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: methods that would duplicate another one here (same student, same criterion)
    excluded_methods: tuple[str, ...] = ()
    #: scoring: how subwords are undone, Moses detokenisation language, sacreBLEU tokeniser
    remove_bpe: str = "sentencepiece"
    detok_moses: Optional[str] = None
    sacrebleu_tokenize: str = "13a"
    #: the corpus is lowercased in preparation: BLEU against the untouched (cased) references is
    #: case-insensitive (sacreBLEU -lc)
    lowercased: bool = False
    #: also report the paper's BLEU: sacreBLEU on the tokenised T- lines, BPE removed, no
    #: detokenisation (fairseq-generate --scoring sacrebleu), as a second, labelled table
    tokenized_bleu: bool = False
    #: which checkpoint is decoded: best validation nll_loss, or best validation BLEU (SELECTIONS)
    selection: str = "nll"
    #: stop after this many validations without a better score (fairseq's --patience)
    patience: Optional[int] = None
    #: test decoding
    beam: int = BEAM
    lenpen: float = 1.0
    #: decode (and distil from) the average of the last N checkpoints; 0: the selected checkpoint
    average_last: int = 0
    #: with average_last on an update schedule, a checkpoint at most every N updates
    save_interval_updates: int = 1000

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(f"pair {self.name}: selection {self.selection!r} is not one of {SELECTIONS}")
        unknown_roles = sorted(set(self.students) - set(STUDENT_ROLES))
        unknown_methods = sorted((set(self.criterion_overrides) | set(self.excluded_methods)) - set(METHODS))
        if unknown_roles or unknown_methods:
            raise ValueError(f"pair {self.name}: unknown student roles {unknown_roles} or methods {unknown_methods}")

    @property
    def prepare_module(self) -> str:
        """The preparation command as a module (``python -m``), found in a checkout and in an
        installed package alike."""
        return f"{PREPARE_SCRIPTS}.{self.corpus_folder}"

    @property
    def prepare_script(self) -> str:
        """The same command as a checkout's script, relative to the repository root (for messages)."""
        return f"examples/translation/{self.corpus_folder}/prepare.py"

    def methods(self) -> list[Method]:
        """The methods this pair can train, in table order."""
        return [
            method for method in METHODS.values()
            if method.in_recipes and method.student in self.students and method.name not in self.excluded_methods
        ]

    def criterion_args(self, method: Method) -> tuple[str, ...]:
        """The method's criterion flags with this pair's values replacing the table's."""
        values = dict(_flag_pairs(method.criterion_args))
        values.update(_flag_pairs(self.criterion_overrides.get(method.name, ())))
        return tuple(item for flag_value in values.items() for item in flag_value if item is not None)

    def training(self) -> dict[str, str]:
        return {**PAPER_TRAINING, **self.training_overrides}


def _flag_pairs(flags: tuple[str, ...]) -> list[tuple[str, Optional[str]]]:
    """``("--a", "1", "--switch", "--b", "x")`` -> ``[("--a", "1"), ("--switch", None), ("--b", "x")]``:
    a flag followed by another flag (or by nothing) is a switch (a boolean field of the criterion)."""
    pairs: list[tuple[str, Optional[str]]] = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        if not flag.startswith("--"):
            raise ValueError(f"criterion flags must be --flag [value] items, got {flag!r} in {flags}")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            pairs.append((flag, flags[i + 1]))
            i += 2
        else:
            pairs.append((flag, None))
            i += 1
    return pairs


def _low_resource(name: str, title: str, *, corpus_folder: str, prepare_args=(), smoke_prepare_args,
                  archive_files, source: str, target: str, selection="bleu", **scoring) -> PairRecipe:
    """Align-to-Distill's low-resource setup (Sec. 5.2): 6+6 teacher, 3+3 students (4 or 8 heads),
    2+2 students for the CKD comparison, all 4 heads (unless 8), d = 512, FFN 1024; as the authors'
    scripts, up to 100 epochs, stopped after 10 epochs without a better validation BLEU, whose
    best checkpoint is decoded."""
    return PairRecipe(
        name=name, title=title, corpus_folder=corpus_folder, prepare_args=tuple(prepare_args),
        smoke_prepare_args=smoke_prepare_args, archive_files=tuple(archive_files), source=source,
        target=target, teacher=_LOW_RESOURCE_TEACHER, students=_LOW_RESOURCE_STUDENTS,
        model_args=_SHARE_DECODER_EMBEDDINGS, schedule=("--max-epoch", "100"), patience=10,
        selection=selection, **scoring,
    )


#: Vaswani et al. (Sec. 6.1), which the CKD paper and A2D's WMT'14 setup follow: beam 4, length
#: penalty 0.6, the average of the last 5 checkpoints.
_VASWANI_DECODING = dict(beam=4, lenpen=0.6, average_last=5)


def _ckd_pair(pair: str) -> PairRecipe:
    """The CKD paper's IWSLT'14 Pt/Tr-En setup (Wu et al. 2020, Sec. 4): a 6+6 teacher and 2+2
    students, word-level KD weighted eta = 0.1, and "all settings identical to those of Vaswani et
    al." for what the paper does not declare: transformer-base widths (d = 512, FFN 2048, 8 heads),
    shared embeddings, dropout 0.1, about 25K tokens per update, beam 4, length penalty 0.6 and the
    average of the last 5 checkpoints (here epoch checkpoints). The paper gives no training length;
    50 epochs is our choice."""
    source, target = pair.split("-")
    corpus = iwslt_spm.CORPORA[pair]
    base = ("--arch", "transformer")
    two_layers = (*base, "--encoder-layers", "2", "--decoder-layers", "2")
    return PairRecipe(
        name=f"iwslt14_{source}_{target}",
        title=f"IWSLT'14 {source.capitalize()}-En (CKD setup)",
        corpus_folder="iwslt14_pt_en_tr_en",
        prepare_args=("--pair", pair),
        smoke_prepare_args=_SMOKE_SPM,
        archive_files=(corpus.archive.name,),
        source=source, target=target,
        teacher=base,
        students={
            "student": two_layers,
            "student_4h": (*two_layers, "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"),
            "student_8h": two_layers,
            "student_2l": two_layers,
        },
        model_args=_SHARE_ALL_EMBEDDINGS,
        schedule=("--max-epoch", "50"),
        tokens_per_update=25000,
        training_overrides={"--dropout": "0.1"},
        criterion_overrides={"word_kd": ("--kd-weight", "0.1")},
        # Every student here has 2 layers: these two would train the same models as no_kd / a2d_kd_8h.
        excluded_methods=("no_kd_2l", "a2d_kd_2l"),
        remove_bpe="sentencepiece",
        **_VASWANI_DECODING,
    )


def _wmt14_en_de() -> PairRecipe:
    """A2D's high-resource setup (Sec. 5.2): 12+12 teacher, 4+4 student, transformer-base widths
    and settings (Vaswani et al.: dropout 0.1, shared embeddings, about 25K tokens per update,
    100K updates, beam 4, length penalty 0.6, the average of the last 5 checkpoints), lambda of
    L_att = 0.1. The 2+2 student is the CKD paper's En-De student. Vaswani et al. wrote a checkpoint
    every 10 minutes; here one every 1,000 updates (our choice)."""
    student = ("--arch", "transformer_kd_wmt_student_4l")
    a2d_wmt = ("--a2d-preset", "wmt")
    return PairRecipe(
        name="wmt14_en_de",
        title="WMT'14 En-De (Vaswani et al. data, A2D high-resource setup)",
        corpus_folder="wmt14_en_de",
        prepare_args=(),
        smoke_prepare_args=_SMOKE_BPE,
        archive_files=tuple(remote.name for remote in (
            *(archive for archive, _ in wmt14_en_de.TRAINING), wmt14_en_de.VALID[0], wmt14_en_de.TEST[0])),
        source="en", target="de",
        teacher=("--arch", "transformer_kd_wmt_teacher"),
        students={
            "student": student,
            "student_4h": (*student, "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"),
            "student_8h": student,
            "student_2l": (*student, "--encoder-layers", "2", "--decoder-layers", "2"),
        },
        model_args=_SHARE_ALL_EMBEDDINGS,
        schedule=("--max-update", "100000"),
        tokens_per_update=25000,
        training_overrides={"--dropout": "0.1"},
        criterion_overrides={name: a2d_wmt for name in METHODS if name.startswith("a2d_kd")},
        remove_bpe="subword_nmt",
        detok_moses="de",
        save_interval_updates=1000,
        **_VASWANI_DECODING,
    )


def _wmt22_archive_files() -> tuple[str, ...]:
    names: list[str] = []
    for set_name in (wmt22_de_dsb.TRAIN_SET, wmt22_de_dsb.DEFAULT_VALID_SET, wmt22_de_dsb.DEFAULT_TEST_SET):
        for text_file in wmt22_de_dsb.SETS[set_name].values():
            if text_file.remote.name not in names:
                names.append(text_file.remote.name)
    return tuple(names)


def _transformer(layers: int, dim: int, heads: int, pre_norm: bool = False) -> tuple[str, ...]:
    flags = (
        "--arch", "transformer", "--encoder-layers", str(layers), "--decoder-layers", str(layers),
        "--encoder-embed-dim", str(dim), "--decoder-embed-dim", str(dim),
        "--encoder-ffn-embed-dim", str(4 * dim), "--decoder-ffn-embed-dim", str(4 * dim),
        "--encoder-attention-heads", str(heads), "--decoder-attention-heads", str(heads),
    )
    return flags + (("--encoder-normalize-before", "--decoder-normalize-before") if pre_norm else ())


def _multi30k_fr_en() -> PairRecipe:
    """The real-corpus quality benchmark (our setup; no paper distils on Multi30k): Multi30k task 1
    French-English, 29K training pairs, scored on test_2016_flickr (1,000 sentences).

    Sizes are chosen so the whole comparison runs on a few CPU cores: a 6+6 pre-norm teacher of
    width 128 (pre-norm trains reliably at a high learning rate; a post-norm teacher trained like
    the students underfits), and 3+3 students of width 64, a capacity gap where distillation can
    show. lr 1.5e-3 with 500 warm-up updates and 2,048 tokens per update (about 190 updates per
    epoch), dropout 0.2. The ``gpu`` profile trains 40 epochs; the ``cpu`` profile 6 (about 5
    minutes an epoch for the teacher and 2-4 for a student on 2 cores).

    CKD's comparison runs on 2+2 students (``no_kd_2l`` against ``ckd_rc``, in a table of their
    own); the other 2+2 systems are left out to keep the CPU budget. TinyBERT's three weights and
    ALP-KD's layer weight are 0.1 here, chosen on validation nll (``docs/design/recipes.md``).
    """
    student = _transformer(3, 64, 4)
    return PairRecipe(
        name="multi30k_fr_en",
        title="Multi30k Fr-En (real-corpus quality benchmark)",
        corpus_folder="multi30k_fr_en",
        prepare_args=(),
        smoke_prepare_args=_SMOKE_BPE,
        archive_files=tuple(remote.name for remote in multi30k_fr_en.FILES),
        source="fr", target="en",
        teacher=_transformer(6, 128, 4, pre_norm=True),
        students={
            "student": student,
            "student_4h": student,
            "student_8h": _transformer(3, 64, 8),
            "student_2l": _transformer(2, 64, 4),
        },
        model_args=_SHARE_ALL_EMBEDDINGS,
        schedule=("--max-epoch", "40"),
        tokens_per_update=2048,
        training_overrides={"--lr": "1.5e-3", "--warmup-updates": "500", "--max-tokens": "2048", "--dropout": "0.2"},
        profile_training={"cpu": {"--warmup-updates": "500"}},
        profile_schedules={"cpu": ("--max-epoch", "6")},
        criterion_overrides={"tinybert": ("--tinybert-att-weight", "0.1", "--tinybert-hidden-weight", "0.1",
                                          "--tinybert-emb-weight", "0.1"),
                             "alp_kd": ("--layer-weight", "0.1")},
        excluded_methods=("a2d_kd_2l", "ckd_oc", "ckd_sc", "ckd_cc"),
        remove_bpe="subword_nmt",
        detok_moses="en",
        selection="nll",
    )


_PAIR_LIST = (
    _low_resource(
        "iwslt14_de_en", "IWSLT'14 De-En (A2D low-resource setup)",
        corpus_folder="iwslt14_de_en",
        smoke_prepare_args=_SMOKE_BPE, archive_files=(iwslt14_de_en.ARCHIVE.name,),
        source="de", target="en",
        # Tokenised, lowercased text with subword-nmt BPE: undo both before sacreBLEU, which
        # compares case-insensitively with the untouched references; the A2D authors' own BLEU
        # (tokenised, lowercased) is a second table.
        remove_bpe="subword_nmt", detok_moses="en", lowercased=True, tokenized_bleu=True,
    ),
    _ckd_pair("pt-en"),
    _ckd_pair("tr-en"),
    _low_resource(
        "iwslt17_en_zh", "IWSLT'17 En-Zh (A2D low-resource setup)",
        corpus_folder="iwslt17_en_zh",
        smoke_prepare_args=_SMOKE_SPM, archive_files=(iwslt_spm.IWSLT17_EN_ZH.archive.name,),
        source="en", target="zh", remove_bpe="sentencepiece", sacrebleu_tokenize="zh",
        # fairseq's --eval-bleu scores with sacreBLEU's 13a tokeniser only, which sees a Chinese
        # sentence as a few "words": its BLEU cannot rank checkpoints, so the validation nll does.
        selection="nll",
    ),
    _low_resource(
        "wmt22_de_dsb", "WMT'22 De-Dsb (A2D low-resource setup)",
        corpus_folder="wmt22_de_dsb",
        smoke_prepare_args=_SMOKE_SPM, archive_files=_wmt22_archive_files(),
        source="de", target="dsb", remove_bpe="sentencepiece",
    ),
    _wmt14_en_de(),
    _multi30k_fr_en(),
)

#: every recipe by name (the first argument of ``fairseq-kd-recipe``)
PAIRS: Mapping[str, PairRecipe] = {pair.name: pair for pair in _PAIR_LIST}
