"""DPOTask vs a short reference: per-sequence log-prob sums, DPO/IPO/cDPO/NLL, packing, additivity."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.parallel.dist import DistInfo
from rlhfkit.backend.fsdp2 import FSDP2Backend
from rlhfkit.config.configs import BackendConfig
from rlhfkit.data.items import PreferenceItem
from rlhfkit.models.loader import load_tokenizer
from rlhfkit.trainers.dpo_task import DPOTask, FrozenModel, masked_sums

TEXTS = [("1+2=", "3", "4"), ("12+3=", "15", "51"), ("hello ", "world", "there, friend"), ("ab", "c", "dd")]


def _items(tok) -> list[PreferenceItem]:
    out = []
    for p, c, r in TEXTS:
        pi = tok(p, add_special_tokens=False)["input_ids"]
        ci = tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ri = tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(PreferenceItem(pi + ci, [0] * len(pi) + [1] * len(ci), pi + ri, [0] * len(pi) + [1] * len(ri)))
    return out


def _load(path: str, noise: float = 0.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if noise:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn(p.shape, generator=g))
    return model


def _frozen(model) -> FrozenModel:
    return FrozenModel(FSDP2Backend(model, BackendConfig(param_dtype="fp32", device="cpu"), None, 1, DistInfo()))


def _seq_logp(model, ids: list[int], mask: list[int]) -> tuple[float, int]:
    """Reference: sum over response tokens t of log p(ids[t] | ids[:t]), one unpadded sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = F.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    m = torch.tensor(mask[1:], dtype=torch.float32)
    return float((lp * m).sum()), int(m.sum())


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    return tok, _load(tiny_model_dir, noise=0.05), _load(tiny_model_dir)


def _reference_terms(policy, ref, items):
    pc, nc = zip(*[_seq_logp(policy, it.chosen_ids, it.chosen_loss_mask) for it in items])
    pr, _ = zip(*[_seq_logp(policy, it.rejected_ids, it.rejected_loss_mask) for it in items])
    rc, _ = zip(*[_seq_logp(ref, it.chosen_ids, it.chosen_loss_mask) for it in items])
    rr, _ = zip(*[_seq_logp(ref, it.rejected_ids, it.rejected_loss_mask) for it in items])
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    return t(pc), t(pr), t(rc), t(rr), t(nc)


@pytest.mark.parametrize("packing", [False, True])
def test_losses_match_reference(setup, packing):
    tok, policy, ref = setup
    items = _items(tok)
    pc, pr, rc, rr, nc = _reference_terms(policy, ref, items)
    beta = 0.5
    z = (pc - pr) - (rc - rr)
    cases = [
        (dict(), -F.logsigmoid(beta * z)),
        (dict(ipo=True), (z - 1 / (2 * beta)) ** 2),
        (dict(label_smoothing=0.2), -0.8 * F.logsigmoid(beta * z) - 0.2 * F.logsigmoid(-beta * z)),
        (dict(nll_loss_coef=0.3), -F.logsigmoid(beta * z) + 0.3 * (-pc / nc)),
    ]
    for kw, per_pair in cases:
        task = DPOTask(pad_token_id=tok.pad_token_id, ref=_frozen(ref), beta=beta, packing=packing, **kw)
        loss, m = task.loss(policy, task.collate(items), global_count=8.0)
        assert math.isclose(loss.item(), per_pair.sum().item() / 8, rel_tol=1e-4), kw
    cr, rj = beta * (pc - rc), beta * (pr - rr)
    assert math.isclose(m["chosen_reward"], cr.sum().item() / 8, rel_tol=1e-4)
    assert math.isclose(m["rejected_reward"], rj.sum().item() / 8, rel_tol=1e-4)
    assert math.isclose(m["margin"], (cr - rj).sum().item() / 8, rel_tol=1e-4)
    assert m["acc"] == float((cr > rj).sum()) / 8
    assert math.isclose(m["preference_loss"], -F.logsigmoid(beta * z).sum().item() / 8, rel_tol=1e-4)


def test_policy_equal_to_reference_gives_log2(setup):
    tok, _, ref = setup
    task = DPOTask(pad_token_id=tok.pad_token_id, ref=_frozen(ref), beta=0.1)
    loss, m = task.loss(ref, task.collate(_items(tok)), global_count=4.0)
    assert math.isclose(loss.item(), math.log(2), rel_tol=1e-5)
    assert m["acc"] == 0.0 and abs(m["margin"]) < 1e-6
    task = DPOTask(pad_token_id=tok.pad_token_id, ref=_frozen(ref), beta=0.1, ipo=True)
    assert math.isclose(task.loss(ref, task.collate(_items(tok)), 4.0)[0].item(), 25.0, rel_tol=1e-5)


def test_micro_batches_add_up_and_eval_means(setup):
    tok, policy, ref = setup
    items = _items(tok)
    task = DPOTask(pad_token_id=tok.pad_token_id, ref=_frozen(ref), beta=0.2)
    whole_loss, whole = task.loss(policy, task.collate(items), 4.0)
    parts = [task.loss(policy, task.collate(items[i:i + 2]), 4.0) for i in (0, 2)]
    assert math.isclose(sum(p[0].item() for p in parts), whole_loss.item(), rel_tol=1e-5)
    for k in whole:
        assert math.isclose(sum(p[1][k] for p in parts), whole[k], rel_tol=1e-5, abs_tol=1e-7), k
    ev = task.eval_metrics(policy, [task.collate(items[:1]), task.collate(items[1:])])
    for k in ("loss", "acc", "margin", "chosen_reward", "rejected_reward"):
        assert math.isclose(ev[f"eval/{k}"], whole[k], rel_tol=1e-5, abs_tol=1e-7), k


def test_gradient_flows_only_into_the_policy(setup):
    tok, policy, ref = setup
    task = DPOTask(pad_token_id=tok.pad_token_id, ref=_frozen(ref), beta=0.1)
    loss, _ = task.loss(policy, task.collate(_items(tok)), 4.0)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    assert all(p.grad is None and not p.requires_grad for p in ref.parameters())
    policy.zero_grad(set_to_none=True)


def test_masked_sums_padded_and_packed():
    from rlhfkit.data.collate import pack_batch, pad_batch
    from rlhfkit.data.items import SFTItem

    items = [SFTItem([5, 6, 7], [0, 1, 1]), SFTItem([8, 9], [0, 1])]
    vals = {"pad": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]]), "pack": torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])}
    for key, seqs in (("pad", pad_batch(items, 0)), ("pack", pack_batch(items))):
        sums, counts = masked_sums(vals[key], seqs)
        assert sums.tolist() == [5.0, 5.0] and counts.tolist() == [2.0, 1.0]


@pytest.mark.parametrize("kw,flag", [(dict(beta=0.0), "--beta"), (dict(label_smoothing=0.7), "--label_smoothing"),
                                     (dict(ipo=True, label_smoothing=0.1), "--ipo"),
                                     (dict(nll_loss_coef=-1.0), "--nll_loss_coef")])
def test_bad_settings_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        DPOTask(pad_token_id=0, ref=None, **kw)  # type: ignore[arg-type]
