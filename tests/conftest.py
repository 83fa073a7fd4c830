"""Shared fixtures: tiny binarised data, a tiny trained teacher, in-process models and criterions.

The data is a copy task with reordering (target = source reversed, upper-cased) so a few dozen
updates already give a teacher that is better than chance; the fixtures are session-scoped so the
whole suite binarises and trains the teacher once. How commands run: tests/command_runners.py
(its names are re-exported here).
"""
import random
from pathlib import Path

import pytest
import torch

from command_runners import (  # noqa: F401 - re-exported for the test files
    BIN,
    QUIET_ENV,
    REPO,
    WarmChild,
    WarmInterpreter,
    popen_warm,
    run_cli,
    run_cli_here,
    run_fairseq_train_here,
    run_module,
    run_warm,
    sacrebleu_command_line,
)

SHARED_DATA = REPO.parent / "shared" / "data"
USER_DIR = str(REPO / "fairseq_kd")


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """One intra-op thread in the test processes too, as the suite's subprocesses have
    (OMP_NUM_THREADS=1, QUIET_ENV): pytest-xdist already runs one worker per core, and tiny models'
    small batches on two threads of a loaded machine run many times slower (a 400-sentence teacher
    cache pass: 1.6 s on one thread, 19 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Back to one thread before each test's fixtures are set up (module-scoped ones included): a
    CTranslate2 ``Translator`` made with ``intra_threads=0`` (CTranslate2's default, as the seq-KD
    and translate engines make it) sets the process's OpenMP threads, torch's among them, to its
    own default, and every later in-process test of that worker ran on two threads
    (tests/test_seqkd_hf.py after tests/test_seqkd_ctranslate2.py: 240 s against 39 s alone)."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


#: The test files that take longest, longest first (measured file by file on the 2-core machine,
#: issue 40): they start first. scripts/run_tests.sh runs each file whole on one worker
#: (pytest-xdist's --dist loadfile: module fixtures made once), so the long files starting first
#: leaves short ones to even out the two workers' last minutes. Only the order changes: every
#: other file follows in collection order, and the tests of a file keep theirs.
LONGEST_FILES = (
    "test_demo.py", "test_ctranslate2_export.py", "test_recipe.py", "test_teacher_cache.py", "test_safety.py",
    "test_bf16.py", "test_benchmark.py", "test_gpu_check.py", "test_teacher_pass_sharding.py", "test_refusals.py", "test_packaging.py",
    "test_recipe_hf_teacher.py", "test_capture_contract.py", "test_end_to_end.py", "test_deploy_benchmark.py", "test_promises.py",
    "test_multirank.py", "test_seqkd_hf.py", "test_prepare_iwslt.py", "test_prepare_spm.py", "test_recipe_progress.py",
    "test_seqkd.py", "test_ckd.py", "test_seqkd_ctranslate2.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


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


def write_reverse_corpus(folder: Path, sizes=(("train", 400), ("valid", 40), ("test", 40)), seed=0):
    """Source: random words; target: the words reversed and upper-cased (a reordering task)."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(30)]
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in sizes:
        with open(folder / f"{split}.src", "w") as fs, open(folder / f"{split}.tgt", "w") as ft:
            for _ in range(count):
                words = [rng.choice(vocab) for _ in range(rng.randint(2, 9))]
                fs.write(" ".join(words) + "\n")
                ft.write(" ".join(w.upper() for w in reversed(words)) + "\n")
    return folder


@pytest.fixture
def warm_recipe_children(monkeypatch):
    """The recipe's fairseq-train and fairseq-generate commands (CommandExecutor's children) run in
    children of the warm interpreter (:func:`run_warm`), with the environment and log file a new
    process gets; the recipe's other children (its ``python -m`` steps each run once: a warm server
    would cost the imports a new process costs), and any child with a terminal to draw on, run as
    new processes. For recipe tests whose claim is the steps' work; scripts/quality_benchmark.sh's
    test runs the recipe with every child a new process."""
    from fairseq_kd.progress import child_progress
    from fairseq_kd_recipes.execute import CommandExecutor

    run_new = CommandExecutor._run_child

    def run_child(command, log, step):
        with child_progress() as (env, terminal):
            if not terminal and command[1:2] != ["-m"]:
                log.flush()
                status = run_warm(command, env, Path(log.name), Path(log.name))
                if status is not None:
                    return status
        return run_new(command, log, step)

    monkeypatch.setattr(CommandExecutor, "_run_child", staticmethod(run_child))


