"""Start-up checks of the attention-distillation criterions (a2d_kd, tinybert, minilm): a message
naming the flag to change when the criterion is built, not a shape error in training."""
from typing import Sequence

from ..errors import InputError
from ..models.feature_capture import (DECODER_CROSS, DECODER_SELF, ENCODER_SELF, CaptureRequest, FeatureCapture,
                                      NotATransformerError)
from ..models.shape import TransformerShape

#: the fairseq flag that sets the head count of each attention kind (cross-attention is built
#: with the decoder's head count)
HEADS_FLAG = {ENCODER_SELF: "--encoder-attention-heads", DECODER_SELF: "--decoder-attention-heads",
              DECODER_CROSS: "--decoder-attention-heads"}


def check_capturable(teacher, request: CaptureRequest, criterion_name: str) -> None:
    """Fail if the teacher's attention of the requested kinds cannot be captured (entering a capture
    installs, and leaving removes, the hooks training uses, without running the model)."""
    try:
        with FeatureCapture(teacher.model, request):
            pass
    except NotATransformerError as err:
        raise InputError(
            f"criterion {criterion_name!r}: the attention maps of --teacher-checkpoint "
            f"{teacher.path!r} cannot be captured: {err}"
        ) from err


def check_equal_heads(teacher: TransformerShape, student: TransformerShape, kinds: Sequence[str],
                      criterion_name: str) -> None:
    """One clear error listing every attention kind whose student and teacher head counts differ."""
    problems = []
    for kind in kinds:
        student_heads, teacher_heads = student.kind_size(kind)[1], teacher.kind_size(kind)[1]
        if student_heads != teacher_heads:
            problems.append(
                f"{kind.replace('_', ' ')} attention: student {student_heads} heads, teacher "
                f"{teacher_heads} ({HEADS_FLAG[kind]})"
            )
    if problems:
        raise InputError(
            f"criterion {criterion_name!r} compares attention head by head, so the student needs the "
            f"teacher's head counts: {'; '.join(problems)}. Set {HEADS_FLAG[ENCODER_SELF]} / "
            f"{HEADS_FLAG[DECODER_SELF]} to the teacher's, or use --criterion a2d_kd, which aligns "
            "any number of heads."
        )
