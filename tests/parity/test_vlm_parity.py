"""Vision-language rollouts against transformers (fp32, CPU), for Qwen2.5-VL and Qwen3-VL.

- rlhfkit's 3-D positions and M-RoPE tables equal transformers' `get_rope_index` and rotary module;
- the builtin engine's log-probs for picture + text prompts equal the training forward's (HF model with
  the pictures and the 3-D positions) within 1e-5, sampled (n = 3) and greedy;
- the n samples of a prompt run the vision tower once (a forward hook counts its calls), and a second
  batch of the same pictures does not run it again;
- greedy tokens of the builtin engine equal HF `generate`'s (the hf engine), for a batch that mixes
  picture rows and a text row;
- the vision markers are never sampled, while the reported log-probs stay those of the unmasked model;
- a weight update that carries vision-tower weights empties the picture cache (the new tower runs), one
  without (a frozen tower) keeps it.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from vlm_helpers import PH, load_vlm, max_gap, picture, prompt

from rlhfkit.models.vlm import batch_forward_kwargs, batch_position_ids, mrope_cos_sin
from rlhfkit.rollout import build_engine
from rlhfkit.types import GenerationRequest, SamplingParams

ARCHS = ["qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(params=ARCHS)
def vlm(request, tiny_vlm_dir, tiny_qwen3_vl_dir):
    path = tiny_vlm_dir if request.param == "qwen2_5_vl" else tiny_qwen3_vl_dir
    return (path, *load_vlm(path))


def two_pictures(proc):
    return proc.process([picture((200, 30, 30), (56, 28)), picture((30, 40, 220), (100, 64))])


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_positions_and_rope_tables_match_transformers(vlm):
    path, model, tok, layout, proc = vlm
    pics = two_pictures(proc)
    one = proc.process([picture((30, 200, 30), (28, 60))])
    rows = [prompt(tok, layout, chat(f"ab{PH}cd{PH}e"), pics), prompt(tok, layout, chat(f"{PH}x"), one),
            prompt(tok, layout, chat("text only"), None)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    ours = batch_position_ids(ids, mask, [pics, one, None], layout)
    kw = {"image_grid_thw": torch.cat([pics.grid_thw, one.grid_thw]), "attention_mask": mask}
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        kw["mm_token_type_ids"] = (ids == layout.image_token_id).int()
    theirs, _ = model.model.get_rope_index(ids, **kw)
    assert torch.equal(ours * mask, theirs * mask)
    assert int(ours[:, 0].max()) < len(rows[0]) - 1  # the pictures compress positions: a real test of 3-D
    rotary = model.model.language_model.rotary_emb
    cos_hf, sin_hf = rotary(torch.zeros(1), ours)
    cos, sin = mrope_cos_sin(ours, rotary.inv_freq, layout)
    assert torch.allclose(cos, cos_hf, atol=1e-6) and torch.allclose(sin, sin_hf, atol=1e-6)


def _engine(path, tok, **kw):
    return build_engine("builtin", path, tok, device="cpu", dtype=torch.float32, max_model_len=128, max_num_seqs=8,
                        **kw)


class TowerCalls:
    def __init__(self, engine):
        self.n = 0
        engine._local.vision.module.register_forward_hook(lambda *a: setattr(self, "n", self.n + 1))


def test_engine_logprobs_equal_training_forward_and_tower_runs_once(vlm):
    path, model, tok, layout, proc = vlm
    pics = two_pictures(proc)
    ids = prompt(tok, layout, chat(f"ab{PH}cd{PH}e"), pics)
    engine = _engine(path, tok)
    calls = TowerCalls(engine)
    sampled = GenerationRequest(ids, SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=1), images=pics)
    greedy = GenerationRequest(ids, SamplingParams(temperature=0.0, max_new_tokens=12), request_id=1, images=pics)
    out = engine.generate([sampled, greedy])
    comps = out[0] + out[1]
    assert sum(len(c.token_ids) for c in comps) > 20
    assert len({tuple(c.token_ids) for c in out[0]}) > 1  # the seeded samples differ
    assert max_gap(model, layout, ids, pics, comps) < 1e-5
    assert calls.n == 1 and engine.stats.vision_calls == 1 and engine.stats.pictures_encoded == 2
    again = engine.generate([GenerationRequest(ids, SamplingParams(temperature=0.0, max_new_tokens=4), images=pics)])
    assert calls.n == 1 and again[0][0].token_ids == out[1][0].token_ids[:4]  # cached features, same result


def test_builtin_greedy_equals_hf_generate(vlm):
    path, model, tok, layout, proc = vlm
    pics = two_pictures(proc)
    one = proc.process([picture((30, 200, 30), (28, 28), box=False)])
    reqs = [GenerationRequest(prompt(tok, layout, chat(f"ab{PH}cd{PH}e"), pics), SamplingParams(temperature=0,
                              max_new_tokens=16), 0, pics),
            GenerationRequest(prompt(tok, layout, chat(f"{PH}hi"), one), SamplingParams(temperature=0,
                              max_new_tokens=16), 1, one),
            GenerationRequest(prompt(tok, layout, chat("no picture"), None), SamplingParams(temperature=0,
                              max_new_tokens=16), 2)]
    hf = build_engine("hf", model, tok, device="cpu").generate(reqs)
    ours = _engine(path, tok).generate(reqs)
    for a, b in zip(hf, ours):
        assert a[0].token_ids == b[0].token_ids and len(a[0].token_ids) == 16
        assert max(abs(x - y) for x, y in zip(a[0].logprobs, b[0].logprobs)) < 1e-5


def test_vision_markers_are_never_sampled(tiny_vlm_dir):
    model, tok, layout, proc = load_vlm(tiny_vlm_dir)
    pics = proc.process([picture((200, 30, 30), (56, 56))])
    ids = prompt(tok, layout, chat(f"{PH}colour?"), pics)
    with torch.no_grad():  # make the image placeholder the likeliest first token
        x = torch.tensor([ids])
        logits = model(input_ids=x, **batch_forward_kwargs(x, torch.ones_like(x), [pics], layout)).logits[0, -1]
        top = int(logits.argmax())
        model.lm_head.weight[layout.image_token_id] = model.lm_head.weight[top] * 3
        logits = model(input_ids=x, **batch_forward_kwargs(x, torch.ones_like(x), [pics], layout)).logits[0, -1]
    assert int(logits.argmax()) == layout.image_token_id  # the unmasked greedy choice is the marker
    engine = build_engine("builtin", model, tok, device="cpu", dtype=torch.float32, max_model_len=128)
    [[c]] = engine.generate([GenerationRequest(ids, SamplingParams(temperature=0, max_new_tokens=6), images=pics)])
    assert not set(c.token_ids) & set(layout.special_ids)
    assert c.token_ids[0] == int(logits.topk(2).indices[1])  # the best token that is not a marker
    assert max_gap(model, layout, ids, pics, [c]) < 1e-5  # log-probs of the unmasked distribution


def test_weight_update_with_vision_weights_empties_the_picture_cache(tiny_vlm_dir):
    model, tok, layout, proc = load_vlm(tiny_vlm_dir)
    pics = proc.process([picture((200, 30, 30), (56, 56))])
    ids = prompt(tok, layout, chat(f"{PH}colour?"), pics)
    engine = _engine(tiny_vlm_dir, tok)
    calls = TowerCalls(engine)
    req = GenerationRequest(ids, SamplingParams(temperature=0, max_new_tokens=8), images=pics)
    engine.generate([req])
    text_only = [(n, p) for n, p in model.named_parameters() if "visual" not in n]
    engine.update_weights(text_only)  # what a frozen tower's sync sends
    engine.generate([req])
    assert calls.n == 1
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    engine.update_weights(list(model.named_parameters()))
    [[c]] = engine.generate([req])
    assert calls.n == 2  # the new tower encoded the picture again
    assert max_gap(model, layout, ids, pics, [c]) < 1e-5  # and the engine follows the perturbed model


def test_a_blank_picture_row_runs_the_tower_without_changing_text_rows(tiny_vlm_dir):
    """Under data parallelism each forward pass runs the vision tower (`tower_every_pass`): a micro-batch of
    text rows gets a blank-picture row, which leaves the rows' log-probs as they are."""
    from types import SimpleNamespace

    from rlhfkit.models.forward import token_logprobs
    from rlhfkit.roles.actor import row_logprobs
    from rlhfkit.types import ExperienceBatch

    model, tok, layout, _ = load_vlm(tiny_vlm_dir)
    rows = [prompt(tok, layout, chat("a text row"), None), prompt(tok, layout, chat("another, longer text row"), None)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    mb = ExperienceBatch(input_ids=ids, attention_mask=mask, loss_mask=mask.clone(), images=[None, None])
    backend = SimpleNamespace(token_logprobs=lambda x, **kw: token_logprobs(model, x, **kw))
    calls = []
    model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        plain = row_logprobs(backend, mb, 1.0, False, False, layout, tower_every_pass=False)
        lp, ent = row_logprobs(backend, mb, 1.0, True, False, layout, tower_every_pass=True)
    assert len(calls) == 1 and lp.shape == plain.shape == ent.shape == ids.shape
    assert torch.allclose(lp, plain, atol=1e-6)
