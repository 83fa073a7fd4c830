"""Distillation criterions, one module per method.

fairseq does not import a user directory's ``criterions/`` package by itself, so every module here
is imported (and so registered) when the package is; shared modules (base, losses, ...)
register nothing, so importing them too is harmless.
"""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
