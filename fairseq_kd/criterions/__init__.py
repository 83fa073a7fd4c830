"""Distillation criterions, one module per method: every module is imported (and so registered)
with the package, which fairseq does not do for a user directory's ``criterions/``."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
