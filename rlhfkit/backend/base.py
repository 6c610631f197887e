"""The `TrainBackend` protocol: what roles and trainers may ask of a training backend.

A backend owns one model, its optimizer and LR schedule, and the way they are spread over
ranks (FSDP2 by default). One optimizer step with gradient accumulation over k micro-batches:

    for i, micro in enumerate(micro_batches):                 # k per rank
        loss, metrics = loss_fn(backend.forward(...), micro)  # divided by the GLOBAL count
        backend.backward(loss, sync_grads=(i == k - 1))
    stats = backend.optimizer_step()                          # clip, step, zero, LR schedule

`backward` makes gradients the *sum* over ranks, so the sum of micro-losses divided by the global
token / sample count gives the same update as one big batch on one rank (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from rlhfkit.parallel.dist import DistInfo


@runtime_checkable
class TrainBackend(Protocol):
    model: nn.Module
    """The module to call for forward passes (sharded / autocast-wrapped as configured)."""
    dist: DistInfo
    device: torch.device
    compute_dtype: torch.dtype
    optimizer: torch.optim.Optimizer | None
    """None: an inference-only backend (a reference or teacher model, built with `optim_cfg=None`)."""

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken (skipped non-finite steps excluded); restored on resume."""
        ...

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward pass. Roles call the model only through this and `token_logprobs`,
        so that an input hook (context parallelism: shard the sequence, align the shift) lives here."""
        ...

    def token_logprobs(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """`rlhfkit.models.forward.token_logprobs` of the model (same keywords)."""
        ...

    def backward(self, loss: torch.Tensor, sync_grads: bool = True) -> None:
        """Backpropagate `loss`; `sync_grads=False` for all but the last micro-batch of a step."""
        ...

    def optimizer_step(self) -> dict[str, float]:
        """Clip to --max_norm, step (skipped when the loss or the grad norm is non-finite on any
        rank), zero grads, step the LR; raises `guard.NonFiniteError` after more than
        --max_nonfinite_steps skips in a row or when a weight became non-finite, and
        `guard.DivergenceError` when a weight grew past --max_weight_growth or after more than
        --max_zero_grad_steps exactly-zero gradients in a row.

        Returns {"grad_norm", "lr", "skipped", "nonfinite_skipped"}; "lr" is the rate this step used.
        """
        ...

    def train(self) -> None: ...

    def eval(self) -> None: ...

    def unwrap(self) -> nn.Module:
        """The underlying HF module (under FSDP2 its parameters are DTensor shards)."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 CPU state dict on rank 0, `{}` on other ranks (all ranks must call)."""
        ...

    def named_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for weight sync to a rollout engine (all ranks iterate)."""
        ...

    def save_hf(self, path: str, tokenizer: Any = None, dtype: torch.dtype | None = None,
                max_shard_size: int | str | None = None) -> None:
        """Hugging Face directory (config, safetensors shards + index, tokenizer); all ranks call,
        rank 0 writes."""
        ...

    def save_checkpoint(self, ckpt_root: str, tag: str, client_state: dict | None,
                        max_keep: int) -> str: ...

    def load_checkpoint(self, ckpt_root: str, tag: str | None = None) -> dict | None:
        """The newest complete checkpoint under `ckpt_root` (or `tag`); its client state, or None."""
        ...

    def offload_states(self) -> Any:
        """Move parameters, gradients and optimizer states to host memory (sleep); returns the
        seconds and bytes moved (`rlhfkit.backend.offload.MoveStats`)."""
        ...

    def reload_states(self) -> Any:
        """Move them back to the training device, bit for bit (wake up); returns `MoveStats`."""
        ...


class CheckpointingBackend(Protocol):
    """What saving and resuming a role needs of its backend: a `TrainBackend`, or on Ray the group's
    `distributed.group.GroupBackend` (every rank takes part, rank 0's answer is returned)."""

    def save_checkpoint(self, ckpt_root: str, tag: str, client_state: dict | None, max_keep: int) -> str: ...

    def load_checkpoint(self, ckpt_root: str, tag: str | None = None) -> dict | None: ...

    def save_hf(self, path: str, tokenizer: Any = None, dtype: torch.dtype | None = None) -> None: ...
