"""FSDP2Backend in one process: clipping, non-finite skip, accumulation = big batch, HF export."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel import init_distributed
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.backend.precision import DynamicLossScaler
from rlhfkit.config.configs import BackendConfig, OptimConfig

CPU = DistInfo(device="cpu")


def load(model_dir: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def backend(model: nn.Module, steps: int = 10, **optim) -> FSDP2Backend:
    kw = dict(learning_rate=1e-3, lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=1.0)
    kw.update(optim)
    return FSDP2Backend(model, BackendConfig(param_dtype="fp32"), OptimConfig(**kw), steps, CPU)


def capture_grads(b: FSDP2Backend) -> list[dict[str, torch.Tensor]]:
    """Gradients as the optimizer sees them (after clipping), one dict per step."""
    names = {id(p): n for n, p in b.model.named_parameters()}
    seen: list[dict[str, torch.Tensor]] = []

    def hook(opt, args, kwargs):
        seen.append({names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"]
                     if p.grad is not None})

    b.optimizer.register_step_pre_hook(hook)
    return seen


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2, bias=False)
        self.b = nn.Linear(2, 1, bias=False)


def set_grads(m: nn.Module, values: dict[str, float]) -> None:
    for n, p in m.named_parameters():
        p.grad = torch.full_like(p, values[n])


def test_clip_at_max_norm_by_hand():
    m = Tiny()
    b = backend(m, max_norm=1.0)
    seen = capture_grads(b)
    set_grads(b.model, {"a.weight": 1.0, "b.weight": 2.0})
    norm = math.sqrt(6 * 1.0 + 2 * 4.0)  # 6 entries of 1, 2 entries of 2 -> sqrt(14)
    stats = b.optimizer_step()
    assert stats["grad_norm"] == pytest.approx(norm)
    coef = 1.0 / (norm + 1e-6)
    assert torch.allclose(seen[0]["a.weight"], torch.full((2, 3), coef))
    assert torch.allclose(seen[0]["b.weight"], torch.full((1, 2), 2 * coef))
    clipped = math.sqrt(sum(float((g ** 2).sum()) for g in seen[0].values()))
    assert clipped == pytest.approx(1.0, abs=1e-5)


def test_no_clip_below_max_norm_or_when_disabled():
    for max_norm, g in ((10.0, 1.0), (0.0, 5.0)):
        b = backend(Tiny(), max_norm=max_norm)
        seen = capture_grads(b)
        set_grads(b.model, {"a.weight": g, "b.weight": g})
        stats = b.optimizer_step()
        assert stats["grad_norm"] == pytest.approx(g * math.sqrt(8))
        assert torch.equal(seen[0]["a.weight"], torch.full((2, 3), g))


def test_non_finite_grad_skips_step_and_schedule():
    b = backend(Tiny(), lr_scheduler="linear", steps=4)
    before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
    lr0 = b.lr
    set_grads(b.model, {"a.weight": float("nan"), "b.weight": 1.0})
    stats = b.optimizer_step()
    assert stats["skipped"] == 1.0 and not math.isfinite(stats["grad_norm"])
    for n, p in b.model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None
    assert b.lr == lr0  # the schedule did not advance
    set_grads(b.model, {"a.weight": 1.0, "b.weight": 1.0})
    stats = b.optimizer_step()
    assert stats["skipped"] == 0.0 and stats["lr"] == lr0
    assert not torch.equal(b.model.a.weight, before["a.weight"])
    assert b.lr == pytest.approx(lr0 * 0.75)  # linear, no warm-up: 1 - 1/4


def test_loss_scaler_by_hand():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    s.update(True)
    assert s.scale == 8.0
    s.update(True)
    assert s.scale == 16.0
    s.update(False)
    assert s.scale == 8.0 and s.good_steps == 0


def make_rows(vocab: int, n: int = 8, seq: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, vocab, (n, seq), generator=g)
    lens = torch.tensor([12, 5, 9, 12, 4, 7, 11, 6])[:n]
    attn = (torch.arange(seq)[None] < lens[:, None]).long()
    mask = attn.clone()
    mask[:, :2] = 0
    return {"input_ids": ids * attn, "attention_mask": attn, "loss_mask": mask}


def token_sum_loss(model: nn.Module, rows: dict[str, torch.Tensor], denom: float) -> torch.Tensor:
    out = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
    logp = torch.log_softmax(out[:, :-1].float(), -1).gather(-1, rows["input_ids"][:, 1:, None])
    return -(logp.squeeze(-1) * rows["loss_mask"][:, 1:]).sum() / denom


def one_step(model_dir: str, rows: dict, micro: int, global_denom: bool = True):
    # lr 1e-4, eps 1e-6: Adam's first step is ~lr * sign(g), which turns fp32 rounding
    # differences of near-zero gradients into weight differences of up to ~lr * 1e-3.
    b = backend(load(model_dir), l2=0.01, learning_rate=1e-4, adam_eps=1e-6)
    seen = capture_grads(b)
    total = float(rows["loss_mask"][:, 1:].sum())
    n = rows["input_ids"].shape[0] // micro
    for i in range(n):
        mb = {k: v[i * micro:(i + 1) * micro] for k, v in rows.items()}
        denom = total if global_denom else float(mb["loss_mask"][:, 1:].sum()) * n
        b.backward(token_sum_loss(b.model, mb, denom), sync_grads=i == n - 1)
    stats = b.optimizer_step()
    return seen[0], {k: v.clone() for k, v in b.full_state_dict().items()}, stats


def test_grad_accumulation_equals_one_big_batch(tiny_model_dir):
    vocab = load(tiny_model_dir).config.vocab_size
    rows = make_rows(vocab)
    g8, w8, s8 = one_step(tiny_model_dir, rows, micro=8)
    g2, w2, s2 = one_step(tiny_model_dir, rows, micro=2)
    assert s2["grad_norm"] == pytest.approx(s8["grad_norm"], rel=1e-6)
    for k in g8:
        torch.testing.assert_close(g2[k], g8[k], atol=1e-6, rtol=1e-5)
    for k in w8:
        torch.testing.assert_close(w2[k], w8[k], atol=1e-6, rtol=0)
    init = load(tiny_model_dir).state_dict()
    assert max((w8[k] - init[k]).abs().max().item() for k in w8) > 5e-5  # the step moved weights
    # Control: per-micro-batch means (the bug the global count prevents) give other gradients.
    gm, _, _ = one_step(tiny_model_dir, rows, micro=2, global_denom=False)
    assert max((gm[k] - g8[k]).abs().max().item() for k in g8) > 1e-4


def test_save_hf_reloads_with_identical_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    b = backend(load(tiny_model_dir), learning_rate=1e-2)
    rows = make_rows(b.model.config.vocab_size)
    b.backward(token_sum_loss(b.model, rows, 50.0))
    b.optimizer_step()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    b.save_hf(str(tmp_path / "hf"), tokenizer=tok)
    re = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert re.dtype == torch.float32  # compute dtype on CPU with --param_dtype fp32
    b.eval()
    with torch.no_grad():
        a = b.model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
        c = re(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
    assert torch.equal(a, c)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).encode("hi") == tok.encode("hi")


def test_save_hf_bf16_sets_config_dtype(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    b = backend(load(tiny_model_dir))
    b.save_hf(str(tmp_path / "hf16"), dtype=torch.bfloat16)
    re = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf16"))
    assert re.dtype == torch.bfloat16
    w = b.model.model.embed_tokens.weight
    torch.testing.assert_close(re.model.embed_tokens.weight, w.to(torch.bfloat16))
    assert b.model.dtype == torch.float32  # the live model keeps fp32 master weights


def test_named_full_params(tiny_model_dir):
    b = backend(load(tiny_model_dir))
    named = dict(b.named_full_params(dtype=torch.bfloat16))
    params = dict(b.model.named_parameters())
    assert named.keys() == params.keys()
    assert all(named[k].dtype == torch.bfloat16 and torch.equal(named[k], params[k].to(torch.bfloat16))
               for k in named)


def test_cpu_defaults_to_fp32_compute_and_offload_is_safe(tiny_model_dir):
    model = load(tiny_model_dir)
    b = FSDP2Backend(model, BackendConfig(param_dtype="bf16"), OptimConfig(), 5, CPU)
    assert b.compute_dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in b.model.parameters())
    lp = FSDP2Backend(load(tiny_model_dir), BackendConfig(param_dtype="bf16", mixed_precision="autocast"),
                      OptimConfig(), 5, CPU, cpu_low_precision=True)
    assert lp.compute_dtype == torch.bfloat16
    rows = make_rows(model.config.vocab_size, n=2)
    out = lp.model(input_ids=rows["input_ids"]).logits
    assert out.dtype == torch.bfloat16  # forward ran under autocast
    assert all(p.dtype == torch.float32 for p in lp.model.parameters())  # master weights
    mw = FSDP2Backend(load(tiny_model_dir), BackendConfig(param_dtype="bf16"), OptimConfig(), 5, CPU,
                      cpu_low_precision=True)  # default: bf16 module, fp32 copies in the optimizer
    assert all(p.dtype == torch.bfloat16 for p in mw.model.parameters())
    assert all(p.dtype == torch.float32 for g in mw.optimizer.param_groups for p in g["params"])
    b.offload_states()
    b.reload_states()
    b.backward(token_sum_loss(b.model, rows, 10.0))
    assert b.optimizer_step()["skipped"] == 0.0


def test_inference_only_backend_and_config_errors(tiny_model_dir):
    ref = FSDP2Backend(load(tiny_model_dir), BackendConfig(param_dtype="fp32"), None, 0, CPU)
    assert ref.optimizer is None
    with pytest.raises(RuntimeError, match="without an optimizer"):
        ref.optimizer_step()
    with pytest.raises(ValueError, match="--zero_stage"):
        FSDP2Backend(Tiny(), BackendConfig(zero_stage=4), OptimConfig(), 5, CPU)
    with pytest.raises(ValueError, match="--param_dtype"):
        FSDP2Backend(Tiny(), BackendConfig(param_dtype="fp8"), OptimConfig(), 5, CPU)


def test_init_distributed_single_process(monkeypatch):
    from rlhfkit.parallel import all_reduce_sum, barrier, broadcast_object, is_rank0

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    d = init_distributed("cpu")
    assert d == DistInfo(rank=0, world_size=1, local_rank=0, device="cpu")
    assert not d.has_process_group and is_rank0()
    barrier()
    assert all_reduce_sum(2.5) == 2.5 and broadcast_object({"a": 1}) == {"a": 1}
    assert torch.equal(all_reduce_sum(torch.ones(2)), torch.ones(2))
    with pytest.raises(ValueError, match="--device"):
        init_distributed("tpu")


def saved_bytes(b: FSDP2Backend, ids: torch.Tensor) -> int:
    """Bytes the autograd graph of one forward keeps for the backward."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        b.model(input_ids=ids, use_cache=False).logits.sum().backward()
    return total[0]


