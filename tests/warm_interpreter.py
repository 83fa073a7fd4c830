"""One console script of fairseq's (fairseq-train, fairseq-generate, fairseq-preprocess, ...) or of
the plugin's (fairseq-kd-seqkd, ...) run in children forked from a warm interpreter: a server process
that has done what the console script does before it reads its arguments (``from fairseq_cli.train
import cli_main``: torch, fairseq and that module's own logging set-up, in the script's order) and
nothing else. Each child spares the seconds a new interpreter spends importing torch and fairseq
(a tiny fairseq-train: 5.9 s as a new process, 2.0 s as a child; fairseq-preprocess 3.4 s and 0.1 s).

A child starts where a new process of the script would be after its imports: a fairseq command has not
imported the plugin (``--user-dir`` imports and registers it, as in a new process), the root logger writes
to the stream the script's module chose, now on the output files asked for (file descriptors 1
and 2 replaced), its environment, working folder and ``sys.argv``/``sys.path[0]`` are the
script's, its exit status is what the script's ``sys.exit(cli_main())`` gives (an uncaught
exception goes through ``sys.excepthook`` and gives 1; its traceback, if the hook prints one, starts
at this module's frame instead of the script's) and its exit handlers run. Only scripts
whose entry point is in ``fairseq_cli`` or ``fairseq_kd.cli`` run here (:func:`warm_entry`), and
``python -m MODULE`` of fairseq's or the project's modules (the server imports the module, as ``python
-m`` does first; the child runs its code anew as ``__main__`` with ``python -m``'s ``sys.argv`` and
``sys.path[0]``, the working folder), and only under the startup environment the server was started
with (:func:`startup_environment`: what an interpreter, torch or OpenMP read when they start); the
caller runs anything else as a new process (``tests/command_runners.py``, :func:`warm_name`).

Protocol (JSON lines on the server's stdin and stdout): first the environment the server was
started with, then requests ``{"argv", "env", "cwd", "stdout", "stderr"}`` (paths, opened for
appending; the same path for both gives one interleaved output). The server answers
``{"pid": PID}`` when the child starts, or ``{"error": WHY}`` for a request it cannot run, and
``{"pid": PID, "status": STATUS}`` when a child ends (a signal: minus its number, as subprocess
reports it); several children may run at once.
"""
from __future__ import annotations

import json
import os
import sys

#: prefixes of the environment variables read when an interpreter, torch, OpenMP or MKL start
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "MALLOC_", "ATEN_", "TORCH_", "CUDA_",
                    "NCCL_", "LC_", "LANG")


def startup_environment(env) -> dict:
    """The variables of ``env`` that act when a process starts: a child of the server has the
    server's, so a request must have the same ones."""
    return {key: value for key, value in env.items() if key.startswith(STARTUP_PREFIXES)}


#: the modules whose console scripts run in a warm interpreter: fairseq's commands and the plugin's
WARM_MODULES = ("fairseq_cli.", "fairseq_kd.cli.")
#: the packages whose modules run as ``python -m MODULE`` in a warm interpreter (the server imports
#: the module, as ``python -m`` does before running it; each child runs it anew as ``__main__``)
WARM_PACKAGES = ("fairseq_cli.", "fairseq_kd.", "fairseq_kd_recipes.")


def warm_entry(name: str):
    """The entry point of console script ``name`` if it is fairseq's or the plugin's
    (:data:`WARM_MODULES`), else None."""
    from importlib.metadata import entry_points

    found = list(entry_points(group="console_scripts", name=name))
    return found[0] if found and found[0].value.startswith(WARM_MODULES) else None


