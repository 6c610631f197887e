"""Critic and reward-model roles: a backbone + `score` head giving per-token values.

Alignment (docs/architecture.md): `values[:, t]` is V of the state *before* token t, i.e. the
head applied to the hidden state at position t - 1, so it lines up with `logprobs[:, t]` and
`loss_mask[:, t]`. The reward model's score is the head at the last non-padding token.

    critic.forward_values(batch)   -> [B, L]
    critic.train_on(batch)         -> metrics (clipped value loss, global token count per step)
    reward.forward_rewards(batch)  -> [B]
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.backend.base import TrainBackend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.losses.reduce import HostValues
from rlhfkit.losses.value import value_loss
from rlhfkit.models.value import reward_at_last_token
from rlhfkit.roles.actor import UpdateConfig, average, micro_batches, mini_batches, reduce_over_ranks
from rlhfkit.types import ExperienceBatch


def shift_values(raw: torch.Tensor) -> torch.Tensor:
    """Per-position head outputs [B, L] -> values aligned with predicted tokens (V_t = head(h_{t-1}))."""
    out = torch.zeros_like(raw)
    out[:, 1:] = raw[:, :-1]
    return out


class CriticRole:
    def __init__(self, backend: TrainBackend, dist: DistInfo, update_cfg: UpdateConfig | None, value_clip: float | None,
                 micro_rollout_batch_size: int = 8, rollout_max_tokens: int | None = None) -> None:
        self.backend, self.dist, self.update_cfg = backend, dist, update_cfg
        self.value_clip = value_clip
        self.micro_rollout_batch_size = micro_rollout_batch_size
        self.rollout_max_tokens = rollout_max_tokens
        self.device = torch.device(dist.device)

    def _values(self, mb: ExperienceBatch) -> torch.Tensor:
        raw = self.backend.forward(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
        return shift_values(raw) * mb.attention_mask

    @torch.no_grad()
    def forward_values(self, batch: ExperienceBatch) -> torch.Tensor:
        self.backend.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        row = 0
        for mb, real in micro_batches(batch, self.micro_rollout_batch_size, self.dist,
                                      max_tokens=self.rollout_max_tokens):
            v = self._values(mb.to(self.device)).float().cpu()[:real]
            out[row:row + real, :v.shape[1]] = v
            row += real
        return out

    def train_on(self, batch: ExperienceBatch) -> dict[str, float]:
        cfg = self.update_cfg
        assert cfg is not None
        self.backend.train()
        records = []
        skipped = 0.0
        for epoch in range(cfg.max_epochs):
            for mini in mini_batches(batch, cfg.train_batch_size, epoch, cfg.seed + 1, self.dist):
                # whole rows: summed over dp (cp ranks hold the same rows)
                num_tokens = float(self.dist.all_reduce_dp(torch.tensor(float(mini.loss_mask.sum()),
                                                                        dtype=torch.float64)))
                sums: dict[str, Any] = {}
                n = 0
                for mb, _ in micro_batches(mini, cfg.micro_train_batch_size, self.dist,
                                           max_tokens=cfg.max_tokens_per_micro):
                    mb = mb.to(self.device)
                    assert mb.values is not None and mb.returns is not None, "train_on takes values and returns"
                    loss, m = value_loss(self._values(mb), mb.values, mb.returns, mb.loss_mask,
                                         value_clip=self.value_clip, num_tokens=num_tokens, sync_metrics=False)
                    self.backend.backward(loss)
                    for k, v in m.items():  # in double, as the python floats were
                        v = v.detach().double() if isinstance(v, torch.Tensor) else float(v)
                        sums[k] = sums[k] + v if k in sums else v
                    n += 1
                pending = HostValues(sums)  # read after the optimizer step's own sync
                stats = self.backend.optimizer_step()
                sums = pending.result()
                rec = {k: v / max(n, 1) for k, v in sums.items()}
                rec["critic_loss"] = sums.get("critic_loss", 0.0)
                rec["critic_grad_norm"] = stats.get("grad_norm", float("nan"))
                skipped += stats.get("nonfinite_skipped", 0.0)  # the same on every rank
                records.append(rec)
        out = reduce_over_ranks(average(records), ("critic_loss",), self.dist)
        out["critic_nonfinite_skipped"] = skipped
        out["value_loss"] = out.pop("critic_loss", float("nan"))
        return out


class RewardModelRole:
    """One or several frozen reward models; the reward is the sum of their scores. With `offload`
    (--reward_offload) the models wait in host memory between calls (no-op on a CPU device)."""

    def __init__(self, models: list[Any], dist: DistInfo, micro_batch_size: int = 8, offload: bool = False) -> None:
        self.models, self.dist = models, dist
        self.micro_batch_size = micro_batch_size
        self.device = torch.device(dist.device)
        self.offload = offload and self.device.type != "cpu"
        self._place("cpu")

    def _place(self, device: str | torch.device) -> None:
        if self.offload:
            for m in self.models:
                m.to(device)

    @torch.no_grad()
    def forward_rewards(self, batch: ExperienceBatch) -> torch.Tensor:
        self._place(self.device)
        try:
            return self._rewards(batch)
        finally:
            self._place("cpu")

    def _rewards(self, batch: ExperienceBatch) -> torch.Tensor:
        out = []
        for mb, real in micro_batches(batch, self.micro_batch_size, self.dist, aligned=False):
            mb = mb.to(self.device)
            total = torch.zeros(mb.batch_size, device=self.device)
            for m in self.models:
                m.eval()
                total = total + reward_at_last_token(m(input_ids=mb.input_ids, attention_mask=mb.attention_mask),
                                                     mb.attention_mask).float()
            out.append(total.cpu()[:real])
        return torch.cat(out) if out else torch.zeros(0)
