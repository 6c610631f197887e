"""Knowledge distillation on response tokens (token-level KD, as OpenRLHF's train_kd).

    L = (1 - alpha) * NLL + alpha * KD,   alpha = `--kd_coef` (default 0.4)
    NLL = -sum_t m_t log q(x_t) / num_tokens
    KD  =  sum_t m_t KL(p_t || q_t) / num_tokens,   KL(p || q) = sum_v p(v) (log p(v) - log q(v))

p = teacher, q = student token distributions (forward KL). OpenRLHF uses the cross-entropy
-sum_v p log q instead of the KL; the two differ by the teacher's entropy, a constant for
the student, so gradients are the same (the logged value is 0 for a perfect student here).
Vocabulary entries where p = 0 contribute 0 (also where the student logit is -inf).
Metrics: `kd_loss`, `nll_loss` (local token means).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhfkit.losses.reduce import Count, finish_metrics, local_mean, token_sum_over

Tensor = torch.Tensor


def forward_kl(teacher_logits: Tensor, student_logits: Tensor) -> Tensor:
    """`[..., V]` logits -> `[...]` KL(teacher || student), float32."""
    return _forward_kl(_log_softmax(teacher_logits), _log_softmax(student_logits))


def _log_softmax(logits: Tensor) -> Tensor:
    return F.log_softmax(logits.float(), dim=-1)


def _forward_kl(t_logp: Tensor, s_logp: Tensor) -> Tensor:
    if t_logp.shape != s_logp.shape:
        raise ValueError(f"teacher logits {tuple(t_logp.shape)} and student logits "
                         f"{tuple(s_logp.shape)} differ (vocabularies must match)")
    p = t_logp.exp()
    terms = torch.where(p > 0, p * (t_logp - s_logp), torch.zeros_like(p))
    return terms.sum(dim=-1)


def distill_loss(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, loss_mask: Tensor, *,
                 kd_coef: float = 0.4, num_tokens: Count = None, sync_metrics: bool = True
                 ) -> tuple[Tensor, dict[str, float]]:
    """KD + NLL of one micro-batch.

    Args:
        student_logits, teacher_logits: `[B, L, V]`, position t being the distribution of
            token t (already shifted: aligned with `labels`).
        labels: `[B, L]` target token ids.
        loss_mask: `[B, L]` 1 on response tokens.
        kd_coef: alpha in [0, 1].
        num_tokens: global response-token count of the step.
    """
    if not 0.0 <= kd_coef <= 1.0:
        raise ValueError(f"--kd_coef must be in [0, 1], got {kd_coef}")
    s_logp = _log_softmax(student_logits)
    kd = _forward_kl(_log_softmax(teacher_logits.detach()), s_logp)
    target = labels.long().clamp(min=0)  # ignored positions (-100) are off the mask
    nll = -s_logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    loss = (1.0 - kd_coef) * token_sum_over(nll, loss_mask, num_tokens) \
        + kd_coef * token_sum_over(kd, loss_mask, num_tokens)
    return loss, finish_metrics({"kd_loss": local_mean(kd, loss_mask), "nll_loss": local_mean(nll, loss_mask)},
                                sync_metrics)
