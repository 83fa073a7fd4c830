"""Model architectures, the frozen teacher and feature capture. fairseq imports every module of a
user directory's ``models/`` package itself; importing the architectures here keeps their
registration explicit when the package is imported directly."""
from . import architectures  # noqa: F401  (registers the architectures)
