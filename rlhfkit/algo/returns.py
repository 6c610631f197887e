"""Per-token returns: discounted reward-to-go (REINFORCE family) and GAE (PPO).

Time steps are the *action tokens* of a row (`loss_mask == 1`), in order. In multi-turn
trajectories the action tokens form several spans separated by environment-feedback
"holes" (mask 0). Holes are not time steps: the step after the last token of one turn is
the first token of the next turn, so discounting counts action tokens only, and GAE
bootstraps from the value of the next *action* token (the environment's tokens are part of
the transition). After the last action token of a row the episode ends (V = 0, no
bootstrap, also for truncated rows). Without holes this is the usual recurrence over the
response; with gamma = lambda = 1 (the defaults) holes change nothing at all.

Implementation: action tokens are packed to the left of each row (`_compact`), the scan
runs there and results are scattered back (`_expand`), zero off the mask. The scan
`y_t = x_t + d * y_{t+1}` is vectorised: a flip-cumsum when d = 1, otherwise blocks of 64
steps done as one float64 matmul with a discount matrix, the carries between blocks being
the same scan one level up (so a 8k-token row takes 3 levels, not 8k Python steps).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
_BLOCK = 64


def _wide(x: Tensor) -> Tensor:
    """float64 stays float64 (the advantage pipeline runs in it); anything else becomes float32."""
    return x if x.dtype == torch.float64 else x.float()


def _compact_index(mask: Tensor) -> Tensor:
    """`[B, L]` column of each token in the left-packed layout; L (a spare column) off the mask."""
    m = mask.bool()
    pos = torch.cumsum(m.long(), dim=1) - 1
    return torch.where(m, pos, torch.full_like(pos, mask.shape[1]))


def _compact(x: Tensor, idx: Tensor, mask: Tensor) -> Tensor:
    """Left-pack the masked entries of `x` `[B, L]` -> `[B, L]` (zeros after the last one)."""
    out = torch.zeros(x.shape[0], x.shape[1] + 1, dtype=x.dtype, device=x.device)
    out.scatter_(1, idx, x * mask.to(x.dtype))
    return out[:, :-1]


def _expand(xc: Tensor, idx: Tensor, mask: Tensor) -> Tensor:
    """Inverse of `_compact`: back to the original positions, zero off the mask."""
    padded = torch.cat([xc, torch.zeros_like(xc[:, :1])], dim=1)
    return padded.gather(1, idx) * mask.to(xc.dtype)


def reverse_discounted_cumsum(x: Tensor, discount: float) -> Tensor:
    """`y[:, t] = x[:, t] + discount * y[:, t + 1]` along the last dim of `x` `[B, N]`."""
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}")
    if discount == 0.0 or x.shape[-1] == 0:
        return x.clone()
    if discount == 1.0:
        return x.double().flip(-1).cumsum(-1).flip(-1).to(x.dtype)
    return _blocked_scan(x.double(), float(discount)).to(x.dtype)


def _blocked_scan(x: Tensor, d: float) -> Tensor:
    """Blocked form of the discounted scan (float64); see the module docstring."""
    b, n = x.shape
    c = min(_BLOCK, n)
    nb = -(-n // c)
    xb = torch.nn.functional.pad(x, (0, nb * c - n)).view(b, nb, c)
    j = torch.arange(c, device=x.device, dtype=x.dtype)
    expo = j[None, :] - j[:, None]  # [c, c]: k - j
    dmat = torch.where(expo >= 0, torch.pow(torch.tensor(d, dtype=x.dtype, device=x.device), expo.clamp(min=0)),
                       torch.zeros((), dtype=x.dtype, device=x.device))
    local = xb @ dmat.T  # local[..., j] = sum_{k >= j in block} d^(k-j) x_k
    if nb > 1:
        starts = reverse_discounted_cumsum(local[:, :, 0], d ** c)  # full y at each block's first step
        carry = torch.cat([starts[:, 1:], torch.zeros_like(starts[:, :1])], dim=1)  # y at next block's start
        local = local + carry[:, :, None] * torch.pow(torch.tensor(d, dtype=x.dtype, device=x.device), c - j)
    return local.reshape(b, nb * c)[:, :n]


def discounted_returns(token_rewards: Tensor, loss_mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE reward-to-go over action tokens: G_t = rho_t + gamma * G_{next action}.

    Args:
        token_rewards: `[B, L]` shaped per-token rewards rho (zero off the mask).
        loss_mask: `[B, L]` action mask (env-feedback holes are skipped, see module doc).
        gamma: discount in [0, 1].
    Returns:
        `[B, L]` returns, zero off the mask; float32 (float64 for float64 rewards).
    """
    idx = _compact_index(loss_mask)
    rc = _compact(_wide(token_rewards), idx, loss_mask)
    return _expand(reverse_discounted_cumsum(rc, gamma), idx, loss_mask)


def gae_advantages_and_returns(token_rewards: Tensor, values: Tensor, loss_mask: Tensor,
                               gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (GAE): exponentially weighted sums of TD residuals.

    Over the action tokens of each row (holes skipped, V = 0 after the last action):
        delta_t = rho_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lambda * A_{t+1}
        R_t     = A_t + V_t
    Args:
        token_rewards: `[B, L]` shaped per-token rewards rho.
        values: `[B, L]` critic values V_t aligned with the action tokens.
        loss_mask: `[B, L]` action mask.
        gamma, lambd: `--gamma`, `--lambd` in [0, 1].
    Returns:
        (advantages, returns), both `[B, L]` float32 (float64 for float64 rewards), zero off the mask.
    """
    if values.shape != token_rewards.shape:
        raise ValueError(f"values {tuple(values.shape)} and rewards {tuple(token_rewards.shape)} differ")
    idx = _compact_index(loss_mask)
    rc = _compact(_wide(token_rewards), idx, loss_mask)
    vc = _compact(values.to(rc.dtype), idx, loss_mask)
    v_next = torch.cat([vc[:, 1:], torch.zeros_like(vc[:, :1])], dim=1)
    delta = rc + gamma * v_next - vc
    adv_c = reverse_discounted_cumsum(delta, gamma * lambd)
    adv = _expand(adv_c, idx, loss_mask)
    returns = adv + values.to(adv.dtype) * loss_mask.to(adv.dtype)
    return adv, returns
