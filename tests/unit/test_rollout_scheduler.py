"""Continuous-batching policy, stop handling and weight-name mapping of the rollout engines."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.rollout.builtin.loop.scheduler import RequestState, SlotScheduler, batch_bucket, length_bucket
from rlhfkit.rollout.stops import finish_completion, first_stop_id, stop_string_cut
from rlhfkit.types import GenerationRequest, SamplingParams


def _req(plen: int, n: int = 1, max_new: int = 10) -> RequestState:
    r = GenerationRequest(list(range(1, plen + 1)), SamplingParams(n=n, max_new_tokens=max_new))
    return RequestState(r, on_done=lambda out: None, seed=0, stop_ids=[2], filtered=False)


def test_buckets():
    assert [batch_bucket(n, 256) for n in (1, 2, 3, 5, 7, 9, 13, 100, 250)] == [1, 2, 3, 6, 8, 12, 16, 128, 256]
    assert batch_bucket(200, 200) == 200
    assert [length_bucket(n, 4096) for n in (1, 128, 129, 200, 257, 700, 1025)] == [128, 128, 160, 224, 320, 768, 1280]
    assert length_bucket(5000, 384) == 384


def test_admission_fills_lowest_slots_and_respects_budget():
    s = SlotScheduler(num_slots=4, max_prefill_tokens=20)
    a, b, c = _req(8, n=2), _req(9), _req(3)
    for r in (a, b, c):
        s.add(r)
    first = s.plan_admissions()
    # a (2 samples, 8 tokens) then b: 2 prompts padded to 9 = 18 <= 20; c would make 27 > 20
    assert [(x.req, x.slots) for x in first] == [(a, [0, 1]), (b, [2])]
    assert list(s.waiting) == [c]
    second = s.plan_admissions()
    assert [(x.req, x.slots) for x in second] == [(c, [3])]
    assert s.decode_rows() == 4 and s.plan_admissions() == []
    s.release(1)
    s.add(_req(4))
    assert s.plan_admissions()[0].slots == [1]


def test_request_with_more_samples_than_free_slots_is_split():
    s = SlotScheduler(num_slots=3, max_prefill_tokens=100)
    r = _req(5, n=5)
    s.add(r)
    [adm] = s.plan_admissions()
    assert (adm.first_sample, adm.slots, r.admitted) == (0, [0, 1, 2], 3)
    assert list(s.waiting) == [r]
    s.release(0)
    s.release(2)
    [adm2] = s.plan_admissions()
    assert (adm2.first_sample, adm2.slots, r.admitted) == (3, [0, 2], 5)
    assert not s.waiting


def test_compaction_moves_high_slots_into_holes():
    s = SlotScheduler(num_slots=16, max_prefill_tokens=1000)
    for _ in range(12):
        s.add(_req(2))
    s.plan_admissions()
    for slot in range(0, 10):
        s.release(slot)
    assert sorted(s.running) == [10, 11] and s.decode_rows() == 12
    moves = s.plan_compaction()
    assert sorted(moves) == [(10, 1), (11, 0)]
    assert sorted(s.running) == [0, 1] and s.decode_rows() == 2
    assert {seq.slot for seq in s.running.values()} == {0, 1}
    s.add(_req(2))
    assert s.plan_admissions()[0].slots == [2]


def test_stop_id_and_stop_string_cuts():
    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # 1 -> 'a', 2 -> 'b', ...
    toks = [1, 2, 3, 4, 5, 3, 4]  # "abcdecd"
    assert stop_string_cut(toks, decode, ["cd"]) == (4, 7)
    assert stop_string_cut(toks, decode, ["cd"], min_tokens=5) == (7, 7)  # first "cd" ends before 5 tokens
    assert stop_string_cut(toks, decode, ["zz"]) == (None, 7)
    assert stop_string_cut(toks, decode, ["ab"], checked_chars=7) == (None, 7)  # old text is not searched again
    assert first_stop_id([5, 2, 7, 2], {2}, min_new_tokens=0) == 1
    assert first_stop_id([5, 2, 7, 2], {2}, min_new_tokens=3) == 3
    ids, lps, reason = finish_completion(toks, [0.1] * 7, {5}, 0, ["cd"], decode)
    assert (ids, reason, len(lps)) == ([1, 2, 3, 4], "stop", 4)
    ids, _, reason = finish_completion(toks, None, {9}, 0, [], None)
    assert (ids, reason) == (toks, "length")
    with pytest.raises(ValueError, match="tokenizer"):
        finish_completion(toks, None, set(), 0, ["x"], None)


def test_weight_names_map_into_fused_tensors():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhfkit.rollout.builtin.model.weights import load_from_hf_model, target_view

    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(cfg)
    spec, w = load_from_hf_model(model, torch.float32, torch.device("cpu"))
    sd = model.state_dict()
    qkv = w.layers[0].qkv
    assert qkv.shape == (16 + 8 + 8, 16)
    torch.testing.assert_close(qkv[:16], sd["model.layers.0.self_attn.q_proj.weight"])
    torch.testing.assert_close(qkv[24:], sd["model.layers.0.self_attn.v_proj.weight"])
    torch.testing.assert_close(w.layers[0].qkv_bias[16:24], sd["model.layers.0.self_attn.k_proj.bias"])
    torch.testing.assert_close(w.layers[0].gate_up[24:], sd["model.layers.0.mlp.up_proj.weight"])
    view = target_view(w, spec, "model.layers.0.mlp.gate_proj.weight")
    assert view.data_ptr() == w.layers[0].gate_up.data_ptr() and view.shape == (24, 16)
    assert target_view(w, spec, "model.rotary_emb.inv_freq") is None
    with pytest.raises(KeyError):
        target_view(w, spec, "model.layers.3.mlp.gate_proj.weight")
