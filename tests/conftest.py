"""Shared fixtures: tiny binarised data, a tiny trained teacher, in-process models and criterions.

The data is a copy task with reordering (target = source reversed, upper-cased) so a few dozen
updates already give a teacher that is better than chance; the fixtures are session-scoped so the
whole suite binarises and trains the teacher once. How commands run: tests/command_runners.py;
what a criterion's tests use: tests/criterion_kit.py (the names of both are re-exported here).
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
from criterion_kit import (  # noqa: F401 - re-exported for the test files; kd_task and tiny_batch are fixtures
    COMMON_TRAIN_ARGS,
    CRITERION_FACTORIES,
    TINY_STUDENT_ARGS,
    TINY_TEACHER_ARGS,
    USER_DIR,
    build_tiny_student,
    criterion_factory,
    criterion_maker,
    criterion_test_module,
    hidden_state_criterions,
    kd_criterions,
    kd_task,
    make_batch,
    tiny_batch,
    train_student,
)

SHARED_DATA = REPO.parent / "shared" / "data"


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


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
