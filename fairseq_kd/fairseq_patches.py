"""Every change the plugin makes to fairseq, installed by one call: :func:`install`, made by
:func:`fairseq_kd.register` (so by ``--user-dir fairseq_kd`` and by every plugin command). fairseq
itself is not forked; these attributes are replaced, each wrapping fairseq's own:

* ``fairseq.checkpoint_utils.torch`` (its ``load`` always ``weights_only=True``) and
  ``checkpoint_utils.load_checkpoint_to_cpu`` (a refused class named with its file):
  :func:`fairseq_kd.checkpoints.safe_loading.install`;
* ``checkpoint_utils.load_checkpoint``, for the tasks with ``checkpoint_guard = True``
  (``translation_kd``): the resume checks, :func:`fairseq_kd.checkpoints.resume_checks.install`;
* ``fairseq.options.parse_args_and_arch`` (``--bf16`` no longer implies ``--tpu``) and
  ``FP16Optimizer``'s ``state_dict``/``load_state_dict`` (its float32 master weights kept):
  :func:`fairseq_kd.half_precision.install`.

No module patches fairseq when imported.
"""


def install() -> None:
    """Install every patch listed above; each part is idempotent."""
    from . import half_precision
    from .checkpoints import resume_checks, safe_loading

    safe_loading.install()
    resume_checks.install()
    half_precision.install()
