"""RMTask: pair layout, last-token scores (padded == packed == alone), loss by hand, additivity, statistics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.parallel.dist import DistInfo
from rlhfkit.data.items import PreferenceItem
from rlhfkit.models.loader import load_tokenizer
from rlhfkit.models.value import load_value_model
from rlhfkit.trainers.rm_task import RMTask, collate_pairs, reward_statistics

TEXTS = [("1+2=", "3", "4"), ("12+3=", "15", "51"), ("hello ", "world", "there, friend"), ("a", "bc", "b")]


def _items(tok, margins=(0.5, 0.0, -1.0, 2.0)) -> list[PreferenceItem]:
    out = []
    for (p, c, r), m in zip(TEXTS, margins):
        pi = tok(p, add_special_tokens=False)["input_ids"]
        ci = tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ri = tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(PreferenceItem(pi + ci, [0] * len(pi) + [1] * len(ci), pi + ri, [0] * len(pi) + [1] * len(ri), m))
    return out


@pytest.fixture(scope="module")
def rm(tiny_model_dir):
    torch.manual_seed(0)
    model = load_value_model(tiny_model_dir, init_value_head=True).eval()
    with torch.no_grad():
        model.get_value_head().weight.mul_(50.0)  # spread the scores so the loss is not ~log 2 everywhere
    return model


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _alone(model, ids: list[int]) -> float:
    """The score of one unpadded sequence: the value at its last token."""
    with torch.no_grad():
        return float(model(torch.tensor([ids]))[0, -1])


def test_collate_puts_chosen_first(tok):
    items = _items(tok)
    b = collate_pairs(items, tok.pad_token_id, packing=False)
    assert b.num_pairs == 4 and b.seqs.input_ids.shape[0] == 8
    assert b.margin.tolist() == [0.5, 0.0, -1.0, 2.0]
    for i, it in enumerate(items):
        assert b.seqs.input_ids[i, :len(it.chosen_ids)].tolist() == it.chosen_ids
        assert b.seqs.input_ids[4 + i, :len(it.rejected_ids)].tolist() == it.rejected_ids
    packed = collate_pairs(items, tok.pad_token_id, packing=True)
    assert packed.seqs.seq_lens == [len(it.chosen_ids) for it in items] + [len(it.rejected_ids) for it in items]


@pytest.mark.parametrize("packing", [False, True])
def test_scores_equal_each_sequence_alone(rm, tok, packing):
    items = _items(tok)
    task = RMTask(pad_token_id=tok.pad_token_id, packing=packing)
    with torch.no_grad():
        rc, rr = task.rewards(rm, task.collate(items))
    want_c = torch.tensor([_alone(rm, it.chosen_ids) for it in items])
    want_r = torch.tensor([_alone(rm, it.rejected_ids) for it in items])
    torch.testing.assert_close(rc, want_c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rr, want_r, atol=1e-5, rtol=1e-5)
    assert (rc - rr).abs().max() > 1e-3  # the scores really differ


def test_loss_and_metrics_by_hand(rm, tok):
    items = _items(tok)
    rc = torch.tensor([_alone(rm, it.chosen_ids) for it in items])
    rr = torch.tensor([_alone(rm, it.rejected_ids) for it in items])
    m = torch.tensor([it.margin for it in items])
    for margin_loss, loss_type, want in [
        (False, "sigmoid", -F.logsigmoid(rc - rr).sum()),
        (True, "sigmoid", -F.logsigmoid(rc - rr - m).sum()),
        (False, "logexp", torch.log1p(torch.exp(rr - rc)).sum()),
    ]:
        task = RMTask(pad_token_id=tok.pad_token_id, loss_type=loss_type, margin_loss=margin_loss)
        loss, metrics = task.loss(rm, task.collate(items), global_count=8.0)  # 4 of 8 pairs of a step
        assert math.isclose(loss.item(), want.item() / 8, rel_tol=1e-5)
        assert math.isclose(metrics["acc"], float((rc > rr).sum()) / 8)
        assert math.isclose(metrics["margin"], float((rc - rr).sum()) / 8, rel_tol=1e-5, abs_tol=1e-6)


def test_micro_batches_add_up_to_the_whole(rm, tok):
    items = _items(tok)
    task = RMTask(pad_token_id=tok.pad_token_id, margin_loss=True)
    whole_loss, whole = task.loss(rm, task.collate(items), 4.0)
    parts = [task.loss(rm, task.collate(items[i:i + 2]), 4.0) for i in (0, 2)]
    assert math.isclose(sum(p[0].item() for p in parts), whole_loss.item(), rel_tol=1e-5)
    for k in whole:
        assert math.isclose(sum(p[1][k] for p in parts), whole[k], rel_tol=1e-5, abs_tol=1e-6), k
    ev = task.eval_metrics(rm, [task.collate(items[:3]), task.collate(items[3:])])
    assert math.isclose(ev["eval/loss"], whole["loss"], rel_tol=1e-5)
    assert math.isclose(ev["eval/acc"], whole["acc"]) and math.isclose(ev["eval/margin"], whole["margin"], rel_tol=1e-5)


def test_reward_statistics_are_mean_and_unbiased_std(rm, tok):
    items = _items(tok)
    task = RMTask(pad_token_id=tok.pad_token_id)
    scores = torch.tensor([_alone(rm, it.chosen_ids) for it in items] + [_alone(rm, it.rejected_ids) for it in items],
                          dtype=torch.float64)
    mean, std, n = reward_statistics(rm, task, items, micro_batch_size=3, dist=DistInfo())
    assert n == 8
    assert math.isclose(mean, scores.mean().item(), rel_tol=1e-5)
    assert math.isclose(std, scores.std(unbiased=True).item(), rel_tol=1e-4)


def test_bad_settings_name_the_flag():
    with pytest.raises(ValueError, match="--margin_loss"):
        RMTask(pad_token_id=0, loss_type="logexp", margin_loss=True)
    with pytest.raises(ValueError, match="--loss"):
        RMTask(pad_token_id=0, loss_type="hinge")


def test_reward_statistics_set_for_normalize_reward():
    from rlhfkit.cli.train_rm import statistics_items

    train = list(range(20000))
    assert statistics_items(train, [7, 8]) == [7, 8]  # the eval set when given
    assert statistics_items(train, None) == train[:200]  # else the first 1% of train ...
    assert statistics_items(train[:5000], None) == train[:100]  # ... but at least 100 pairs
    assert statistics_items(train[:40], None) == train[:40]  # ... or all of them
