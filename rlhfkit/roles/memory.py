"""Device memory of role calls: each call's peak, and an out-of-memory that says where it happened.

    meter = CallMemory("policy", rank=0, device="cuda:0")
    with meter.call("train_on"):          # the allocator's peak is reset before, read after
        role.train_on(batch)
    meter.take() -> {"train_on": {"reserved": bytes, "allocated": bytes}}
                                          the largest peaks of each method since the last take()

    torch.cuda.OutOfMemoryError inside the block -> RoleOutOfMemory(role, rank, method, reserved, total, cause)

"reserved" is `torch.cuda.max_memory_reserved`: what this process's caching allocator held, which is
what the memory plan (rlhfkit/distributed/memory_plan.py) predicts for a role; "allocated" is the
peak of live tensors (the difference is the allocator's cache and fragmentation). On a CPU device the
meter records nothing.

`advice(...)` names the flags to change for the phase that ran out; the command sets it as the
error's `hint`, so the one line a user reads has the role, the phase, the numbers and the flag.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

GiB = 2**30
PHASES = {"train_on": "training", "forward_logprobs": "experience making (log-probs)",
          "forward_values": "experience making (values)", "forward_rewards": "experience making (rewards)",
          "weights": "weight sync", "generate": "generation"}


class RoleOutOfMemory(RuntimeError):
    """A role call ran out of device memory; carries who, where and how much."""

    def __init__(self, role: str, rank: int, method: str, reserved: int, total: int, cause: str) -> None:
        self.role, self.rank, self.method = role, rank, method
        self.reserved, self.total, self.cause = reserved, total, cause
        self.hint = ""  # the flag to change, added by the command that knows its flags (`advice`)
        super().__init__(role, rank, method, reserved, total, cause)

    def __str__(self) -> str:
        return (f"{self.role} rank {self.rank} ran out of GPU memory in {self.phase} ({self.method}): "
                f"{self.reserved / GiB:.1f} of {self.total / GiB:.1f} GiB held by this process"
                + (f"; {self.hint}" if self.hint else f"; {self.cause}"))

    @property
    def phase(self) -> str:
        return PHASES.get(self.method, self.method)

    def __reduce__(self):  # crosses Ray's process boundary with its fields
        return (RoleOutOfMemory, (self.role, self.rank, self.method, self.reserved, self.total, self.cause))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


class CallMemory:
    """Per-method peak reserved bytes of one process's device; see the module docstring."""

    def __init__(self, role: str, rank: int, device: str) -> None:
        self.role, self.rank = role, rank
        self.device = torch.device(device) if device.startswith("cuda") else None
        self.peaks: dict[str, dict[str, int]] = {}

    @contextmanager
    def call(self, method: str) -> Iterator[None]:
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        except torch.cuda.OutOfMemoryError as e:
            held = torch.cuda.memory_reserved(self.device) if self.device is not None else 0
            total = torch.cuda.get_device_properties(self.device).total_memory if self.device is not None else 0
            raise RoleOutOfMemory(self.role, self.rank, method, held, total, _first_line(e)) from None
        finally:
            if self.device is not None:
                now = {"reserved": torch.cuda.max_memory_reserved(self.device),
                       "allocated": torch.cuda.max_memory_allocated(self.device)}
                seen = self.peaks.setdefault(method, now)
                for k, v in now.items():
                    seen[k] = max(seen[k], v)

    def take(self) -> dict[str, dict[str, int]]:
        out, self.peaks = self.peaks, {}
        return out


def advice(err: RoleOutOfMemory, *, dynamic_batch: bool, train_tokens: int, rollout_tokens: int,
           micro_train: int, micro_rollout: int, checkpointing: bool, engine_awake_in_training: bool) -> str:
    """The flags to change for the phase that ran out, as one clause (set as `err.hint`)."""
    if err.method == "train_on":
        flags = ([f"lower --train_max_tokens_per_gpu {train_tokens}"] if dynamic_batch
                 else [f"lower --micro_train_batch_size {micro_train}"])
        if not checkpointing:
            flags.append("add --gradient_checkpointing")
        if engine_awake_in_training:
            flags.append("add --vllm_enable_sleep (the colocated engines hold their memory during training)")
    elif err.method.startswith("forward_"):
        flags = ([f"lower --rollout_max_tokens_per_gpu {rollout_tokens}"] if dynamic_batch
                 else [f"lower --micro_rollout_batch_size {micro_rollout}"])
        if engine_awake_in_training:
            flags.append("add --vllm_enable_sleep")
    else:
        flags = ["add --deepspeed_enable_sleep", "use more GPUs"]
    return ", or ".join(flags)
