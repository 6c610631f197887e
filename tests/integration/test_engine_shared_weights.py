"""The builtin engine serving the policy's own weights (--engine_weights shared: one copy, no copy per step).

    adopt         BuiltinEngine(module, share_weights=True) on the tiny model: every parameter lives inside one
                  of the engine's tensors (q, k, v and gate, up as row blocks of the fused ones), the module and
                  the engine together hold the engine's bytes and no more; greedy tokens equal those of an engine
                  with its own copy; after an in-place change of the module's weights (an optimizer step), the
                  engine's tokens equal a fresh engine built from the changed module, with no update call
    equivalence   GRPO on the tiny model, 3 steps, --engine_weights shared and copy: the same rewards, losses
                  and final weights (bit for bit: the same numbers flow), while the weights move; the shared run
                  says so in one line and its weight sync copies nothing
    LoRA          a peft model's base weights are shared and its adapters applied unmerged: greedy tokens and
                  log-probs equal an engine loaded from the merged model (1e-5), before and after an in-place
                  change of the adapters; GRPO with --lora_rank, shared and copy (merged per step): same rewards
                  and adapters
    refusals      --engine_weights shared with the HF engine is refused naming the reason and --engine_weights
                  copy (auto gives it a copy, with one line for the builtin engine); sleep(2) of a sharing
                  engine is refused (it would move the policy's weights)
    sleep         --vllm_enable_sleep in train_ppo: the engine frees its KV cache after each rollout and has it
                  back before the next; the run equals the run without it
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from helpers import read_run, rl_flags, write_rl_data

from rlhfkit.cli import train_ppo
from rlhfkit.cli.common import UsageError
from rlhfkit.distributed.memory_plan import ModelShape
from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.rollout.builtin.model import decoder
from rlhfkit.types import GenerationRequest, SamplingParams

PROMPTS = [[5, 9, 14, 3], [7, 7, 2], [11, 4, 6, 8, 10]]


def _greedy(engine: BuiltinEngine) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, min_new_tokens=12)
    return [out[0].token_ids for out in engine.generate([GenerationRequest(p, sp) for p in PROMPTS])]


def _engine(model, share: bool) -> BuiltinEngine:
    return BuiltinEngine(model, device="cpu", dtype=torch.float32, share_weights=share,
                         config=BuiltinEngineConfig(max_num_seqs=4, max_model_len=64))


class _AtenOps(TorchDispatchMode):
    """The aten ops run inside (views left out)."""

    def __enter__(self):
        self.names: list[str] = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


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
    runs = _shared_and_copied(tiny_model_dir, str(tmp_path), caplog, read_run)
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


def test_lora_adapters_are_served_unmerged(tiny_model_dir):
    """A peft LoRA model (adapters on every linear layer, B not zero): the sharing engine's greedy tokens and
    log-probs equal those of an engine loaded from the merged model (1e-5), and follow an in-place change of
    the adapters once the weight sync's update call (with no tensors) comes; the base weights are shared,
    the adapters are packed copies of the trainer's tensors (two GEMMs a layer input)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)

    def merged() -> BuiltinEngine:
        clone = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        m = get_peft_model(clone, cfg)
        m.load_state_dict(model.state_dict())
        return _engine(m.merge_and_unload(), share=False)

    sp = SamplingParams(temperature=0.0, max_new_tokens=12, min_new_tokens=12, logprobs=True)

    def run(engine: BuiltinEngine):
        outs = engine.generate([GenerationRequest(p, sp) for p in PROMPTS])
        return [o[0].token_ids for o in outs], torch.tensor([o[0].logprobs for o in outs])

    want_tokens, want_lp = run(merged())
    engine = _engine(model, share=True)
    layer = engine.model.weights.layers[0]
    assert sorted(layer.lora) == ["down", "gate_up", "o", "qkv"] and len(layer.lora["qkv"].parts) == 3
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.base_layer.weight.untyped_storage().data_ptr() == layer.qkv.untyped_storage().data_ptr()
    assert layer.lora["qkv"].parts[0].b.data_ptr() == q.lora_B["default"].weight.data_ptr()
    qkv = layer.lora["qkv"]  # q's, k's and v's A stacked; each B x scale on its rows and rank's columns
    assert qkv.a.shape == (12, layer.qkv.shape[1]) and qkv.b.shape == (layer.qkv.shape[0], 12)
    assert qkv.b[:q.out_features, 4:].abs().max() == 0
    torch.testing.assert_close(qkv.b[:q.out_features, :4], q.lora_B["default"].weight * 2.0)
    packed = sum(p.a.numel() + p.b.numel() for lw in engine.model.weights.layers for p in lw.lora.values())
    assert ModelShape.from_config(base.config).lora_pack_params(4) == packed  # what the memory plan counts
    x, y = torch.randn(3, layer.qkv.shape[1]), torch.zeros(3, layer.qkv.shape[0])
    with _AtenOps() as ops, torch.no_grad():  # the three adapters on qkv: one GEMM for A, one addmm for B
        decoder._lora(layer, "qkv", x, y)
    assert sorted(ops.names) == ["aten.addmm_.default", "aten.mm.default"], ops.names
    tokens, lp = run(engine)
    assert tokens == want_tokens
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    with torch.no_grad():  # an optimizer step on the adapters
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(1.7)
    assert run(engine)[0] == tokens  # served from the packs until the weight sync
    engine.update_weights([])
    tokens, lp = run(engine)
    want_tokens, want_lp = run(merged())
    assert tokens == want_tokens
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_lora_shared_run_matches_the_merged_copy(tiny_model_dir, tmp_path, caplog):
    """GRPO with --lora_rank 4, 3 steps: the engine applying the adapters unmerged samples what the engine
    given merged weights samples (rewards equal), and the runs end with the same adapters (1e-5)."""
    runs = _shared_and_copied(tiny_model_dir, str(tmp_path), caplog, _metrics_and_adapters,
                              "--lora_rank", "4", "--lora_alpha", "8")
    ((rs, ws), log_s), ((rc, wc), _) = runs["shared"], runs["copy"]
    assert "LoRA adapters, unmerged" in log_s and len(rs) == 3
    for a, b in zip(rs, rc):
        assert a["train/reward"] == pytest.approx(b["train/reward"], abs=1e-6)
        assert a["train/policy_loss"] == pytest.approx(b["train/policy_loss"], rel=1e-4, abs=1e-6)
    for k in ws:
        torch.testing.assert_close(ws[k], wc[k], atol=1e-5, rtol=0)


