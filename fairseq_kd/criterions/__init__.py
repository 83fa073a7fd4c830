"""Distillation criterions, one module per method.

fairseq does not import a user directory's ``criterions/`` package by itself, so every module here
is imported (and so registered) when the package is.
"""
import importlib
import pkgutil

_SHARED_MODULES = {"base", "losses"}

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name not in _SHARED_MODULES:
        importlib.import_module(f"{__name__}.{_module.name}")
