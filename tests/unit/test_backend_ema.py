"""--enable_ema: the EMA of the trained weights (rlhfkit.backend.ema) after 3 optimizer steps equals

    beta^3 w0 + beta^2 (1 - beta) w1 + beta (1 - beta) w2 + (1 - beta) w3

computed here from the weights recorded after each step; save_hf exports it (the live weights stay),
and a checkpoint carries it. Run with fp32 weights, and with bf16 compute over fp32 master weights.
"""

from __future__ import annotations

import os

import pytest
import torch

from rlhfkit.backend import FSDP2Backend
from rlhfkit.checkpoint.files import load_tensors
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.config.configs import BackendConfig, OptimConfig
from rlhfkit.models.forward import token_logprobs

CPU = DistInfo(device="cpu")
BETA = 0.6


def ema_backend(model_dir: str, dtype: str, beta: float | None = BETA) -> FSDP2Backend:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optim = OptimConfig(learning_rate=1e-2, lr_scheduler="constant", lr_warmup_ratio=0.0)
    return FSDP2Backend(model, BackendConfig(param_dtype=dtype, ema_decay=beta), optim, 10, CPU,
                        cpu_low_precision=dtype != "fp32")


def weights(b: FSDP2Backend) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 weights (the masters under bf16 compute), by name."""
    return {n: t.detach().clone().float() for n, t in b._named_params(b._params())}


def step(b: FSDP2Backend, seed: int) -> None:
    ids = torch.randint(6, 90, (2, 10), generator=torch.Generator().manual_seed(seed))
    lp = token_logprobs(b.model, ids, attention_mask=torch.ones_like(ids))
    b.backward(-lp.float().mean())
    assert b.optimizer_step()["skipped"] == 0.0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ema_after_three_steps_equals_the_formula(tiny_model_dir, tmp_path, dtype):
    b = ema_backend(tiny_model_dir, dtype)
    w = [weights(b)]
    for s in range(3):
        step(b, s)
        w.append(weights(b))
    ema = dict(zip(b.ema.names, b.ema.values))
    assert set(ema) == set(w[0])
    for name in ema:
        expect = (BETA ** 3 * w[0][name] + BETA ** 2 * (1 - BETA) * w[1][name]
                  + BETA * (1 - BETA) * w[2][name] + (1 - BETA) * w[3][name])
        torch.testing.assert_close(ema[name], expect, atol=1e-6, rtol=1e-5, msg=name)
        assert not torch.equal(w[3][name], w[0][name]) or name.endswith("norm.weight")
    name = "model.layers.0.mlp.up_proj.weight"
    assert (ema[name] - w[3][name]).abs().max() > 1e-4  # the average is not the last weights

    # the export holds the EMA weights; training goes on from the live ones
    live = {n: t.detach().clone() for n, t in b.model.named_parameters()}
    out = str(tmp_path / "hf")
    b.save_hf(out, dtype=torch.float32)
    saved = load_tensors(os.path.join(out, "model.safetensors"))
    torch.testing.assert_close(saved[name], ema[name], atol=0, rtol=0)
    for n, t in b.model.named_parameters():
        assert torch.equal(t.detach(), live[n]), n
    for n, t in weights(b).items():
        assert torch.equal(t, w[3][n]), n


def test_checkpoint_carries_the_ema(tiny_model_dir, tmp_path):
    b = ema_backend(tiny_model_dir, "fp32")
    step(b, 0)
    step(b, 1)
    b.save_checkpoint(str(tmp_path), "global_step2", {"step": 2}, 2)
    c = ema_backend(tiny_model_dir, "fp32")
    c.load_checkpoint(str(tmp_path))
    for n, v, u in zip(b.ema.names, b.ema.values, c.ema.values):
        assert torch.equal(v, u), n
    # a run without EMA loads the same checkpoint (the averages are left out)
    d = ema_backend(tiny_model_dir, "fp32", beta=None)
    assert d.ema is None and d.load_checkpoint(str(tmp_path)) == {"step": 2}
    # and an EMA run resuming from a checkpoint without averages starts them at its weights
    step(d, 2)
    d.save_checkpoint(str(tmp_path / "plain"), "global_step3", {"step": 3}, 2)
    e = ema_backend(tiny_model_dir, "fp32")
    e.load_checkpoint(str(tmp_path / "plain"))
    loaded = weights(e)
    for n, v in zip(e.ema.names, e.ema.values):
        assert torch.equal(v, loaded[n]), n


def test_ema_beta_range():
    with pytest.raises(ValueError, match="--ema_beta"):
        from rlhfkit.backend.ema import EMAWeights

        EMAWeights([("w", torch.zeros(2))], 1.5)