@pytest.fixture(autouse=True, scope="session")
def _stop_warm_interpreters():
    yield
    WarmInterpreter.stop_all()


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
def tiny_data_bin(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_data")
    raw = write_reverse_corpus(root / "raw")
    dest = root / "bin"
    run_cli(
        "fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", raw / "train", "--validpref", raw / "valid", "--testpref", raw / "test",
        "--destdir", dest, "--joined-dictionary", "--workers", "1", warm=True,
    )
    return dest


@pytest.fixture(scope="session")
def tiny_teacher(tiny_data_bin, tmp_path_factory) -> Path:
    """A 3+3-layer, 4-head, d=32 teacher trained for 40 updates with stock --task translation."""
    save = tmp_path_factory.mktemp("tiny_teacher")
    run_cli(
        "fairseq-train", tiny_data_bin, "--task", "translation", *TINY_TEACHER_ARGS,
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        *COMMON_TRAIN_ARGS, "--max-update", "40", "--save-dir", save, "--user-dir", USER_DIR, warm=True,
    )
    return save / "checkpoint_last.pt"


@pytest.fixture(scope="session")
def tiny_hf_teachers(tmp_path_factory):
    """Tiny Hugging Face teachers on a synthetic corpus, for the test files of Hugging Face teachers:
    ``make(families, seed, sizes=(train, valid, test), **model_sizes)`` gives ``raw`` (the de -> en
    corpus of fairseq_kd.data.synthetic.write_corpus), ``teachers`` ({family: folder}, built from
    configs by tests/test_hf_teacher.py's save_teachers: nothing downloaded) and ``data`` ({family:
    the train and valid text binarised by fairseq-kd-hf-data in its vocabulary}). Each corpus and
    teacher is made once per worker for the same arguments and shared by the files asking for it:
    tests read them, and copy a teacher before changing it."""
    from types import SimpleNamespace

    made = {}

    def make(families, seed, sizes, **model_sizes):
        from test_hf_teacher import LANGUAGE_CODES, SRC, TGT, save_teachers

        from fairseq_kd.cli import hf_data
        from fairseq_kd.data.synthetic import write_corpus

        corpus = (seed, tuple(sizes))
        if corpus not in made:
            made[corpus] = tmp_path_factory.mktemp("hf_raw")
            train, valid, test = sizes
            write_corpus(made[corpus], seed=seed, train_size=train, valid_size=valid, test_size=test,
                         source_lang=SRC, target_lang=TGT)
        raw, teachers, data = made[corpus], {}, {}
        for family in families:
            key = (corpus, family, tuple(sorted(model_sizes.items())))
            if key not in made:
                root = tmp_path_factory.mktemp(f"hf_{family}")
                teacher = save_teachers((family,), raw, root, **model_sizes)[family]
                codes = LANGUAGE_CODES.get(family)
                languages = ["--teacher-source-lang", codes[0], "--teacher-target-lang", codes[1]] if codes else []
                hf_data.cli_main(["--teacher", str(teacher), "-s", SRC, "-t", TGT, "--trainpref", str(raw / "train"),
                                  "--validpref", str(raw / "valid"), "--destdir", str(root / "data-bin"), *languages])
                made[key] = teacher, root / "data-bin"
            teachers[family], data[family] = made[key]
        return SimpleNamespace(raw=raw, teachers=teachers, data=data)

    return make


@pytest.fixture(scope="module")
def teachers(hf) -> dict:
    """{family: teacher folder} of the module's ``hf`` fixture (its :func:`tiny_hf_teachers`' result)."""
    return hf.teachers


@pytest.fixture(scope="module")
def data_bins(hf) -> dict:
    """{family: data-bin} of the module's ``hf`` fixture (its :func:`tiny_hf_teachers`' result)."""
    return hf.data


def seqkd_config(data, teacher, output, **overrides):
    """An in-process sequence-level KD run's config with tests/test_seqkd.py's settings: short length
    limits keep the tiny teacher fast; the 400 training sentences in 7 shards of 64."""
    from fairseq_kd.teacher_pass import seqkd

    values = dict(data=str(data), teacher_checkpoint=str(teacher), output=str(output), max_len_a=1.2,
                  max_len_b=10, shard_size=64)
    values.update(overrides)
    return seqkd.SeqKDConfig(**values)


@pytest.fixture(scope="session")
def seqkd_fairseq_runs(tiny_data_bin, tiny_teacher, tmp_path_factory):
    """{beam: finished output} of the tiny teacher's sequence-level KD data by the fairseq engine, in
    process, with beams 1 and 5 (:func:`seqkd_config`): the reference the other engines' tests
    compare with (tests/test_seqkd_ctranslate2.py, tests/test_seqkd_hf.py), made once per worker;
    they read it."""
    from fairseq_kd.teacher_pass import seqkd

    root = tmp_path_factory.mktemp("seqkd_fairseq")
    folders = {}
    for beam in (1, 5):
        folders[beam] = root / f"fairseq_beam{beam}"
        result = seqkd.run(seqkd_config(tiny_data_bin, tiny_teacher, folders[beam], engine="fairseq", beam=beam),
                           log=lambda _line: None)
        assert result.status == "complete" and result.sentences == 400
    return folders


@pytest.fixture
def hashed_files(monkeypatch):
    """Names of the files read to hash them from now on, in order: by a fingerprint or by the
    teacher's own hash (FrozenTeacher.sha256), both in fairseq_kd.fingerprint."""
    from fairseq_kd import fingerprint

    hashed = []

    def counted(path, *args, hash_file=fingerprint._digests):
        hashed.append(Path(path).name)
        return hash_file(path, *args)

    monkeypatch.setattr(fingerprint, "_digests", counted)
    return hashed


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


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
