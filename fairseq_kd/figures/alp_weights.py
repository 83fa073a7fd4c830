"""The ALP-KD layer weights a ``--criterion alp_kd`` checkpoint holds, for ``fairseq-kd-plot alp``
(torch and fairseq imported when they are read)."""
from typing import Dict, List


def layer_weights_from_checkpoint(path) -> Dict[str, List[List[float]]]:
    """The mean ALP-KD layer weights (per side, a row over teacher layers per student layer) saved
    in a checkpoint of a ``--criterion alp_kd`` run."""
    from ..checkpoints import load_fairseq_checkpoint, task_state
    from ..criterions.alp_kd import mean_alpha
    from ..errors import InputError

    state = load_fairseq_checkpoint(path)  # weights_only=True, explicitly
    saved = task_state(state).get("criterion", {})
    weights = mean_alpha((saved.get("alpha_sums") or {}).get("sums", {}))
    if not weights:
        raise InputError(f"{path}: no ALP-KD layer weights in this checkpoint (it must come from fairseq-train "
                         "--task translation_kd --criterion alp_kd, saved after at least one training step)")
    return weights