def test_shared_is_refused_where_it_cannot_hold(tiny_model_dir, tmp_path):
    d = write_rl_data(str(tmp_path))
    with pytest.raises(UsageError, match=r"--engine_weights shared: --rollout_engine hf .*--engine_weights copy"):
        train_ppo.run.__wrapped__(*_parsed(rl_flags(tiny_model_dir, d, str(tmp_path / "a"), "--engine_weights",
                                                    "shared", "--rollout_engine", "hf", steps=1)))


def _shared_and_copied(model: str, tmp: str, caplog, read, *extra: str) -> dict:
    """The same 3-step GRPO run with --engine_weights shared and copy: {mode: (read(save path), log text)}."""
    d = write_rl_data(tmp)
    runs = {}
    for mode in ("shared", "copy"):
        save = os.path.join(d, mode)
        with caplog.at_level(logging.INFO):
            caplog.clear()
            train_ppo.main(rl_flags(model, d, save, "--engine_weights", mode, *extra, steps=3))
        runs[mode] = read(save), caplog.text
    return runs


def _metrics_and_adapters(save: str):
    import json

    from safetensors.torch import load_file

    with open(os.path.join(save, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return recs, load_file(os.path.join(save, "adapter_model.safetensors"))


def _parsed(argv: list[str]):
    parser = train_ppo.build_parser()
    return parser.parse(argv), parser


@pytest.mark.slow
def test_engine_sleeps_between_rollouts(tiny_model_dir, tmp_path):
    """train_ppo --vllm_enable_sleep: the engine frees its KV cache after each rollout and has it back before
    the next; the run is the run without it (same rewards, losses, weights), and logs the sleep's time."""
    d = write_rl_data(str(tmp_path))
    runs = {}
    for name, extra in (("awake", ()), ("sleep", ("--vllm_enable_sleep",))):
        save = os.path.join(d, name)
        train_ppo.main(rl_flags(tiny_model_dir, d, save, *extra, steps=2))
        runs[name] = read_run(save)
    (ra, wa), (rs, ws) = runs["awake"], runs["sleep"]
    for a, b in zip(ra, rs):
        for k in ("train/reward", "train/policy_loss", "train/grad_norm"):
            assert a[k] == b[k], k
    assert all("time/engine_sleep" in r for r in rs) and not any("time/engine_sleep" in r for r in ra)
    for k in wa:
        assert torch.equal(wa[k], ws[k]), k
