"""The epoch sums of stateful criterions (ALP-KD's layer weights, internal KD's schedule)."""
from typing import Dict, Optional

import torch
from torch import Tensor


class EpochSums:
    """Running sums of a training epoch's tensors, with checkpoint state.

    * Adding keeps the sums on the device in float64, without autograd, so it never synchronises a
      training step.
    * Data parallel: every worker sums only its own batches; nothing is reduced across workers
      here. A method that needs the pooled value passes per-step values through
      ``DistillationTerms.logs``, which fairseq gathers from every worker, and adds them in
      :meth:`.method.DistillationMethod.reduce_worker_logs` (internal KD's schedule does).
      The checkpoint holds the sums of the worker that writes it (rank 0).
    * Dummy batches (a worker out of data trains on one with its loss zeroed): the caller adds
      nothing while ``is_dummy_batch`` is set.
    * Resume: :meth:`begin_epoch` keeps the sums when called again with the epoch they belong to
      (a run resumed in the middle of that epoch) and starts empty otherwise.
    """

    def __init__(self):
        self.epoch: Optional[int] = None
        self.sums: Dict[str, Tensor] = {}

    def begin_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.sums, self.epoch = {}, epoch

    def add(self, name: str, value: Tensor) -> None:
        value = value.detach().to(torch.float64)
        if name in self.sums:
            value = value + self.sums[name].to(value.device)
        self.sums[name] = value

    def state(self) -> dict:
        return {"epoch": self.epoch, "sums": {name: value.cpu() for name, value in self.sums.items()}}

    def load_state(self, state: dict) -> None:
        self.epoch = state.get("epoch")
        self.sums = {name: torch.as_tensor(value, dtype=torch.float64).clone()
                     for name, value in state.get("sums", {}).items()}
