from . import translation_kd  # noqa: F401  (registers the task)
