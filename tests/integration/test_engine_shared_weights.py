"""The builtin engine serving the policy's own weights (--engine_weights shared: one copy, no copy per step).

    adopt         BuiltinEngine(module, share_weights=True) on the tiny model: every parameter lives inside one
                  of the engine's tensors (q, k, v and gate, up as row blocks of the fused ones), the module and
                  the engine together hold the engine's bytes and no more; greedy tokens equal those of an engine
                  with its own copy; after an in-place change of the module's weights (an optimizer step), the
                  engine's tokens equal a fresh engine built from the changed module, with no update call
    equivalence   GRPO on the tiny model, 3 steps, --engine_weights shared and copy: the same rewards, losses
                  and final weights (bit for bit: the same numbers flow), while the weights move; the shared run
                  says so in one line and its weight sync copies nothing
    refusals      --engine_weights shared with the HF engine or a LoRA policy is refused naming the reason and
                  --engine_weights copy; auto falls back to a copy with one line; sleep(2) of a sharing engine
                  is refused (it would move the policy's weights)
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers import read_run, rl_flags, write_rl_data

from rlhfkit.cli import train_ppo
from rlhfkit.cli.common import UsageError
from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.types import GenerationRequest, SamplingParams

PROMPTS = [[5, 9, 14, 3], [7, 7, 2], [11, 4, 6, 8, 10]]


def _greedy(engine: BuiltinEngine) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, min_new_tokens=12)
    return [out[0].token_ids for out in engine.generate([GenerationRequest(p, sp) for p in PROMPTS])]


def _engine(model, share: bool) -> BuiltinEngine:
    return BuiltinEngine(model, device="cpu", dtype=torch.float32, share_weights=share,
                         config=BuiltinEngineConfig(max_num_seqs=4, max_model_len=64))


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def test_adopted_parameters_live_in_the_engine(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    copy_tokens = _greedy(_engine(load(), share=False))
    model = load()
    engine = _engine(model, share=True)
    params = dict(model.named_parameters())
    assert engine.shared_names == set(params)  # every weight of the tiny Llama fits a view
    engine_bytes = _storages(engine.model.weights.tensors().values())
    assert set(_storages(params.values())) <= set(engine_bytes)  # no parameter storage of its own
    qkv = engine.model.weights.layers[0].qkv
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert q.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr() and torch.equal(q, qkv[:q.shape[0]])
    assert _greedy(engine) == copy_tokens

    with torch.no_grad():  # an optimizer step: in place, no update call
        for p in model.parameters():
            p.mul_(1.5).add_(0.01)
    changed = _greedy(engine)
    assert changed != copy_tokens
    fresh = load()
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    assert changed == _greedy(_engine(fresh, share=False))
    with pytest.raises(ValueError, match="sleep level 2"):
        engine.sleep(2)


@pytest.mark.slow
def test_shared_run_equals_copied_run(tiny_model_dir, tmp_path, caplog):
    d = write_rl_data(str(tmp_path))
    runs = {}
    for mode in ("shared", "copy"):
        save = os.path.join(d, mode)
        with caplog.at_level(logging.INFO):
            caplog.clear()
            train_ppo.main(rl_flags(tiny_model_dir, d, save, "--engine_weights", mode, steps=3))
        runs[mode] = read_run(save), caplog.text
    ((rs, ws), log_s), ((rc, wc), log_c) = runs["shared"], runs["copy"]
    assert "serves the policy's own weights" in log_s and "its own copy" in log_c
    assert [r["step"] for r in rs] == [1, 2, 3]
    for a, b in zip(rs, rc):
        for k in ("train/reward", "train/policy_loss", "train/kl_loss", "train/grad_norm"):
            assert a[k] == b[k], (k, a[k], b[k])
    assert set(ws) == set(wc)
    for k in ws:
        assert torch.equal(ws[k], wc[k]), k
    from safetensors.torch import load_file

    w0 = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert max((ws[k] - w0[k]).abs().max().item() for k in ws if k in w0) > 1e-3  # the weights moved


def test_refusals_and_fallback(tiny_model_dir, tmp_path, caplog):
    d = write_rl_data(str(tmp_path))
    with pytest.raises(UsageError, match=r"--engine_weights shared: --rollout_engine hf .*--engine_weights copy"):
        train_ppo.run.__wrapped__(*_parsed(rl_flags(tiny_model_dir, d, str(tmp_path / "a"), "--engine_weights",
                                                    "shared", "--rollout_engine", "hf", steps=1)))
    with pytest.raises(UsageError, match="LoRA"):
        train_ppo.run.__wrapped__(*_parsed(rl_flags(tiny_model_dir, d, str(tmp_path / "b"), "--engine_weights",
                                                    "shared", "--lora_rank", "4", steps=1)))
    with caplog.at_level(logging.INFO):
        train_ppo.main(rl_flags(tiny_model_dir, d, str(tmp_path / "c"), "--lora_rank", "4", steps=1))
    assert "its own copy of the policy's weights (a LoRA policy" in caplog.text


def _parsed(argv: list[str]):
    parser = train_ppo.build_parser()
    return parser.parse(argv), parser
