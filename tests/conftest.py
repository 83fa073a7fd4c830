"""Shared fixtures: tiny binarised data, a tiny trained teacher, in-process models, CLI runners.

The data is a copy task with reordering (target = source reversed, upper-cased) so a few dozen
updates already give a teacher that is better than chance; the fixtures are session-scoped so the
whole suite binarises and trains the teacher once.
"""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
BIN = Path(sys.executable).parent
USER_DIR = str(REPO / "fairseq_kd")
QUIET_ENV = {
    **os.environ,
    "PYTHONWARNINGS": "ignore",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

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
    "test_recipe_hf_teacher.py", "test_end_to_end.py", "test_deploy_benchmark.py", "test_promises.py",
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


def _run_here(argv, main, user_error_prog=None) -> subprocess.CompletedProcess:
    """``main()`` in this process with its stdout and stderr captured, as a CompletedProcess for
    ``argv``: SystemExit gives the exit status; with ``user_error_prog``, a plugin user error gives
    the line the plugin's excepthook prints under that fairseq command and status 1 (any other
    exception propagates)."""
    import contextlib
    import io

    from fairseq_kd.cli import user_errors

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Exception as error:  # noqa: BLE001 - a plugin user error is the expected outcome
            if user_error_prog is None or not user_errors._is_plugin_user_error(error, error.__traceback__):
                raise
            err.write(user_errors.one_line(user_error_prog, error))
            code = 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def run_cli_here(name: str, *args) -> subprocess.CompletedProcess:
    """Run one of the plugin's own console scripts (``fairseq-kd-*``) in this process, for tests of
    what it refuses before any work: the same ``cli_main`` and the same one line as
    :func:`run_cli` gives, without a new interpreter's seconds of importing torch and fairseq.
    Commands that do work (train, decode, export) run through :func:`run_cli`."""
    from importlib.metadata import entry_points

    (entry,) = entry_points(group="console_scripts", name=name)
    args = [str(arg) for arg in args]
    return _run_here([name, *args], lambda: entry.load()(args))


def run_fairseq_train_here(*args) -> subprocess.CompletedProcess:
    """``fairseq-train ARGS`` in this process, for tests of what the plugin refuses before training:
    fairseq's own ``cli_main`` on these arguments, and the line the plugin's excepthook prints under
    ``fairseq-train`` (``fairseq-train: error: MESSAGE [...]``, exit status 1) for the plugin's user
    error it raises, without a new interpreter's seconds of importing torch and fairseq. That a real
    ``fairseq-train`` prints this line and no traceback is tested through :func:`run_cli`
    (test_refusals' moved teacher); runs that train use :func:`run_cli`. Any other exception
    propagates."""
    from fairseq_cli import train as fairseq_train

    import fairseq_kd

    fairseq_kd.register()  # what --user-dir's import does in a fresh fairseq-train
    argv = ["fairseq-train", *map(str, args)]
    saved_argv = sys.argv
    try:
        sys.argv = argv  # fairseq's cli_main reads its arguments there
        return _run_here(argv, fairseq_train.cli_main, user_error_prog="fairseq-train")
    finally:
        sys.argv = saved_argv


class WarmInterpreter:
    """A client of one tests/warm_interpreter.py server: one console script in children
    forked from an interpreter that has done the script's imports (see that module for what such a
    child is), started with the startup environment of the requests it takes."""

    SERVER = Path(__file__).with_name("warm_interpreter.py")
    _servers: dict = {}

    def __init__(self, name: str, env) -> None:
        self.proc = subprocess.Popen([sys.executable, str(self.SERVER), name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=dict(env), cwd=REPO)
        self.proc.stdin.write((json.dumps(dict(env)) + "\n").encode())  # the server's first line
        self.pending = b""
        self.ended = {}  # pid -> exit status of children not yet waited for

    @classmethod
    def for_script(cls, name: str, env) -> "WarmInterpreter":
        """This worker's server of script ``name`` for ``env``'s startup variables, started on first use."""
        from warm_interpreter import startup_environment

        key = (name, tuple(sorted(startup_environment(env).items())))
        server = cls._servers.get(key)
        if server is None or server.proc.poll() is not None:
            server = cls._servers[key] = cls(name, env)
        return server

    @classmethod
    def stop_all(cls) -> None:
        for server in cls._servers.values():  # nothing to save: their children have ended
            server.proc.kill()
            server.proc.wait(timeout=60)
            server.proc.stdin.close()
            server.proc.stdout.close()
        cls._servers.clear()

    def _answer(self, deadline=None) -> dict:
        import select
        import time

        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ConnectionError("the warm interpreter ended")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def start(self, argv, env, stdout: Path, stderr: Path, cwd=None):
        """The pid of a child started as the script run as ``argv``, its output appended to the
        files ``stdout`` and ``stderr`` (the same file for one interleaved output); None if this
        server cannot run it."""
        request = {"argv": [str(arg) for arg in argv], "env": dict(env), "cwd": None if cwd is None else str(cwd),
                   "stdout": str(stdout), "stderr": str(stderr)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            answer = self._answer()
            if "status" not in answer:
                return answer.get("pid")
            self.ended[answer["pid"]] = answer["status"]

    def wait(self, pid: int, timeout=None) -> int:
        """The exit status of child ``pid`` (subprocess's convention: minus the signal's number if
        one ended it); after ``timeout`` seconds it is killed and TimeoutExpired raised."""
        import signal
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.ended:
            try:
                answer = self._answer(deadline)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self.wait(pid)
                raise subprocess.TimeoutExpired(str(pid), timeout) from None
            if "status" in answer:
                self.ended[answer["pid"]] = answer["status"]
        return self.ended.pop(pid)


class WarmChild:
    """A child of a warm interpreter (:func:`popen_warm`), used like a ``subprocess.Popen`` with its
    stdout and stderr piped as text: ``communicate``, ``kill``, ``returncode``."""

    def __init__(self, server: WarmInterpreter, pid: int, args, stdout: Path, stderr: Path) -> None:
        self.server, self.pid, self.args, self.stdout, self.stderr = server, pid, args, stdout, stderr
        self.returncode = None

    def communicate(self, timeout=None):
        if self.returncode is None:
            self.returncode = self.server.wait(self.pid, timeout)
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""  # noqa: E731
        return read(self.stdout), read(self.stderr)

    def kill(self) -> None:
        import signal

        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def popen_warm(command, env, folder: Path, name: str):
    """``command`` started as a child of this worker's warm interpreter (:func:`run_warm`), its
    stdout and stderr in files ``folder/name.stdout`` and ``.stderr``: a :class:`WarmChild`, or a
    ``subprocess.Popen`` (output piped, text) when it must run as a new process."""
    from warm_interpreter import warm_entry

    path = Path(str(command[0]))
    if path.parent == BIN and warm_entry(path.name) is not None:
        server = WarmInterpreter.for_script(path.name, env)
        out, err = folder / f"{name}.stdout", folder / f"{name}.stderr"
        try:
            pid = server.start(command, env, out, err)
        except (ConnectionError, BrokenPipeError):
            pid = None
        if pid is not None:
            return WarmChild(server, pid, command, out, err)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run_warm(command, env, stdout: Path, stderr: Path, cwd=None, timeout=None):
    """``command``, a command line of a console script of fairseq or of the plugin in this
    environment, in a child of this worker's warm interpreter of that script for ``env``
    (tests/warm_interpreter.py), its output appended to the files ``stdout`` and ``stderr``: its exit
    status, or None when it must run as a new process (another program, or no server)."""
    from warm_interpreter import warm_entry

    path = Path(str(command[0]))
    if path.parent != BIN or warm_entry(path.name) is None:
        return None
    try:
        server = WarmInterpreter.for_script(path.name, env)
        pid = server.start(command, env, stdout, stderr, cwd=cwd)
    except (ConnectionError, BrokenPipeError):
        return None
    return None if pid is None else server.wait(pid, timeout)


@pytest.fixture
def warm_recipe_children(monkeypatch):
    """The recipe's fairseq-train and fairseq-generate commands (CommandExecutor's children) run in
    children of the warm interpreter (:func:`run_warm`), with the environment and log file a new
    process gets; the recipe's other children, and any child with a terminal to draw on, run as
    new processes. For recipe tests whose claim is the steps' work; scripts/quality_benchmark.sh's
    test runs the recipe with every child a new process."""
    from fairseq_kd.progress import child_progress
    from fairseq_kd_recipes.execute import CommandExecutor

    run_new = CommandExecutor._run_child

    def run_child(command, log, step):
        with child_progress() as (env, terminal):
            if not terminal:
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


def run_cli(name: str, *args, check=True, cwd=None, timeout=600, warm=False) -> subprocess.CompletedProcess:
    """Run a console script of the environment (fairseq-train, fairseq-generate, ...). ``warm``: a
    command of fairseq or of the plugin runs in a child of the warm interpreter (:func:`run_warm`:
    the same command line, environment and output as a new process, without its seconds of
    importing torch and fairseq), for tests whose claim is the command's work, not what a new
    interpreter does."""
    cmd = [str(BIN / name), *map(str, args)]
    proc = _run_warm_captured(cmd, cwd, timeout) if warm else None
    if proc is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=QUIET_ENV, cwd=cwd, timeout=timeout)
    # fairseq-train sometimes aborts ("terminate called without an active exception", SIGABRT) while
    # tearing down threads after it has finished and saved: the run itself succeeded.
    if proc.returncode == -6 and "done training" in proc.stdout + proc.stderr:
        proc.returncode = 0
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{name} failed ({proc.returncode}):\n{' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def _run_warm_captured(cmd, cwd, timeout):
    """:func:`run_warm` under QUIET_ENV with stdout and stderr captured, as a CompletedProcess
    (None if the command must run as a new process)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="warm_") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        status = run_warm(cmd, QUIET_ENV, out, err, cwd=cwd, timeout=timeout)
        if status is None:
            return None
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""  # noqa: E731
        return subprocess.CompletedProcess(cmd, status, read(out), read(err))


def run_module(module: str, *args, check=True, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    """Run ``python -m module`` in the environment."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=QUIET_ENV, cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{module} failed ({proc.returncode}):\n{' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


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


def criterion_maker(name: str):
    """``make_<name without _kd>(task, **overrides)`` of the criterion's test file: the criterion with
    the options its tests use on the tiny models (shared tests build it through this)."""
    short = name[:-3] if name.endswith("_kd") else name
    module = criterion_test_module(name)
    maker = getattr(module, f"make_{short}", None)
    if maker is None:
        raise AssertionError(f"tests/test_{name}.py must define make_{short}(task, **overrides)")
    return maker


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


def sacrebleu_command_line(folder: Path, references, systems, *flags, seed=12345):
    """The ``sacrebleu`` command on files written from the given text (``systems``: (name, lines)
    pairs, the baseline first), with ``SACREBLEU_SEED=seed``: its parsed JSON output, a list of
    rows for the paired tests, one object otherwise. The independent reference for every number
    fairseq-kd-score and fairseq-kd-report print."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    ref = folder / "sacrebleu_ref.txt"
    ref.write_text("".join(line + "\n" for line in references), encoding="utf-8")
    inputs = []
    for name, lines in systems:
        path = folder / f"sacrebleu_{name}.txt"
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        inputs.append(str(path))
    script = Path(sys.executable).parent / "sacrebleu"
    proc = subprocess.run([str(script), str(ref), "-i", *inputs, "-m", "bleu", "-f", "json", "-w", "10", *flags],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "SACREBLEU_SEED": str(seed)})
    return json.loads(proc.stdout)
