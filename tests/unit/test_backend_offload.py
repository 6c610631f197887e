"""Sleep round trips (HostStash, FSDP2Backend.offload_states / reload_states) on CPU.

The host buffers are not pinned here (no CUDA), but the rest runs as on a GPU: storages are copied
to slots, resized to 0 and refilled. Each test compares against a twin that never offloads, so a
wrong slot, a missed tensor or a stale rebuild shows up as a difference in the states or in the
next training step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.backend.backend_sleep import StateOffloader
from rlhfkit.backend.offload import HostStash
from rlhfkit.config.configs import BackendConfig, OptimConfig

CPU = DistInfo(device="cpu")


# ----------------------------------------------------------------------------- StateOffloader alone


def test_state_offloader_alone_moves_params_grads_and_adam_states():
    """A plain module and AdamW, no backend: after one step every parameter, gradient and Adam moment leaves
    the device and comes back bit for bit; the step after the round trip equals a twin's that never slept;
    with the states already on the host (`on_host`) offloading does nothing."""
    def made():
        torch.manual_seed(0)
        m = nn.Linear(4, 3)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
        m(torch.ones(2, 4)).pow(2).sum().backward()
        return m, opt

    (m, opt), (twin, twin_opt) = made(), made()
    off = StateOffloader(m, None, opt, torch.device("cpu"), is_sharded=False)
    st = off.offload()
    moments = [v for state in opt.state.values() for k, v in state.items() if k.startswith("exp_avg")]
    assert off.asleep and len(moments) == 4
    assert all(t.untyped_storage().nbytes() == 0 for t in [*m.parameters(), *(p.grad for p in m.parameters()),
                                                            *moments])
    assert st.nbytes >= 3 * (12 + 3) * 4  # params, grads, two moments (+ step counters)
    off.wake()
    assert not off.asleep and off.stats["reload_bytes"] == st.nbytes
    opt.step()
    twin_opt.step()
    for a, b in zip(m.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    on_host = StateOffloader(twin, None, twin_opt, torch.device("cpu"), is_sharded=False, on_host=True)
    assert on_host.offload().nbytes == 0 and not on_host.asleep


# ----------------------------------------------------------------------------- HostStash


def test_stash_round_trip_frees_storages_and_reuses_buffers():
    base = torch.arange(10, dtype=torch.float32)
    view = base[2:5]  # shares base's storage: moves once, with the bytes around it
    other = torch.randn(3, 4, dtype=torch.bfloat16)
    fixed = torch.frombuffer(bytearray(torch.ones(4).numpy().tobytes()), dtype=torch.float32)  # not resizable
    stash = HostStash("cpu")
    assert not stash.pin  # no CUDA: plain host memory
    named = [("a", base), ("a_view", view), ("b", other), ("none", None), ("fixed", fixed)]
    want = [t.clone() for t in (base, other, fixed)]
    st = stash.offload(named)
    assert st.nbytes == 10 * 4 + 12 * 2 + 4 * 4
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    assert fixed.untyped_storage().nbytes() == 16  # left in place
    assert stash.slot("a_view") is None  # deduplicated by storage
    ptrs = {k: stash.slot(k).data_ptr() for k in ("a", "b", "fixed")}
    fixed.fill_(7.0)  # a stray write while asleep is undone by the reload
    stash.reload()
    assert torch.equal(base, want[0]) and torch.equal(view, want[0][2:5]) and torch.equal(other, want[1])
    assert torch.equal(fixed, want[2])
    base.add_(1.0)
    stash.offload(named)
    stash.reload()
    assert torch.equal(base, want[0] + 1.0)
    assert len(stash.buffers) == 1 and {k: stash.slot(k).data_ptr() for k in ptrs} == ptrs  # no re-allocation
    late = torch.randn(5)  # a state that appears later (e.g. the optimizer's after step 1) gets a new buffer
    stash.offload(named + [("late", late)])
    stash.reload()
    assert len(stash.buffers) == 2 and stash.slot("a").data_ptr() == ptrs["a"]


def test_stash_drop_frees_without_copy_and_rebuild_runs_after_the_copies():
    master = torch.randn(6)
    low = master.to(torch.bfloat16)
    stash = HostStash("cpu")
    st = stash.offload([("master", master)], drop=[("low", low)])
    assert st.nbytes == 24 and stash.slot("low") is None and low.untyped_storage().nbytes() == 0
    seen = []

    def rebuild():
        seen.append(master.clone())  # the master is already back when rebuild runs
        low.copy_(master)

    stash.reload(rebuild)
    assert torch.equal(seen[0], master) and torch.equal(low, master.to(torch.bfloat16))


# ----------------------------------------------------------------------------- FSDP2Backend


def fresh_model(seed: int = 0) -> nn.Module:
    """A tiny Llama built in memory (its storages are resizable, unlike weights mapped from a file)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def make_backend(low_precision: bool) -> FSDP2Backend:
    optim = OptimConfig(learning_rate=1e-2, lr_scheduler="constant", lr_warmup_ratio=0.0, max_norm=1.0)
    bcfg = BackendConfig(param_dtype="bf16" if low_precision else "fp32")
    return FSDP2Backend(fresh_model(), bcfg, optim, 10, CPU, cpu_low_precision=low_precision)


