"""Shipping a distilled model: CTranslate2 export (int8 and other quantisations) and decoding.

``export_ctranslate2`` turns any checkpoint the plugin reads (a student, a teacher, an averaged or
exported one) into a CTranslate2 model folder; ``ctranslate2_engine`` decodes fairseq-binarised
data with it, token ids in and token ids out, for ``fairseq-kd-translate``, sequence-level KD
(``fairseq-kd-seqkd --engine ctranslate2``) and the deploy benchmark. CTranslate2 is the
``deploy`` extra (``pip install 'fairseq-kd[deploy]'``) and is imported only here.
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
