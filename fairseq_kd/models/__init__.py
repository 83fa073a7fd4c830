"""Model architectures and feature capture.

fairseq imports every module of a user directory's ``models/`` package itself; importing the
architectures here keeps the registration explicit when the package is imported directly.
"""
from . import architectures  # noqa: F401  (registers the architectures)
from .feature_capture import (  # noqa: F401
    ATTENTION_KINDS,
    DECODER_CROSS,
    DECODER_SELF,
    ENCODER_SELF,
    AttentionMaps,
    CapturedFeatures,
    CaptureRequest,
    FeatureCapture,
    NotATransformerError,
)
from .shape import TransformerShape  # noqa: F401
