"""rlhfkit/weightsync without Ray: the one bucketing function, the transport choice table, the
transports' connect on fake actor handles, the direct push loop on a fake channel, and
RayWeightSync driven with fake policy / engine handles."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch

from rlhfkit.weightsync.broadcast import BroadcastChannel, BroadcastReceiver, BroadcastTransport
from rlhfkit.weightsync.buckets import ALIGN, DEFAULT_BUCKET_MB, iter_buckets
from rlhfkit.weightsync.choice import REQUESTS, Endpoint, choose_transport
from rlhfkit.weightsync.direct import DirectSender
from rlhfkit.weightsync.flags import METHODS
from rlhfkit.weightsync.ipc import IpcChannel, IpcReceiver, IpcTransport
from rlhfkit.weightsync.object_store import ObjectStoreSender, ObjectStoreTransport, put_buckets
from rlhfkit.weightsync.protocol import PushStats, SyncPeers
from rlhfkit.weightsync.sync import RayWeightSync


def rounded(t: torch.Tensor, cast: torch.dtype | None = None) -> int:
    dt = cast if cast is not None and t.is_floating_point() else t.dtype
    return -(-t.numel() * dt.itemsize // ALIGN) * ALIGN


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("cast", [None, torch.bfloat16])
def test_iter_buckets_bounds_order_and_coverage(seed, cast):
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    named = [(f"t{i}", torch.zeros(rng.randint(0, 700), dtype=rng.choice(dtypes))) for i in range(60)]
    limit = 1024
    buckets = list(iter_buckets(iter(named), limit, cast))
    # every tensor exactly once, in order
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert all(b for b in buckets)
    for b in buckets:
        size = sum(rounded(t, cast) for _, t in b)
        assert size <= limit or len(b) == 1  # only a tensor larger than the limit goes over, alone
    # greedy: a bucket closes only when the next tensor would not fit
    for b, nxt in zip(buckets, buckets[1:]):
        assert sum(rounded(t, cast) for _, t in b) + rounded(nxt[0][1], cast) > limit


def test_iter_buckets_large_tensor_alone_and_bad_size():
    big, small = torch.zeros(1000), torch.zeros(4)  # 4000 B > 1024 B
    got = [[n for n, _ in b] for b in iter_buckets([("a", small), ("big", big), ("b", small)], 1024)]
    assert got == [["a"], ["big"], ["b"]]
    with pytest.raises(ValueError, match="--weight_sync_bucket_mb"):
        list(iter_buckets([("a", small)], 0))
    assert DEFAULT_BUCKET_MB == 256


# ----------------------------------------------------------------------------- the choice table

CPU = Endpoint("n0", (), "cpu")


def gpu(node: str, gid: str) -> Endpoint:
    return Endpoint(node, (gid,), "cuda:0")


DIS = ([gpu("n0", "0")], [gpu("n0", "1")])
COL = ([gpu("n0", "0"), gpu("n0", "1")], [gpu("n0", "1"), gpu("n0", "0")])
IPC_FALLBACK = ("--weight_sync ipc falls back: it needs every engine on the GPU of a policy rank "
                "(--colocate_all_models on GPUs)")


@pytest.mark.parametrize("requested, where, kw, want", [
    ("auto", COL, {}, "ipc (auto: every engine shares a GPU with a policy rank)"),
    ("ipc", COL, {}, "ipc"),
    ("auto", DIS, {}, "broadcast over nccl"),
    ("broadcast", DIS, {}, "broadcast over nccl"),
    ("broadcast", DIS, {"backend": "gloo"}, "broadcast over gloo (gloo: --vllm_sync_backend gloo)"),
    ("auto", ([CPU], [CPU]), {},
     "broadcast over gloo (gloo: the policy or an engine is on CPU (--vllm_sync_backend nccl becomes gloo))"),
    ("broadcast", COL, {}, "broadcast over gloo (gloo: an engine shares policy rank 0's GPU (NCCL needs one GPU "
                           "per rank))"),
    ("ipc", DIS, {}, f"broadcast over nccl ({IPC_FALLBACK})"),
    ("ipc", ([CPU], [CPU]), {"backend": "gloo"}, f"broadcast over gloo ({IPC_FALLBACK}; gloo: the policy or an "
                                                 "engine is on CPU)"),
    ("object_store", COL, {}, "object_store"),
    ("object_store", DIS, {"engine_direct": False}, "object_store"),
    ("auto", COL, {"engine_direct": False},
     "object_store (--weight_sync auto falls back: vLLM engines load weights through their own path)"),
    ("broadcast", DIS, {"engine_direct": False},
     "object_store (--weight_sync broadcast falls back: vLLM engines load weights through their own path)"),
])
def test_choice_table(requested, where, kw, want):
    t = choose_transport(requested, *where, **kw)
    assert t.describe() == want
    assert t.name == want.split()[0]


def test_choice_table_covers_the_flag_and_rejects_others():
    assert tuple(REQUESTS) == METHODS
    assert choose_transport("auto", *COL) == IpcTransport((1, 0), "auto: every engine shares a GPU with a policy rank")
    with pytest.raises(ValueError, match="--weight_sync 'nccl': choose one of auto, object_store, broadcast, ipc"):
        choose_transport("nccl", *DIS)


# ----------------------------------------------------------------------------- fake actor handles


class Remote:
    """`handle.method.remote(*args)` records the call and returns `result(*args)` as the 'ref'."""

    def __init__(self, log: list, who: str, name: str, result=lambda *a: None) -> None:
        self.log, self.who, self.name, self.result = log, who, name, result

    def remote(self, *args):
        self.log.append((self.who, self.name, args))
        return self.result(*args)


class FakeActor:
    def __init__(self, log: list, who: str) -> None:
        self.init_weight_sync = Remote(log, who, "init_weight_sync")
        self.reserve_port = Remote(log, who, "reserve_port", lambda: 29555)


def peers(n_policy: int, n_engines: int, ips=None):
    log: list = []
    waited: list = []

    def wait(refs, who):
        waited.append(list(who))
        return refs

    return log, waited, SyncPeers([FakeActor(log, f"policy{r}") for r in range(n_policy)], ["10.0.0.1"] * n_policy,
                                  [FakeActor(log, f"engine{i}") for i in range(n_engines)],
                                  ips or ["10.0.0.1"] * n_engines, wait, 30.0)


def installed(log: list) -> dict[str, object]:
    return {who: args[0] for who, name, args in log if name == "init_weight_sync"}


def test_broadcast_connect_gives_rank0_every_engine():
    log, waited, p = peers(2, 3)
    BroadcastTransport("nccl").connect(p)
    got = installed(log)
    s0, s1 = got["policy0"], got["policy1"]
    assert isinstance(s0, DirectSender) and isinstance(s0.channel, BroadcastChannel)
    assert list(s0.targets) == [0, 1, 2] and s1.targets == {}
    group = s0.channel.group
    assert (group.host, group.port, group.world_size, group.backend, group.local) == ("127.0.0.1", 29555, 4, "nccl",
                                                                                       True)
    assert [(r.group, r.rank) for r in (got[f"engine{i}"] for i in range(3))] == [(group, 1), (group, 2), (group, 3)]
    assert all(isinstance(got[f"engine{i}"], BroadcastReceiver) for i in range(3))
    assert waited == [[("policy", 0)], [("policy", 0), ("policy", 1), ("engine", 0), ("engine", 1), ("engine", 2)]]
    # engines on another host: the group binds rank 0's address
    log, _, p = peers(1, 1, ips=["10.0.0.2"])
    BroadcastTransport("gloo").connect(p)
    g = installed(log)["policy0"].channel.group
    assert (g.host, g.local) == ("10.0.0.1", False)


def test_ipc_connect_targets_the_rank_on_each_engines_gpu():
    log, _, p = peers(2, 3)
    IpcTransport((1, 0, 1)).connect(p)
    got = installed(log)
    assert isinstance(got["policy0"].channel, IpcChannel)
    assert list(got["policy0"].targets) == [1] and list(got["policy1"].targets) == [0, 2]
    assert got["policy1"].targets[2] is p.engines[2]
    assert all(isinstance(got[f"engine{i}"], IpcReceiver) for i in range(3))


def test_object_store_connect_sets_up_the_policy_only():
    log, waited, p = peers(2, 2)
    ObjectStoreTransport().connect(p)
    got = installed(log)
    assert set(got) == {"policy0", "policy1"}
    assert (got["policy0"].publish, got["policy1"].publish) == (True, False)
    assert waited == [[("policy", 0), ("policy", 1)]]


# ----------------------------------------------------------------------------- the direct push loop


class FakeChannel:
    name = "broadcast"

    def __init__(self) -> None:
        self.sent: list[list[str]] = []
        self.opened = self.finished = False

    def open(self, device: str) -> None:
        self.opened = True

    def send(self, bucket, cast, engines, timeout_s):
        self.sent.append([n for n, _ in bucket])
        return [len(bucket)] * len(engines)

    def after_push(self) -> None:
        self.finished = True


def stream(consumed: list[str]):
    for i in range(5):
        consumed.append(f"w{i}")
        yield f"w{i}", torch.zeros(32)  # 128 B each


def test_direct_sender_counts_and_a_rank_without_targets_only_gathers():
    ch = FakeChannel()
    s = DirectSender(ch, {0: "e0", 3: "e3"})
    s.open("cpu")
    seen: list[str] = []
    stats = s.push(stream(seen), torch.bfloat16, 128)  # 64 B each after the cast: two per bucket
    assert ch.opened and ch.finished and ch.sent == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert (stats.method, stats.buckets, stats.bytes, stats.engine_tensors) == ("broadcast", 3, 5 * 64, {0: 5, 3: 5})
    idle, seen = DirectSender(FakeChannel()), []
    idle.open("cpu")
    stats = idle.push(stream(seen), None, 128)
    assert seen == [f"w{i}" for i in range(5)] and not idle.channel.opened and not idle.channel.sent
    assert (stats.buckets, stats.bytes, stats.engine_tensors) == (0, 0, {})


def test_object_store_non_publishing_rank_consumes_without_ray():
    seen: list[str] = []
    assert put_buckets(stream(seen), 128, publish=False) == ([], 0) and len(seen) == 5
    stats = ObjectStoreSender(publish=False).push(stream([]), None, 128)
    assert (stats.method, stats.refs, stats.bytes) == ("object_store", [], 0)


# ----------------------------------------------------------------------------- RayWeightSync on fakes


class FakePolicy:
    def __init__(self, log: list, pushed: list[PushStats]) -> None:
        self.log, self.pushed, self.calls = log, pushed, []

    @contextmanager
    def states_on_device(self):
        self.log.append("states on")
        yield
        self.log.append("states off")

    def push_weights(self, dtype, bucket_bytes):
        self.log.append("push")
        self.calls.append((dtype, bucket_bytes))
        return self.pushed


class FakeEngines:
    def __init__(self, log: list, n: int, loaded: list[int] | None = None) -> None:
        self.log, self.shards, self.loaded, self.refs = log, [object()] * n, loaded, None

    def before_update(self) -> None:
        self.log.append("before")

    @contextmanager
    def updating(self):
        self.log.append("pause")
        yield
        self.log.append("resume")

    def load_from_object_store(self, refs):
        self.log.append("load")
        self.refs = refs
        return self.loaded


def test_ray_sync_direct_metrics_and_order():
    log: list = []
    pushed = [PushStats("broadcast", bytes=3 * 2**20, buckets=2, engine_tensors={0: 7, 1: 7}), PushStats("broadcast")]
    policy = FakePolicy(log, pushed)
    m = RayWeightSync(policy, FakeEngines(log, 2), BroadcastTransport("gloo"), "bfloat16", 4096).sync()
    assert policy.calls == [("bfloat16", 4096)]
    assert log == ["before", "pause", "states on", "push", "states off", "resume"]
    assert set(m) == {"time/weight_push", "weight_sync_mb", "weight_sync/broadcast"}
    assert m["weight_sync_mb"] == 3.0 and m["weight_sync/broadcast"] == 1.0 and m["time/weight_push"] >= 0


def test_ray_sync_ipc_merges_the_ranks_and_refuses_uneven_shards():
    log: list = []
    pushed = [PushStats("ipc", bytes=10, engine_tensors={1: 4}), PushStats("ipc", bytes=12, engine_tensors={0: 4})]
    m = RayWeightSync(FakePolicy(log, pushed), FakeEngines(log, 2), IpcTransport((1, 0)), None, 64).sync()
    assert m["weight_sync/ipc"] == 1.0 and m["weight_sync_mb"] == 12 / 2**20
    uneven = [PushStats("ipc", engine_tensors={0: 4}), PushStats("ipc", engine_tensors={1: 3})]
    with pytest.raises(RuntimeError, match=r"different numbers of tensors \(ipc\): \[4, 3\]"):
        RayWeightSync(FakePolicy([], uneven), FakeEngines([], 2), IpcTransport((0, 1)), None, 64).sync()
    missing = [PushStats("ipc", engine_tensors={0: 4})]  # no rank sent to shard 1
    with pytest.raises(RuntimeError, match=r"\[4, None\]"):
        RayWeightSync(FakePolicy([], missing), FakeEngines([], 2), IpcTransport((0, 0)), None, 64).sync()


def test_ray_sync_object_store_loads_rank0s_refs_after_the_states_leave():
    log: list = []
    pushed = [PushStats("object_store", bytes=2**20, refs=["r0", "r1"]), PushStats("object_store")]
    engines = FakeEngines(log, 3, loaded=[9, 9, 9])
    m = RayWeightSync(FakePolicy(log, pushed), engines, ObjectStoreTransport(), None, 64).sync()
    assert engines.refs == ["r0", "r1"]
    assert log == ["before", "pause", "states on", "push", "states off", "load", "resume"]
    assert m["weight_sync/object_store"] == 1.0 and m["weight_sync_mb"] == 1.0
    engines.loaded = [9, 8, 9]
    with pytest.raises(RuntimeError, match=r"\(object_store\): \[9, 8, 9\]"):
        RayWeightSync(FakePolicy([], pushed), engines, ObjectStoreTransport(), None, 64).sync()