def step(b: FSDP2Backend, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    logits = b.model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
    b.backward(loss)
    b.optimizer_step()
    return loss.item()


def states(b: FSDP2Backend) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in b.model.named_parameters()}
    if b.master is not None:
        out.update({f"m.{n}": m.clone() for n, m in zip(b.master.names, b.master.masters)})
    for i, s in enumerate(b.optimizer.state.values()):
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def run_round_trip(low_precision: bool) -> tuple[FSDP2Backend, int]:
    b, twin = make_backend(low_precision), make_backend(low_precision)
    for s in range(2):
        assert step(b, s) == step(twin, s)
    before = states(b)
    st = b.offload_states()
    assert b.offload_states().nbytes == 0  # a second offload is a no-op
    assert all(p.untyped_storage().nbytes() == 0 for p in b.model.parameters())
    assert all(v.untyped_storage().nbytes() == 0 for s in b.optimizer.state.values() for v in s.values())
    b.reload_states()
    assert_same(before, states(b))
    for s in (2, 3):  # the next steps are those of a run that never slept
        assert step(b, s) == step(twin, s)
    assert_same(states(twin), states(b))
    stats = b.sleep_stats
    assert stats["offload_bytes"] == st.nbytes == stats["reload_bytes"] and stats["offload_s"] > 0
    return b, st.nbytes


def test_fp32_round_trip_is_bit_identical_and_moves_params_and_adam_states():
    b, nbytes = run_round_trip(low_precision=False)
    params = list(b.model.parameters())
    n = sum(p.numel() for p in params)
    # fp32 params (4 B) + exp_avg and exp_avg_sq (8 B) + one fp32 `step` scalar per parameter; no grads
    assert nbytes == 12 * n + 4 * len(params)


def test_master_weights_round_trip_rebuilds_bf16_params_instead_of_copying():
    b, nbytes = run_round_trip(low_precision=True)
    assert all(p.dtype == torch.bfloat16 for p in b.model.parameters())
    n = sum(m.numel() for m in b.master.masters)
    # fp32 masters + Adam states + steps; the bf16 module copies are not moved (rebuilt from the masters)
    assert nbytes == 12 * n + 4 * len(b.master.masters)
    assert b.offloader.stash.slot("param:model.norm.weight") is None and b.offloader.stash.slot("master:model.norm.weight") is not None
    for p, m in zip(b.master.params, b.master.masters):
        assert torch.equal(p, m.to(torch.bfloat16))


@pytest.mark.parametrize("low_precision", [False, True])
def test_repeated_sleeps_reuse_the_host_buffer_reserved_at_the_first(low_precision):
    """The first offload (before any step: parameters only) also reserves the slots of the Adam states
    the first step creates, so no later offload allocates (or, on CUDA, pins) a host buffer."""
    b = make_backend(low_precision)
    st = b.offload_states()
    reserved = b.offloader.stash.host_bytes
    assert reserved > 3 * st.nbytes  # parameters copied, and room for exp_avg + exp_avg_sq (+ steps)
    b.reload_states()
    buffers = [t.data_ptr() for t in b.offloader.stash.buffers]
    for s in range(3):
        step(b, s)
        assert b.offload_states().nbytes > 2 * st.nbytes  # the Adam states moved too ...
        b.reload_states()
    assert [t.data_ptr() for t in b.offloader.stash.buffers] == buffers and b.offloader.stash.host_bytes == reserved  # ... into it


def test_bf16_params_come_back_from_the_masters_not_from_a_copy():
    b = make_backend(low_precision=True)
    step(b, 0)
    b.offload_states()
    slot = b.offloader.stash.slot("master:model.norm.weight").view(torch.float32)
    slot.add_(1.0)  # what the reload restores into the master, the rebuild rounds into the bf16 parameter
    b.reload_states()
    norm = dict(b.model.named_parameters())["model.norm.weight"]
    master = b.master.masters[b.master.names.index("model.norm.weight")]
    assert torch.equal(master, slot) and torch.equal(norm, (slot).to(torch.bfloat16))


def test_state_readers_wake_the_states_first():
    """Saving while asleep (e.g. the critic's final export after its last offload) reads real values."""
    b = make_backend(low_precision=True)
    step(b, 0)
    want = {k: v.clone() for k, v in b.full_state_dict().items()}
    opt = b.optimizer_state_dict()["state"]["model.norm.weight"]["exp_avg"].clone()
    b.offload_states()
    got = b.full_state_dict()
    assert not b.offloader.stash.offloaded and all(torch.equal(want[k], got[k]) for k in want)
    b.offload_states()
    assert torch.equal(b.optimizer_state_dict()["state"]["model.norm.weight"]["exp_avg"], opt)
    b.offload_states()
    named = dict(b.named_full_params())
    assert torch.equal(named["model.norm.weight"], dict(b.model.named_parameters())["model.norm.weight"])