def warm_name(command, bin_folder):
    """The server that runs ``command``: a console script of ``bin_folder`` (:func:`warm_entry`) by its
    name, ``python -m MODULE`` of this interpreter and :data:`WARM_PACKAGES` as ``-m MODULE``; None
    for anything else (it runs as a new process)."""
    from pathlib import Path

    program = Path(str(command[0]))
    if program.parent == Path(bin_folder) and warm_entry(program.name) is not None:
        return program.name
    if (str(program) == sys.executable and len(command) > 2 and command[1] == "-m"
            and str(command[2]).startswith(WARM_PACKAGES)):
        return f"-m {command[2]}"
    return None


def _run_as_main(module: str) -> None:
    """``python -m module`` after its imports: the module's code run anew as ``__main__``."""
    import runpy

    sys.modules.pop(module, None)  # (the server's import of it ran its imports; its own code runs here)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _exit_status(code) -> int:
    """What ``sys.exit(code)`` makes the process's exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_child(main, request: dict, threads: int) -> None:
    """In the forked child: become the console script and exit with its status (never returns)."""
    status = 1
    try:
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = out if request["stderr"] == request["stdout"] else os.open(
            request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err, devnull}:
            os.close(fd)
        sys.stdout = sys.__stdout__  # the interpreter's own stdout (the server answered on it), now the file
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("cwd"):
            os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        if sys.argv[1:2] == ["-m"]:  # python -m: the module's arguments (runpy sets argv[0]), the folder it runs in
            sys.argv, sys.path[0] = sys.argv[2:], os.getcwd()
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # a script's own folder
        if threads is not None:  # what the server's start made of OMP_NUM_THREADS, if it imported torch
            sys.modules["torch"].set_num_threads(threads)
        try:
            status = _exit_status(main())
        except SystemExit as exit_:
            status = _exit_status(exit_.code)
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            sys.excepthook(*sys.exc_info())
            status = 1
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the server's own failure, reported on the child's stderr
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(status)


class _Lines:
    """Lines read from a file descriptor as they come (select, not a buffered reader, so that a
    line already read is never waiting unseen in a buffer)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pending = fd, b""

    def next(self, timeout=None):
        """The next line; None if none came within ``timeout`` seconds; EOFError at the end."""
        import select

        while b"\n" not in self.pending:
            if not select.select([self.fd], [], [], timeout)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise EOFError
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line


def serve(name: str) -> None:
    """Answer requests until stdin ends; children run at the same time (their statuses come as
    they end, each ``{"pid", "status"}``)."""
    module = name[3:] if name.startswith("-m ") else None
    entry = warm_entry(name) if module is None else None
    answers = sys.stdout

    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    requests = _Lines(sys.stdin.fileno())
    started = json.loads(requests.next())
    if module is not None and module.startswith(WARM_PACKAGES):
        import importlib

        sys.argv, sys.path[0] = ["-m"], os.getcwd()  # what python -m has while it imports
        importlib.import_module(module)  # the module's imports, in its order

        def main():
            _run_as_main(module)
    elif entry is not None:
        # what a console script of this environment has while it imports: its path, its folder first
        sys.argv = [os.path.join(os.path.dirname(sys.executable), name)]
        sys.path[0] = os.path.dirname(sys.argv[0])
        main = entry.load()  # the console script's own imports: torch, fairseq, the module's logging
    else:
        answer({"error": f"{name} is neither a console script nor a module of fairseq or the plugin"})
        return
    threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    # What the interpreter added to the environment at its start (LC_CTYPE, when it coerces a C
    # locale) a new process would add too.
    added = {key: value for key, value in os.environ.items() if key not in started}
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    running = set()
    while True:
        try:
            line = requests.next(timeout=0.02 if running else None)
        except EOFError:
            return
        if line is not None:
            request = json.loads(line)
            if startup_environment(request["env"]) != startup_environment(started):
                answer({"error": "another startup environment"})
            else:
                request["env"] = {**added, **request["env"]}
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_child(main, request, threads)
                running.add(pid)
                answer({"pid": pid})
        while running:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            answer({"pid": pid, "status": os.waitstatus_to_exitcode(wait_status)})


if __name__ == "__main__":
    serve(sys.argv[1])
