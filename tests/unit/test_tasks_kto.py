"""KTOTask against a short reference implementation: mismatched pairs, reference point z, loss and metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.parallel.dist import DistInfo
from rlhfkit.backend.fsdp2 import FSDP2Backend
from rlhfkit.config.configs import BackendConfig
from rlhfkit.data.items import UnpairedItem
from rlhfkit.models.loader import load_tokenizer
from rlhfkit.trainers.dpo_task import FrozenModel
from rlhfkit.trainers.kto_task import KTOTask

ROWS = [("1+2=", "3", True), ("12+3=", "51", False), ("hello ", "world", True), ("ab", "dd", False)]


def _items(tok) -> list[UnpairedItem]:
    out = []
    for p, a, label in ROWS:
        pi = tok(p, add_special_tokens=False)["input_ids"]
        ai = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        mask = [0] * len(pi) + [1] * len(ai)
        mask[0] = 0
        out.append(UnpairedItem(pi + ai, mask, label, prompt_len=len(pi)))
    return out


def _load(path: str, noise: float = 0.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    return model


def _frozen(model) -> FrozenModel:
    return FrozenModel(FSDP2Backend(model, BackendConfig(param_dtype="fp32", device="cpu"), None, 1, DistInfo()))


def _seq_logp(model, ids: list[int], mask: list[int]) -> tuple[float, int]:
    """Reference: sum over answer tokens t of log p(ids[t] | ids[:t]), one unpadded sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = F.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    m = torch.tensor(mask[1:], dtype=torch.float32)
    return float((lp * m).sum()), int(m.sum())


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    return load_tokenizer(tiny_model_dir), _load(tiny_model_dir, noise=0.05), _load(tiny_model_dir)


def _h(policy, ref, ids, mask) -> float:
    return _seq_logp(policy, ids, mask)[0] - _seq_logp(ref, ids, mask)[0]


def _reference(policy, ref, items, beta, wd, wu):
    """Per-answer KTO losses with z from (prompt_i, answer_{i+1}) pairs, computed one sequence at a time."""
    n = len(items)
    diffs = []
    for i, it in enumerate(items):
        other = items[(i + 1) % n]
        ids = it.input_ids[:it.prompt_len] + other.input_ids[other.prompt_len:]
        mask = [0] * it.prompt_len + [1] * (len(other.input_ids) - other.prompt_len)
        diffs.append(_h(policy, ref, ids, mask))
    z = max(sum(diffs) / n, 0.0)
    h = [_h(policy, ref, it.input_ids, it.loss_mask) for it in items]
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    per = [wd * (1 - sig(beta * (hi - z))) if it.label else wu * (1 - sig(beta * (z - hi)))
           for hi, it in zip(h, items)]
    return per, z, h


@pytest.mark.parametrize("packing,swap", [(False, False), (True, True)])
def test_loss_matches_reference(setup, packing, swap):
    tok, policy, ref = setup
    if swap:  # the other way round the mismatched log-ratios are positive: z > 0 (else clamped to 0)
        policy, ref = ref, policy
    items = _items(tok)
    beta, wd, wu = 0.5, 1.0, 1.5
    per, z, h = _reference(policy, ref, items, beta, wd, wu)
    assert (z > 0.01) == swap
    task = KTOTask(pad_token_id=tok.pad_token_id, ref=_frozen(ref), max_len=64, beta=beta,
                   desirable_weight=wd, undesirable_weight=wu, packing=packing)
    loss, m = task.loss(policy, task.collate(items), global_count=8.0)
    assert math.isclose(loss.item(), sum(per) / 8, rel_tol=1e-4)
    assert math.isclose(m["kl"], z * 4 / 8, rel_tol=1e-4, abs_tol=1e-7)
    signed = sum((beta * hi if it.label else -beta * hi) for hi, it in zip(h, items))
    assert math.isclose(m["signed_reward"], signed / 8, rel_tol=1e-4)
    ev = task.eval_metrics(policy, [task.collate(items)])
    assert math.isclose(ev["eval/loss"], sum(per) / 4, rel_tol=1e-4)
    good = [beta * hi for hi, it in zip(h, items) if it.label]
    bad = [beta * hi for hi, it in zip(h, items) if not it.label]
    assert math.isclose(ev["eval/chosen_reward"], sum(good) / len(good), rel_tol=1e-4)
    assert math.isclose(ev["eval/rejected_reward"], sum(bad) / len(bad), rel_tol=1e-4)


def test_collate_builds_mismatched_pairs(setup):
    tok, _, ref = setup
    items = _items(tok)
    b = KTOTask(pad_token_id=tok.pad_token_id, ref=_frozen(ref), max_len=64).collate(items)
    assert b.desirable.tolist() == [True, False, True, False]
    row0 = b.kl_seqs.input_ids[0][b.kl_seqs.attention_mask[0].bool()].tolist()
    assert row0 == items[0].input_ids[:items[0].prompt_len] + items[1].input_ids[items[1].prompt_len:]


def test_policy_equal_to_reference(setup):
    # h = 0 and z = 0: every answer's loss is w * (1 - sigmoid(0)) = w / 2
    tok, _, ref = setup
    task = KTOTask(pad_token_id=tok.pad_token_id, ref=_frozen(ref), max_len=64, beta=0.1,
                   desirable_weight=1.0, undesirable_weight=3.0)
    loss, m = task.loss(ref, task.collate(_items(tok)), global_count=4.0)
    assert math.isclose(loss.item(), (0.5 + 1.5 + 0.5 + 1.5) / 4, rel_tol=1e-5)
    assert abs(m["kl"]) < 1e-6 and abs(m["signed_reward"]) < 1e-6


def test_bad_settings_name_the_flag():
    with pytest.raises(ValueError, match="--beta"):
        KTOTask(pad_token_id=0, ref=None, max_len=8, beta=0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--desirable_loss_weight"):
        KTOTask(pad_token_id=0, ref=None, max_len=8, desirable_weight=-1.0)  # type: ignore[arg-type]


def test_offloaded_frozen_model_nests_uses(tiny_model_dir):
    """With offload the weights are stashed between uses (on CPU too: the round trip runs); a use inside a
    use keeps them in place until the outer one ends (an evaluation of the reference against itself)."""
    model = _load(tiny_model_dir)
    for p in model.parameters():  # own storages, as a streamed load gives (from_pretrained's map the file)
        p.data = p.data.clone()
    weights = [p.detach().clone() for p in model.parameters()]
    frozen = FrozenModel(FSDP2Backend(model, BackendConfig(param_dtype="fp32", device="cpu"), None, 1, DistInfo()),
                         offload=True)
    stored = lambda: [p.untyped_storage().size() for p in frozen.backend.model.parameters()]  # noqa: E731
    assert set(stored()) == {0}  # stashed
    with frozen.use() as outer:
        with frozen.use() as inner:
            assert inner is outer
        assert all(torch.equal(a, b) for a, b in zip(outer.parameters(), weights))  # still in place
    assert set(stored()) == {0}
