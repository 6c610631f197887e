"""Exponential moving average of the trained weights (`--enable_ema`, `--ema_beta`).

After every optimizer step that was taken (a skipped non-finite step changes nothing):

    ema <- beta * ema + (1 - beta) * w          (Polyak averaging; ema starts at the initial w)

w are the optimizer's own fp32 weights: this rank's FSDP2 shards, or the fp32 master weights of a
one-process bf16 run, or the parameters themselves. The averages are fp32 copies in host memory,
one per weight shard, so the accelerator holds nothing more. As in OpenRLHF, the EMA model is
what gets exported (`FSDP2Backend.save_hf`: the final model and `--save_hf_ckpt` snapshots), while
training and the rollout engines use the live weights.

`swapped_in()` exchanges the averages with the live weights for the duration of a `with` block
(each tensor swapped through one temporary host copy), so the exporter reads the averages with no
second copy of the model. Checkpoints carry the averages (`state_dict`), as DTensors laid out like
their weights when sharded, so they reshard on resume with everything else.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """The storage-sharing local tensor of a DTensor (call under no_grad), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


class EMAWeights:
    """fp32 host copies of `named` (name, live weight) pairs, averaged by `update()`."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], beta: float) -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"--ema_beta must be in [0, 1], got {beta}")
        self.beta = float(beta)
        self.names = [n for n, _ in named]
        self.live = [t for _, t in named]
        with torch.no_grad():
            self.values = [_local(t).detach().to("cpu", torch.float32, copy=True) for t in self.live]

    @torch.no_grad()
    def update(self) -> None:
        """ema = beta * ema + (1 - beta) * w, for every weight."""
        b = self.beta
        for v, t in zip(self.values, self.live):
            v.mul_(b).add_(_local(t).detach().to("cpu", torch.float32), alpha=1.0 - b)

    @torch.no_grad()
    def _swap(self) -> None:
        for v, t in zip(self.values, self.live):
            w = _local(t)
            tmp = w.detach().to("cpu", torch.float32, copy=True)
            w.copy_(v.to(w.device, w.dtype))
            v.copy_(tmp)

    @contextlib.contextmanager
    def swapped_in(self, after_swap: Callable[[], None] | None = None) -> Iterator[None]:
        """The averages in the live weights inside the block; the live weights back after it.
        `after_swap` runs after each exchange (e.g. rounding fp32 masters into a bf16 module)."""
        self._swap()
        try:
            if after_swap is not None:
                after_swap()
            yield
        finally:
            self._swap()
            if after_swap is not None:
                after_swap()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{name: average}: DTensors with their weight's mesh and placements when sharded (the live
        storage: torch.distributed.checkpoint saves from it and loads into it in place)."""
        out = {}
        for n, v, t in zip(self.names, self.values, self.live):
            if hasattr(t, "device_mesh"):
                from torch.distributed.tensor import DTensor

                out[n] = DTensor.from_local(v, t.device_mesh, t.placements, run_check=False,
                                            shape=t.shape, stride=t.stride())
            else:
                out[n] = v
        return out

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Take the averages from `sd` (as given by `state_dict()`, after a checkpoint filled it)."""
        for n, v in zip(self.names, self.values):
            src = _local(sd[n])
            if src.data_ptr() != v.data_ptr():
                v.copy_(src)
