"""The epoch sums of stateful criterions (ALP-KD's layer weights, internal KD's schedule)."""
from typing import Dict, Optional

import torch
from torch import Tensor


class EpochSums:
    """Running float64 sums of a training epoch's tensors, on the device, with checkpoint state:
    each worker's own (docs/methods/README.md). :meth:`begin_epoch` keeps them when called again
    with their epoch (a resume in the middle of it) and starts empty otherwise."""

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
