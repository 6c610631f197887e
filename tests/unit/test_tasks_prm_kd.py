"""PRMTask and KDTask: losses against direct computations, padded == packed, shift alignment, additivity."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlhfkit.parallel.dist import DistInfo
from rlhfkit.backend.fsdp2 import FSDP2Backend
from rlhfkit.config.configs import BackendConfig
from rlhfkit.data.items import PRMItem, SFTItem
from rlhfkit.models.loader import load_tokenizer
from rlhfkit.trainers.dpo_task import FrozenModel
from rlhfkit.trainers.kd_task import KDTask
from rlhfkit.trainers.prm_task import PRMTask


def _load(path: str, noise: float = 0.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    return load_tokenizer(tiny_model_dir), _load(tiny_model_dir), _load(tiny_model_dir, noise=0.05)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- PRM


def _prm_items(tok) -> tuple[list[PRMItem], int, list[int]]:
    ph, plus, minus = _ids(tok, "#")[0], _ids(tok, "+")[0], _ids(tok, "-")[0]
    items = []
    for text, labels in [("1+1=2#2+2=5#", [plus, minus]), ("3+4=7#", [plus]), ("ab#cd#ef#", [minus, plus, plus])]:
        ids = _ids(tok, text)
        lab, k = [-100] * len(ids), 0
        for t, tid in enumerate(ids):
            if tid == ph:
                lab[t], k = labels[k], k + 1
        items.append(PRMItem(ids, lab))
    return items, ph, [plus, minus]


def _prm_reference(model, items, ph, reward_ids) -> tuple[float, float, int]:
    """Sum of CE over placeholder positions (logits restricted to the reward tokens), correct count, positions."""
    total, correct, n = 0.0, 0.0, 0
    for it in items:
        with torch.no_grad():
            logits = model(torch.tensor([it.input_ids])).logits[0]
        for t, tid in enumerate(it.input_ids):
            if tid == ph:
                z = logits[t, reward_ids]
                target = reward_ids.index(int(it.labels[t]))
                total += float(F.cross_entropy(z[None], torch.tensor([target])))
                correct += float(int(z.argmax()) == target)
                n += 1
    return total, correct, n


@pytest.mark.parametrize("packing", [False, True])
def test_prm_loss_matches_reference(setup, packing):
    tok, model, _ = setup
    items, ph, reward_ids = _prm_items(tok)
    total, correct, n = _prm_reference(model, items, ph, reward_ids)
    task = PRMTask(pad_token_id=tok.pad_token_id, placeholder_token_id=ph, reward_token_ids=reward_ids,
                   packing=packing)
    batch = task.collate(items)
    assert task.count(batch) == n == 6
    loss, m = task.loss(model, batch, global_count=12.0)
    assert math.isclose(loss.item(), total / 12, rel_tol=1e-5)
    assert math.isclose(m["acc"], correct / 12, abs_tol=1e-7)
    ev = task.eval_metrics(model, [task.collate(items[:1]), task.collate(items[1:])])
    assert math.isclose(ev["eval/loss"], total / n, rel_tol=1e-5) and math.isclose(ev["eval/acc"], correct / n)


# ----------------------------------------------------------------------------- KD


def _frozen(model) -> FrozenModel:
    return FrozenModel(FSDP2Backend(model, BackendConfig(param_dtype="fp32", device="cpu"), None, 1, DistInfo()))


def _sft_items(tok) -> list[SFTItem]:
    out = []
    for p, r in [("1+2=", "3"), ("hello ", "world"), ("a", "bcd")]:
        pi, ri = _ids(tok, p), _ids(tok, r) + [tok.eos_token_id]
        out.append(SFTItem(pi + ri, [0] * len(pi) + [1] * len(ri)))
    return out


def _kd_reference(student, teacher, items, kd_coef) -> tuple[float, float, float, int]:
    """Token sums of KL(teacher || student) and NLL on response tokens, one sequence at a time."""
    kd = nll = 0.0
    n = 0
    for it in items:
        ids = torch.tensor([it.input_ids])
        with torch.no_grad():
            s = F.log_softmax(student(ids).logits[0, :-1], -1)
            t = F.log_softmax(teacher(ids).logits[0, :-1], -1)
        for pos in range(1, len(it.input_ids)):
            if it.loss_mask[pos]:
                kd += float((t[pos - 1].exp() * (t[pos - 1] - s[pos - 1])).sum())
                nll += -float(s[pos - 1, it.input_ids[pos]])
                n += 1
    return (1 - kd_coef) * nll + kd_coef * kd, kd, nll, n


@pytest.mark.parametrize("packing", [False, True])
def test_kd_loss_matches_reference(setup, packing):
    tok, student, teacher = setup
    items = _sft_items(tok)
    total, kd, nll, n = _kd_reference(student, teacher, items, 0.4)
    task = KDTask(pad_token_id=tok.pad_token_id, teacher=_frozen(teacher), kd_coef=0.4, packing=packing)
    batch = task.collate(items)
    assert task.count(batch) == n
    loss, m = task.loss(student, batch, global_count=2.0 * n)
    assert math.isclose(loss.item(), total / (2 * n), rel_tol=1e-5)
    assert math.isclose(m["kd_loss"], kd / (2 * n), rel_tol=1e-4) and math.isclose(m["nll_loss"], nll / (2 * n),
                                                                                    rel_tol=1e-5)
    assert kd > 1e-3  # teacher and student really differ
    ev = task.eval_metrics(student, [task.collate(items[:2]), task.collate(items[2:])])
    assert math.isclose(ev["eval/loss"], total / n, rel_tol=1e-5)


def test_kd_with_the_student_as_teacher_is_scaled_sft(setup, tiny_model_dir):
    from rlhfkit.trainers.sft_task import SFTTask

    tok, student, _ = setup  # student: the unperturbed tiny model, like the teacher loaded here
    items = _sft_items(tok)
    task = KDTask(pad_token_id=tok.pad_token_id, teacher=_frozen(_load(tiny_model_dir)), kd_coef=0.25)
    loss, m = task.loss(student, task.collate(items), global_count=20.0)
    sft = SFTTask(pad_token_id=tok.pad_token_id)
    sft_loss, _ = sft.loss(student, sft.collate(items), global_count=20.0)
    assert abs(m["kd_loss"]) < 1e-6
    assert math.isclose(loss.item(), 0.75 * sft_loss.item(), rel_tol=1e-5)


def test_kd_coef_is_checked():
    with pytest.raises(ValueError, match="--kd_coef"):
        KDTask(pad_token_id=0, teacher=None, kd_coef=1.5)  # type: ignore[arg-type]
