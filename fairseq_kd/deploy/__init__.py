"""Shipping a distilled model: the exports (plain fairseq, CTranslate2, Hugging Face) and the
decoding engines of their folders (docs/design/deploy.md). CTranslate2, the ``deploy`` extra, is
imported through :func:`import_ctranslate2`.
"""

from ..errors import MissingDependencyError

CTRANSLATE2_FIX = ("install CTranslate2 into this environment: pip install 'fairseq-kd[deploy]' "
                   "(or pip install 'ctranslate2>=4.4,<5'; scripts/setup_env.sh does it in .venv)")


class CTranslate2MissingError(MissingDependencyError):
    """CTranslate2 is not installed."""


def import_ctranslate2():
    """The ``ctranslate2`` module, or :class:`CTranslate2MissingError` naming the fix."""
    try:
        import ctranslate2
    except ImportError as error:
        raise CTranslate2MissingError(f"CTranslate2 cannot be imported ({error}); {CTRANSLATE2_FIX}") from error
    return ctranslate2
