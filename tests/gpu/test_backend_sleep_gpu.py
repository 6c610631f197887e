"""Training-state sleep and --adam_offload on a GPU (rlhfkit.backend.offload, FSDP2Backend).

- one GPU, bf16 module + fp32 masters: offload frees the states' GPU memory into page-locked host
  slots (cudaHostRegister), the round trip is bit-identical, the host buffers are reused, and the
  next steps equal those of a twin that never slept (deterministic kernels);
- --adam_offload in one process without a process group: a one-rank group is created, FSDP2's
  CPUOffloadPolicy keeps the fp32 shards and Adam's states in host memory, training runs, and
  offload_states has nothing to move (subprocess: the process group is global state).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhfkit.backend import FSDP2Backend
    from rlhfkit.parallel.dist import DistInfo
    from rlhfkit.config.configs import BackendConfig, OptimConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).float()
    model.config._attn_implementation = "eager"
    optim = OptimConfig(learning_rate=1e-3, lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=1.0)
    return FSDP2Backend(model, BackendConfig(param_dtype="bf16"), optim, 10, DistInfo(device="cuda:0"))


def step(b, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (4, 64), generator=g).cuda()
    logits = b.model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1))
    b.backward(loss)
    b.optimizer_step()
    return loss.item()


def states(b) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in b.model.parameters()] + [m.clone() for m in b.master.masters]
    return out + [v.clone() for s in b.optimizer.state.values() for v in s.values()]


def test_pinned_round_trip_frees_memory_and_matches_a_twin():
    torch.use_deterministic_algorithms(True, warn_only=True)
    b, twin = make(), make()
    assert b.master is not None  # one GPU, bf16: the master-weights path
    for s in range(2):
        assert step(b, s) == step(twin, s)
    before = states(b)
    awake = torch.cuda.memory_allocated()
    st = b.offload_states()
    freed = awake - torch.cuda.memory_allocated()
    n = sum(m.numel() for m in b.master.masters)
    assert freed >= 14 * n  # bf16 params (2) + fp32 masters (4) + Adam (8) per parameter left the GPU
    assert st.nbytes >= 12 * n  # copied: masters + Adam (+ fused AdamW's step scalars); bf16 rebuilt
    assert b.offloader.stash.pin and all(buf.is_pinned() for buf in b.offloader.stash.buffers)
    b.reload_states()
    assert all(torch.equal(x, y) for x, y in zip(before, states(b)))
    ptrs = [buf.data_ptr() for buf in b.offloader.stash.buffers]
    for s in (2, 3):
        assert step(b, s) == step(twin, s)
        b.offload_states()
        b.reload_states()
    assert [buf.data_ptr() for buf in b.offloader.stash.buffers] == ptrs  # allocated once
    assert all(torch.equal(x, y) for x, y in zip(states(twin), states(b)))


ADAM_OFFLOAD = r'''
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.config.configs import BackendConfig, OptimConfig
from torch.distributed.tensor import DTensor
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128)
b = FSDP2Backend(LlamaForCausalLM(cfg).float(), BackendConfig(param_dtype="bf16", adam_offload=True,
                 gradient_checkpointing=True), OptimConfig(learning_rate=1e-3), 10, DistInfo(device="cuda:0"))
assert torch.distributed.get_world_size() == 1 and b.is_sharded and b.cpu_offload
losses = []
for s in range(3):
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(s)).cuda()
    logits = b.model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1))
    b.backward(loss)
    b.optimizer_step()
    losses.append(loss.item())
p = next(b.model.parameters())
assert isinstance(p, DTensor) and p.to_local().device.type == "cpu"
assert all(v.device.type == "cpu" for s in b.optimizer.state.values() for v in s.values()
           if not isinstance(v, DTensor)) and len(b.optimizer.state) > 0
assert b.offload_states().nbytes == 0
print("OK", losses)
'''


def test_adam_offload_in_one_process_gets_a_one_rank_group():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", ADAM_OFFLOAD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
