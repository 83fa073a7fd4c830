"""How the tests run commands: fairseq's and the plugin's console scripts as new processes
(:func:`run_cli`, :func:`run_module`), in this process for what they refuse before any work
(:func:`run_cli_here`, :func:`run_fairseq_train_here`), or as children of a warm interpreter
(:class:`WarmInterpreter`, tests/warm_interpreter.py: the same command line without a new
interpreter's seconds of importing torch and fairseq); and sacrebleu's command line, the reference
for every score. Imported by conftest, which re-exports these names."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
QUIET_ENV = {
    **os.environ,
    "PYTHONWARNINGS": "ignore",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


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
    from warm_interpreter import warm_name

    script = warm_name(command, BIN)
    if script is not None:
        server = WarmInterpreter.for_script(script, env)
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
    environment or ``python -m`` of one of their modules, in a child of this worker's warm interpreter
    of that script or module for ``env`` (tests/warm_interpreter.py), its output appended to the files
    ``stdout`` and ``stderr``: its exit status, or None when it must run as a new process (another
    program, or no server)."""
    from warm_interpreter import warm_name

    name = warm_name(command, BIN)
    if name is None:
        return None
    try:
        server = WarmInterpreter.for_script(name, env)
        pid = server.start(command, env, stdout, stderr, cwd=cwd)
    except (ConnectionError, BrokenPipeError):
        return None
    return None if pid is None else server.wait(pid, timeout)


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


def run_module(module: str, *args, check=True, cwd=None, timeout=600, warm=False) -> subprocess.CompletedProcess:
    """Run ``python -m module`` in the environment; ``warm``: in a child of the warm interpreter, as
    :func:`run_cli` does."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    proc = _run_warm_captured(cmd, cwd, timeout) if warm else None
    if proc is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=QUIET_ENV, cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{module} failed ({proc.returncode}):\n{' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


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