def test_a_loaded_model_trains_with_checkpointing(tiny_model_dir):
    """`from_pretrained` returns a model in eval mode, where transformers skips activation checkpointing:
    a trainable backend puts it in training mode, so --gradient_checkpointing keeps only each block's
    input (a bench that never called train() measured 7B rows without it)."""
    ids = torch.randint(3, 100, (2, 64), generator=torch.Generator().manual_seed(0))
    kept = {}
    for gc in (False, True):
        model = load(tiny_model_dir)
        assert not model.training
        b = FSDP2Backend(model, BackendConfig(param_dtype="fp32", gradient_checkpointing=gc),
                         OptimConfig(learning_rate=1e-3, lr_warmup_ratio=0.0), 10, CPU)
        assert b.model.training
        kept[gc] = saved_bytes(b, ids)
    assert kept[True] < kept[False] / 2

def test_backward_in_eval_mode_says_checkpointing_is_off(tiny_model_dir, caplog):
    import logging

    from rlhfkit.config import notes

    caplog.set_level(logging.INFO)  # notes go through logging; alone, no CLI has set up its handlers
    b = FSDP2Backend(load(tiny_model_dir), BackendConfig(param_dtype="fp32", gradient_checkpointing=True),
                     OptimConfig(learning_rate=1e-3, lr_warmup_ratio=0.0), 10, CPU)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    b.backward(b.model(input_ids=ids, use_cache=False).logits.float().mean())
    assert "gradient_checkpointing has no effect" not in caplog.text
    b.eval()
    notes._NOTED.clear()
    b.backward(b.model(input_ids=ids, use_cache=False).logits.float().mean())
    assert caplog.text.count("--gradient_checkpointing has no effect there") == 1


