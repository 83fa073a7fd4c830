"""What a criterion's tests use: tiny models, a criterion built in process, one fairseq-train run.

A hidden-state criterion's test file registers its factory with :func:`criterion_factory`, through
which the shared tests (tests/test_hidden_state_kd.py: weight 0, fp16, padding, memory) build it;
:func:`build_tiny_student` and :func:`make_batch` (or the ``tiny_batch`` fixture) give a forward
pass in process on the ``kd_task`` fixture (the tiny reordering corpus with its trained 3+3 teacher,
tests/conftest.py); :func:`train_student` runs ``fairseq-train`` with the plugin.
"""
import pytest

from command_runners import REPO, run_cli, run_fairseq_train_here

USER_DIR = str(REPO / "fairseq_kd")

# Small enough to train in seconds on 2 cores, big enough to have 4 heads and 3 layers to map.
TINY_TEACHER_ARGS = [
    "--arch", "transformer", "--encoder-layers", "3", "--decoder-layers", "3",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
]
TINY_STUDENT_ARGS = [
    "--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]
COMMON_TRAIN_ARGS = [
    "--optimizer", "adam", "--lr", "0.003", "--max-tokens", "1500", "--seed", "1",
    "--no-progress-bar", "--log-format", "simple", "--log-interval", "1",
    "--num-workers", "0", "--no-epoch-checkpoints", "--disable-validation",
]


def train_student(data_bin, teacher_ckpt, save_dir, criterion_args, student_args=TINY_STUDENT_ARGS,
                  max_update=4, extra=(), check=True, refused=False, warm=True):
    """fairseq-train a student with --user-dir fairseq_kd; returns the CompletedProcess.
    ``refused``: a run the plugin refuses before training, in this process
    (:func:`run_fairseq_train_here`); ``warm=False``: a new fairseq-train process rather than a
    child of the warm interpreter (:func:`run_cli`), where what a new process does is the claim."""
    args = [data_bin, "--user-dir", USER_DIR, "--task", "translation_kd", "--teacher-checkpoint", teacher_ckpt,
            *student_args, *criterion_args, *COMMON_TRAIN_ARGS, "--max-update", str(max_update),
            "--save-dir", save_dir, *extra]
    if refused:
        return run_fairseq_train_here(*args)
    return run_cli("fairseq-train", *args, check=check, warm=warm)


@pytest.fixture(scope="session")
def kd_task(tiny_data_bin, tiny_teacher):
    """An in-process translation_kd task with the tiny teacher loaded."""
    import fairseq_kd
    from fairseq_kd.tasks.translation_kd import TranslationKDConfig, TranslationKDTask

    fairseq_kd.register()

    cfg = TranslationKDConfig(data=str(tiny_data_bin), source_lang="src", target_lang="tgt",
                              teacher_checkpoint=str(tiny_teacher))
    return TranslationKDTask.setup_task(cfg)


# ------------------------------------------------------------ the registered criterions, for test lists
def kd_criterions() -> dict:
    """Every registered distillation criterion (a class on ``KDCriterionBase``), name -> class,
    sorted by name: test lists derive from this, so a new criterion file is picked up by them."""
    import fairseq_kd.criterions  # noqa: F401 - registers every criterion
    from fairseq.criterions import CRITERION_REGISTRY

    from fairseq_kd.criterions.base import KDCriterionBase

    return {name: cls for name, cls in sorted(CRITERION_REGISTRY.items())
            if isinstance(cls, type) and issubclass(cls, KDCriterionBase)}


def hidden_state_criterions() -> dict:
    """The registered criterions on ``HiddenStateKDCriterion`` (a layer term on hidden states)."""
    from fairseq_kd.criterions.hidden_state import HiddenStateKDCriterion

    return {name: cls for name, cls in kd_criterions().items() if issubclass(cls, HiddenStateKDCriterion)}


def criterion_test_module(name: str):
    """``tests/test_<name>.py``, the test file every criterion has."""
    import importlib

    return importlib.import_module(f"test_{name}")


#: criterion name -> its factory ``(task, **overrides) -> criterion``, with the options its tests use
#: on the tiny models; each criterion's test file registers one (:func:`criterion_factory`)
CRITERION_FACTORIES = {}


def criterion_factory(name: str):
    """Decorator of a test file's factory of criterion ``name``, through which the shared tests
    (tests/test_hidden_state_kd.py) build it."""
    def register(factory):
        CRITERION_FACTORIES[name] = factory
        return factory
    return register


def criterion_maker(name: str):
    """The factory ``tests/test_<name>.py`` registered for criterion ``name``."""
    criterion_test_module(name)  # importing it registers its factory
    if name not in CRITERION_FACTORIES:
        raise AssertionError(f"tests/test_{name}.py must register a factory: @criterion_factory({name!r})")
    return CRITERION_FACTORIES[name]


def build_tiny_student(task, **overrides):
    """Build (and register the shape of) an in-process student like TINY_STUDENT_ARGS."""
    from argparse import Namespace

    from fairseq.models.transformer import base_architecture

    args = Namespace(
        arch="transformer", _name="transformer", encoder_layers=2, decoder_layers=2,
        encoder_embed_dim=16, decoder_embed_dim=16, encoder_ffn_embed_dim=32,
        decoder_ffn_embed_dim=32, encoder_attention_heads=2, decoder_attention_heads=2,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_source_positions=128, max_target_positions=128,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    base_architecture(args)
    return task.build_model(args)


def make_batch(task, sentences, targets):
    """A fairseq-style sample (left-padded source, right-padded target) from word lists."""
    from fairseq.data import LanguagePairDataset

    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    src = [src_dict.encode_line(s, add_if_not_exist=False).long() for s in sentences]
    tgt = [tgt_dict.encode_line(t, add_if_not_exist=False).long() for t in targets]
    dataset = LanguagePairDataset(src, [len(s) for s in src], src_dict, tgt, [len(t) for t in tgt], tgt_dict)
    return dataset.collater([dataset[i] for i in range(len(src))])


@pytest.fixture
def tiny_batch(kd_task):
    return make_batch(
        kd_task,
        ["w1 w2 w3", "w4 w5 w6 w7 w8 w9", "w10 w11"],
        ["W3 W2 W1", "W9 W8 W7 W6 W5 W4", "W11 W10"],
    )
