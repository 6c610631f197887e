"""Loss reduction with global denominators, and metric conversion.

A loss over one micro-batch divides by a count of the *whole optimizer step* (every
micro-batch on every rank), passed in by the caller:

    token level:    sum_{b,t} l_bt * m_bt / num_tokens
    sequence level: sum_b [sum_t l_bt m_bt / sum_t m_bt] / num_sequences   (rows with m = 0 skipped)
    sample level:   sum_b l_b / num_samples

so that the sum of micro-batch losses (gradients summed over ranks by the backend) equals
the loss of one big batch: results do not depend on micro-batching or on the number of
ranks. When a count is None the local count is used, which is right only when the
micro-batch is the whole step. Counts are clamped to >= 1 so an empty step gives 0.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rlhfkit.algo.masked import masked_mean

Tensor = torch.Tensor
Count = float | int | Tensor | None
# a micro-batch's metrics as a training loop receives them: floats or 0-d device tensors (read after the step)
MicroMetrics = Mapping[str, Tensor | float]

TOKEN = "token"
SEQUENCE = "seq"
AGGREGATIONS = (TOKEN, SEQUENCE)


def _denominator(count: Count, local: Tensor, name: str) -> Tensor | float:
    if count is None:
        return local.clamp(min=1.0)
    if isinstance(count, Tensor):
        return count.to(local.device, torch.float32).clamp(min=1.0)
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return max(float(count), 1.0)


def token_sum_over(per_token: Tensor, mask: Tensor, num_tokens: Count = None) -> Tensor:
    """sum(l * m) / num_tokens (global action-token count of the step)."""
    m = mask.to(torch.float32)
    return (per_token.float() * m).sum() / _denominator(num_tokens, m.sum(), "num_tokens")


def seq_mean_over(per_token: Tensor, mask: Tensor, num_sequences: Count = None) -> Tensor:
    """sum over rows of the row's token mean, / num_sequences (global count of non-empty rows)."""
    m = mask.to(torch.float32)
    lengths = m.sum(dim=1)
    row_means = (per_token.float() * m).sum(dim=1) / lengths.clamp(min=1.0)
    return row_means.sum() / _denominator(num_sequences, (lengths > 0).float().sum(), "num_sequences")


def sample_sum_over(per_sample: Tensor, num_samples: Count = None) -> Tensor:
    """sum(l_b) / num_samples (global sample or pair count of the step)."""
    local = torch.tensor(float(per_sample.shape[0]), device=per_sample.device)
    return per_sample.float().sum() / _denominator(num_samples, local, "num_samples")


def aggregate(per_token: Tensor, mask: Tensor, mode: str = TOKEN, *, num_tokens: Count = None,
              num_sequences: Count = None) -> Tensor:
    """Token- or sequence-level reduction (`mode` in `AGGREGATIONS`)."""
    if mode == TOKEN:
        return token_sum_over(per_token, mask, num_tokens)
    if mode == SEQUENCE:
        return seq_mean_over(per_token, mask, num_sequences)
    raise ValueError(f"loss aggregation {mode!r} is not one of {AGGREGATIONS}")


def local_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Masked mean over this micro-batch (for metrics)."""
    return masked_mean(x.detach(), mask)


def to_floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Tensor metrics -> python floats with one device sync."""
    return HostValues(metrics).result()


def finish_metrics(metrics: dict[str, Tensor | float], sync: bool) -> dict[str, Any]:
    """A loss function's metrics: python floats (one device sync) when `sync`, else as they are (0-d
    device tensors, which a training loop sums over micro-batches and reads after the optimizer step's
    own sync: a read per micro-batch would drain the GPU between each forward and its backward)."""
    return to_floats(metrics) if sync else dict(metrics)


class HostValues:
    """Metrics (floats or 0-d tensors) on their way to the host without a sync now: the tensors are
    stacked and copied into pinned memory behind the work already queued; `result()` waits only for
    that copy. Read it after something else has synced (an optimizer step's decision) and it costs
    nothing."""

    def __init__(self, metrics: dict[str, Tensor | float]) -> None:
        self._order = list(metrics)
        self._floats = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
        self._keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
        self._host: Tensor | None = None
        self._event = None
        if self._keys:
            vals = torch.stack([metrics[k].detach().double().reshape(()) for k in self._keys])  # type: ignore[union-attr]
            if vals.is_cuda:
                self._host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
                self._host.copy_(vals, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
            else:
                self._host = vals

    def result(self) -> dict[str, float]:
        if self._event is not None:
            self._event.synchronize()
        out = dict(self._floats)
        if self._host is not None:
            out.update(zip(self._keys, self._host.tolist()))
        return {k: out[k] for k in self._order}