def test_frozen_weights_take_the_compute_dtype(tiny_model_dir):
    """A LoRA base loaded in bf16 (--param_dtype) computes in fp32 on the CPU: the backend casts the frozen
    weights to its compute dtype (no masters for them), the adapters keep fp32 masters, and a step runs."""
    from rlhfkit.config.configs import ModelConfig
    from rlhfkit.models.loader import load_causal_lm

    model = load_causal_lm(ModelConfig(pretrain=tiny_model_dir, param_dtype="bf16", lora_rank=4, lora_alpha=8),
                           master_dtype="fp32")
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    b = FSDP2Backend(model, BackendConfig(param_dtype="bf16"), OptimConfig(learning_rate=1e-2), 5, CPU)
    assert b.compute_dtype == torch.float32 and {p.dtype for p in b.model.parameters()} == {torch.float32}
    rows = make_rows(model.config.vocab_size, n=2)
    b.backward(token_sum_loss(b.model, rows, 10.0))
    assert b.optimizer_step()["skipped"] == 0.0


def test_cpu_adamw_is_the_fused_kernel_with_the_per_tensor_loops_updates(tiny_model_dir):
    """On a CPU the backend's AdamW is torch's fused kernel (also under --adam_offload, which changes nothing
    there), and its update equals the default per-tensor loop's to float rounding; master copies keep the
    plain AdamW."""
    b = backend(load(tiny_model_dir))
    assert b.optimizer.defaults["fused"] is True
    assert FSDP2Backend(load(tiny_model_dir), BackendConfig(param_dtype="fp32", adam_offload=True),
                        OptimConfig(), 5, CPU).optimizer.defaults["fused"] is True
    mw = FSDP2Backend(load(tiny_model_dir), BackendConfig(param_dtype="bf16"), OptimConfig(), 5, CPU,
                      cpu_low_precision=True)
    assert not mw.optimizer.defaults["fused"]
    twin = {id(p): p.detach().clone() for g in b.optimizer.param_groups for p in g["params"]}
    start = {k: v.clone() for k, v in twin.items()}
    ref = torch.optim.AdamW([{**{k: v for k, v in g.items() if k != "params"}, "fused": False, "foreach": False,
                              "params": [twin[id(p)] for p in g["params"]]} for g in b.optimizer.param_groups])

    def copy_grads(opt, args, kwargs):  # the gradients as the fused step sees them (clipped)
        for g in opt.param_groups:
            for p in g["params"]:
                twin[id(p)].grad = p.grad.detach().clone()

    b.optimizer.register_step_pre_hook(copy_grads)
    rows = make_rows(b.model.config.vocab_size, n=2)
    for _ in range(3):
        b.backward(token_sum_loss(b.model, rows, 10.0))
        b.optimizer_step()
        ref.step()
    params = [p for g in b.optimizer.param_groups for p in g["params"]]
    assert max(float((twin[id(p)] - start[id(p)]).abs().max()) for p in params) > 1e-4  # the weights moved
    gap = max(float((p.detach() - twin[id(p)]).abs().max()) for p in params)
    assert gap < 1e-6, gap
