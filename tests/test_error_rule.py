"""The commands' rule (issue 41): user errors are exactly the plugin's own error classes.

A :class:`fairseq_kd.errors.UserError` is one line (``PROG: error: MESSAGE``); any other exception,
a ValueError or OSError of a bug included, keeps its traceback, under the plugin's own commands
(``exits_on_user_error``) and under fairseq's (``install_for_fairseq_command``'s excepthook).
Every exception class the package defines is a user error, or named here as internal.
"""
import importlib
import inspect
import pkgutil
import sys

import pytest

import fairseq_kd
from fairseq_kd import errors
from fairseq_kd.cli import user_errors

# Exception classes of the package that never reach a user: caught where they are raised.
INTERNAL = {"_Unreadable", "_Unverifiable"}


def test_every_exception_class_of_the_package_is_a_user_error_or_internal():
    found = {}
    for module_info in pkgutil.walk_packages(fairseq_kd.__path__, "fairseq_kd."):
        try:
            module = importlib.import_module(module_info.name)
        except ImportError:  # an optional dependency (CTranslate2, transformers) is absent
            continue
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    assert len(found) > 20  # the walk saw the package's classes
    not_user = sorted(path for path, cls in found.items()
                      if not issubclass(cls, errors.UserError) and cls.__name__ not in INTERNAL)
    assert not_user == []


@pytest.mark.parametrize("error, base", [
    (errors.InputError("bad value"), ValueError), (errors.PathError("--x 'p': no such file"), ValueError),
    (errors.FileAccessError(13, "Permission denied", "/data/x.txt"), OSError),
    (errors.MissingDependencyError("pip install ctranslate2"), ImportError)])
def test_a_user_error_is_one_line_and_status_2(error, base, capsys):
    assert isinstance(error, base)  # callers' `except ValueError` and the like keep working

    @user_errors.exits_on_user_error("fairseq-kd-test")
    def main():
        raise error

    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fairseq-kd-test: error: ")
    if isinstance(error, OSError):
        assert "/data/x.txt: Permission denied" in err


@pytest.mark.parametrize("bug", [ValueError("a bug"), OSError(5, "Input/output error"), KeyError("k"),
                                 RuntimeError("torch's")])
def test_any_other_exception_keeps_its_traceback(bug, capsys):
    @user_errors.exits_on_user_error("fairseq-kd-test")
    def main():
        raise bug

    with pytest.raises(type(bug)):
        main()
    assert capsys.readouterr().err == ""


def test_under_a_fairseq_command_only_user_errors_lose_their_traceback(monkeypatch, capsys):
    passed_on = []
    monkeypatch.delenv(user_errors.TRACEBACK_VARIABLE, raising=False)
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, traceback: passed_on.append(error))
    assert user_errors.install_for_fairseq_command("/venv/bin/fairseq-train")
    bug, mistake = ValueError("raised by a line of the plugin"), errors.InputError("--kd-weight -1: must be >= 0")
    for error in (bug, mistake):
        try:
            raise error
        except type(error) as caught:
            sys.excepthook(type(caught), caught, caught.__traceback__)
    assert passed_on == [bug]  # Python's own hook prints its traceback
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fairseq-train: error: --kd-weight -1: must be >= 0 [")
