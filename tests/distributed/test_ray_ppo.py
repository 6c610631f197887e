"""train_ppo_ray on a local Ray (CPU) == one-process train_ppo, for the placements of issue 6.

GRPO (group_norm), 4 prompts x 2 samples per step, train_batch_size 8 (one optimizer step per RL
step), KL as a loss against a reference model, the builtin engine, 2 steps, tiny Llama.

- separate actors: policy, ref and the engine are three Ray actors on three placement groups;
- --colocate_all_models (+ --vllm_enable_sleep --deepspeed_enable_sleep, and --gradient_checkpointing
  --adam_offload as a 7B run would set them): the three share one bundle (a third of it each), the
  engine sleeps while the roles work, the states make a host round trip (logged: time/offload,
  offload_gb) and checkpointing recomputes the same activations;
- --async_train: the next batch is generated while the policy trains; staleness is logged;
- weight sync: the separate-actors run syncs by `--weight_sync broadcast` (a gloo group of policy
  rank 0 and the engine); the same run with `--weight_sync object_store` gives identical metrics
  (but vllm_kl, see below) and weights: both deliver the same bytes. Colocated and async runs use
  the default (auto: gloo broadcast on CPU). A Ray-level test broadcasts buckets of mixed dtypes
  (tied tensors included) from a policy actor to 2 engine actors and checks them bit for bit.

Tolerances. Each role group has one rank, so the actors run no process group and execute the same
float operations in the same order as one-process train_ppo (the driver splits nothing; rows go
to rank 0 unchanged), and the engine samples with the same per-request seeds. Measured: every
loss, KL, grad norm and the final weights are bit-identical; the only difference is the engine's
own log-probs (`vllm_kl`, which differs by ~1e-8 because the engine's batch rows are laid out
differently), and those only enter the loss under --enable_vllm_is_correction (off here). So:
sampled-token statistics 1e-6 (one differing token moves the reward by >= 1/48), training
metrics rel 1e-6, weights 1e-6 absolute (they move by > 1e-3 over the run).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers import read_run as read
from helpers import rl_flags as flags
from safetensors.torch import load_file

from rlhfkit.cli import train_ppo

ray = pytest.importorskip("ray")
from rlhfkit.cli import train_ppo_ray  # noqa: E402

# --dist loadgroup: one worker runs the modules on the local Ray, which starts once, not once a worker
pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("local_ray")]

SAMPLE_KEYS = ["train/reward", "train/reward_std", "train/response_length", "train/truncated_rate", "train/even_frac"]
TRAIN_KEYS = ["train/policy_loss", "train/kl_loss", "train/kl", "train/advantage", "train/grad_norm", "train/entropy"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, data_dir):
    save = os.path.join(data_dir, "one_process")
    train_ppo.main(flags(tiny_model_dir, data_dir, save))
    recs, w = read(save)
    assert max(abs(r["train/policy_loss"]) for r in recs) > 1e-3, "policy_loss ~ 0 at every step: a vacuous comparison"
    w0 = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert max(float((w[k] - w0[k]).abs().max()) for k in w0) > 1e-3
    return recs, w


def placement(out: str) -> list[dict]:
    pat = re.compile(r"placement: (\w+) rank (\d+) pid (\d+) node (\w+) \S+ pool (\S+) bundle (\d+)")
    return [dict(zip(("role", "rank", "pid", "node", "pool", "bundle"), m.groups())) for m in pat.finditer(out)]


def assert_match(ref: list[dict], got: list[dict], steps: list[int]) -> None:
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(ref, got):
        if a["step"] not in steps:
            continue
        for k in SAMPLE_KEYS:
            assert b[k] == pytest.approx(a[k], abs=1e-6), f"step {a['step']} {k}: sampled tokens differ"
        for k in TRAIN_KEYS:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), f"step {a['step']} {k}: {b[k]} != {a[k]}"


@pytest.fixture(scope="module")
def separate_run(tiny_model_dir, data_dir, local_ray):
    """Policy, ref and engine on their own actors, weights by gloo broadcast: (stdout, metrics, weights)."""
    import contextlib
    import io

    save = os.path.join(data_dir, "separate")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        train_ppo_ray.main(flags(tiny_model_dir, data_dir, save, "--weight_sync", "broadcast"))
    return (buf.getvalue(), *read(save))


def test_separate_actors_match_one_process(reference, separate_run):
    out, recs, w = separate_run
    where = placement(out)
    assert sorted(p["role"] for p in where) == ["engine", "policy", "ref"], out[-2000:]
    assert len({p["pid"] for p in where}) == 3 and len({p["pool"] for p in where}) == 3
    assert "weight sync: broadcast over gloo" in out
    assert_match(reference[0], recs, [1, 2])
    assert all(r["train/weight_sync_mb"] > 0.1 and r["time/weight_push"] > 0 and r["weight_sync/broadcast"] == 1
               for r in recs)
    for k, v in reference[1].items():
        torch.testing.assert_close(w[k], v, atol=1e-6, rtol=0, msg=k)


def test_object_store_sync_equals_broadcast(tiny_model_dir, data_dir, separate_run, capsys):
    save = os.path.join(data_dir, "object_store")
    train_ppo_ray.main(flags(tiny_model_dir, data_dir, save, "--weight_sync", "object_store"))
    assert "weight sync: object_store" in capsys.readouterr().out
    _, b_recs, b_w = separate_run
    recs, w = read(save)
    assert all(r["weight_sync/object_store"] == 1 and "weight_sync/broadcast" not in r for r in recs)
    for a, b in zip(b_recs, recs, strict=True):
        # timings aside, everything is equal except the engine's own log-probs (vllm_kl), which move
        # by ~1e-8 with the order in which requests reach the engine's batch (see the top)
        keys = {k for k in a if not k.startswith(("time/", "weight_sync/"))
                and k not in ("train/generate_share", "train/vllm_kl")}
        assert len(keys) > 15 and {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert b["train/vllm_kl"] == pytest.approx(a["train/vllm_kl"], abs=1e-6)
    assert w.keys() == b_w.keys() and all(torch.equal(w[k], b_w[k]) for k in w)


def test_colocate_all_with_sleep_matches_one_process(tiny_model_dir, data_dir, reference, local_ray, capsys):
    save = os.path.join(data_dir, "colocated")
    train_ppo_ray.main(flags(tiny_model_dir, data_dir, save, "--colocate_all_models", "--vllm_enable_sleep",
                             "--deepspeed_enable_sleep", "--gradient_checkpointing", "--adam_offload"))
    out = capsys.readouterr().out
    where = placement(out)
    assert sorted(p["role"] for p in where) == ["engine", "policy", "ref"]
    assert {(p["pool"], p["bundle"]) for p in where} == {("all", "0")}, where
    assert "pool all: 1 GPU(s) x [policy, ref, engine]" in out  # the memory plan, printed before the actors
    recs, w = read(save)
    assert_match(reference[0], recs, [1, 2])
    # the engine slept during each step's training; it takes the weights asleep and wakes before the
    # next step's generation, after the policy's states left the device (lazily, after the push)
    assert all(r["time/engine_sleep"] > 0 and r["time/states_offload"] > 0 for r in recs)
    assert "time/engine_wake" not in recs[0] and all(r["time/engine_wake"] > 0 for r in recs[1:])
    # measured in the ranks: policy and ref states went to host buffers and came back (bit for bit:
    # the metrics and weights match the one-process run)
    # (step 1 reloads nothing: each group starts on the device, and with one optimizer step per
    # rollout the policy has no log-prob pass before it trains, so nothing made it leave)
    assert all(r["time/offload"] > 0 and r["train/offload_gb"] > 0 for r in recs)
    assert all(r["time/reload"] > 0 for r in recs[1:])
    for k, v in reference[1].items():
        torch.testing.assert_close(w[k], v, atol=1e-6, rtol=0, msg=k)


def test_async_train_logs_staleness(tiny_model_dir, data_dir, reference, local_ray):
    save = os.path.join(data_dir, "async")
    train_ppo_ray.main(flags(tiny_model_dir, data_dir, save, "--async_train", "--async_queue_size", "1"))
    recs, _ = read(save)
    # batch 1 comes from the initial policy (as in a synchronous run: identical step 1); batch 2 was
    # generated while step 1 trained, so by the policy one version behind the one it trains
    assert [r["train/staleness"] for r in recs] == [0.0, 1.0]
    assert [r["train/staleness_max"] for r in recs] == [0.0, 1.0]
    assert_match(reference[0], recs, [1])
    # vllm_kl = mean(rollout logprob - logprob of the policy being trained): ~1e-8 when the engine
    # has the trained weights (reference), clearly nonzero when batch 2 came from the older policy
    assert abs(reference[0][1]["train/vllm_kl"]) < 1e-6
    assert abs(recs[1]["train/vllm_kl"]) > 1e-5  # measured 3.8e-4
    assert all(r["time/generate_async"] > 0 for r in recs)


@pytest.mark.parametrize("extra, message", [
    (["--partial_rollout"], "--partial_rollout needs --async_train"),
    (["--async_train", "--partial_rollout", "--rollout_engine", "hf"], "--partial_rollout needs --rollout_engine builtin"),
    (["--colocate_all_models", "--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "2"],
     "--vllm_num_engines x --vllm_tensor_parallel_size (1 x 1 = 1) must equal --actor_num_nodes 1 x "
     "--actor_num_gpus_per_node 2 (2)"),
    (["--colocate_actor_ref", "--ref_num_gpus_per_node", "2"], "--colocate_actor_ref needs --ref_num_nodes 1 x"),
    (["--async_train", "--vllm_enable_sleep"], "--vllm_enable_sleep"),
])
def test_bad_placement_flags_fail_before_ray_starts(tiny_model_dir, data_dir, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        train_ppo_ray.main(flags(tiny_model_dir, data_dir, os.path.join(data_dir, "bad"), *extra))
    assert e.value.code == 1
    assert message in capsys.readouterr().err


def test_memory_plan_over_the_gpu_refuses_before_ray_starts(tiny_model_dir, data_dir, capsys, monkeypatch):
    from rlhfkit.rl_run import memory_check, ray_layout

    monkeypatch.setattr(memory_check, "gpu_bytes", lambda args: 2**20)  # a 1 MiB "GPU"
    monkeypatch.setattr(ray_layout, "launch_roles", None)  # never reached
    with pytest.raises(SystemExit) as e:
        train_ppo_ray.main(flags(tiny_model_dir, data_dir, os.path.join(data_dir, "oom")))
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert re.search(r"the memory plan needs about [\d.]+ GiB per GPU in pool \w+ \(\w+\) but the GPU has 0.0 GiB", err)
    assert "--skip_memory_check runs anyway" in err


def test_broadcast_group_delivers_identical_buckets(local_ray):
    """A policy-like actor (RoleWorker over a fake role) and 2 engine-like actors (EngineWorker
    over a recording engine) form the gloo group; small buckets force several broadcasts."""
    from rlhfkit.distributed.workers import EngineWorker, RoleWorker
    from rlhfkit.weightsync.buckets import iter_buckets
    from rlhfkit.weightsync.choice import Endpoint, choose_transport
    from rlhfkit.weightsync.protocol import SyncPeers

    def tensors() -> list[tuple[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(3)
        emb = torch.randn(16, 8, generator=g)
        return [("model.embed_tokens.weight", emb), ("model.norm.weight", torch.randn(8, generator=g)),
                ("half", torch.randn(3, 5, generator=g).half()), ("bf", torch.randn(33, generator=g).bfloat16()),
                ("steps", torch.arange(7, dtype=torch.int64)), ("flag", torch.tensor([True, False])),
                ("lm_head.weight", emb)]

    class FakeRole:
        def __init__(self, dist):
            self.dist = dist  # a role's rank and device (roles.group.Role)

        def weights(self):
            return iter(tensors())

    class Recorder:
        def __init__(self):
            self.got, self.calls = {}, 0

        def update_weights(self, named):
            self.calls += 1
            self.got.update({n: t.clone() for n, t in named})

        def generate(self, requests):
            return self.got, self.calls

    def build_role(role, dist):
        return FakeRole(dist), None

    def build_engine(dist):
        return Recorder()

    policy = ray.remote(RoleWorker).options(num_cpus=0, max_concurrency=2).remote("policy", 0, 1, build_role)
    engines = [ray.remote(EngineWorker).options(num_cpus=0).remote(i, build_engine) for i in range(2)]
    ray.get([policy.setup.remote("127.0.0.1", 0, "cpu"), *[e.setup.remote("cpu", 2) for e in engines]])
    cpu = Endpoint("n", (), "cpu")
    transport = choose_transport("broadcast", [cpu], [cpu, cpu])
    transport.connect(SyncPeers([policy], ["127.0.0.1"], engines, ["127.0.0.1"] * 2,
                                lambda refs, who: ray.get(refs, timeout=60), timeout_s=30))
    stats = ray.get(policy.push_weights.remote(None, 600), timeout=60)
    want = tensors()
    n_buckets = len(list(iter_buckets(iter(want), 600)))
    assert n_buckets == 3  # bytes rounded to 64: 512 64 | 64 128 64 64 | 512 (the head, alone), by hand
    assert stats.method == "broadcast" and stats.buckets == n_buckets
    assert stats.engine_tensors == {0: len(want), 1: len(want)}
    for got, calls in ray.get([e.generate.remote([]) for e in engines]):
        assert calls == n_buckets and sorted(got) == sorted(n for n, _ in want)
        for name, t in want:
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # a second push, cast to bfloat16 (as on GPU): floats arrive rounded, integers untouched
    ray.get(policy.push_weights.remote("bfloat16", 600), timeout=60)
    for got, _ in ray.get([e.generate.remote([]) for e in engines]):
        for name, t in want:
            assert torch.equal(got[name], t.bfloat16() if t.is_floating_point() else t), name
    for a in (policy, *engines):
        ray.kill(a, no_restart=True)
