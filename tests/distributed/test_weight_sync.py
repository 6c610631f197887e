"""Weight-sync pieces that need no Ray: the flat bucket layout, the bucketing and the choice of the
sync path (values worked out by hand), plus a gloo broadcast group of 3 ranks in threads."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import free_port

from rlhfkit.weightsync.broadcast import BroadcastTransport
from rlhfkit.weightsync.buckets import ALIGN, iter_buckets, pack_bucket, unpack_bucket
from rlhfkit.weightsync.choice import Endpoint, choose_transport
from rlhfkit.weightsync.collective import GroupSpec, broadcast, check_group, make_group
from rlhfkit.weightsync.ipc import IpcTransport
from rlhfkit.weightsync.object_store import ObjectStoreTransport


def mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(5, 3, generator=g)
    base = torch.randn(4, 6, generator=g)
    return [
        ("embed.weight", emb),
        ("norm.weight", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("ids", torch.arange(5, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("half", torch.randn(2, 2, generator=g).half()),
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.zeros(0, 4)),
        ("transposed", base.t()),  # not contiguous
        ("lm_head.weight", emb),  # tied to embed.weight
    ]


def test_pack_unpack_round_trip_mixed_dtypes_and_aliases():
    named = mixed()
    flat, metas = pack_bucket(named, "cpu")
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert [m.name for m in metas] == [n for n, _ in named]
    assert all(m.offset % ALIGN == 0 for m in metas)
    # bytes, each rounded up to 64: 60, 14, 40, 3, 8, 4, 0, 96; the tied head costs nothing
    assert flat.numel() == 64 + 64 + 64 + 64 + 64 + 64 + 0 + 128
    by = {m.name: m for m in metas}
    assert by["lm_head.weight"].offset == by["embed.weight"].offset
    out = unpack_bucket(flat, metas)
    for (name, t), (name2, u) in zip(named, out, strict=True):
        assert name == name2 and u.dtype == t.dtype and u.shape == t.shape, name
        assert torch.equal(u, t), name
    assert out[0][1].data_ptr() == out[-1][1].data_ptr()  # aliased names share the bytes
    # views: writing the bucket changes the unpacked tensor (the engine copies from views)
    flat[by["ids"].offset:by["ids"].offset + 8].zero_()
    assert int(unpack_bucket(flat, metas)[2][1][0]) == 0


def test_pack_casts_floating_tensors_only():
    named = [("w", torch.tensor([1.0, 2.0 ** -9 + 1.0])), ("i", torch.tensor([7], dtype=torch.int32)),
             ("t", torch.tensor([1.0, 2.0, 3.0]))]
    flat, metas = pack_bucket(named, "cpu", cast=torch.bfloat16)
    assert [m.dtype for m in metas] == ["bfloat16", "int32", "bfloat16"]
    assert [m.nbytes for m in metas] == [4, 4, 6]
    out = dict(unpack_bucket(flat, metas))
    assert torch.equal(out["w"], torch.tensor([1.0, 2.0 ** -9 + 1.0]).to(torch.bfloat16))
    assert float(out["w"][1]) == 1.0  # 1 + 2^-9 rounds to 1 in bfloat16 (7 mantissa bits)
    assert out["i"].dtype == torch.int32 and int(out["i"][0]) == 7


def test_unpack_rejects_bad_metadata():
    flat, metas = pack_bucket([("a", torch.ones(4))], "cpu")
    with pytest.raises(ValueError, match="exceed the bucket"):
        unpack_bucket(flat[:8], metas)
    with pytest.raises(ValueError, match="1-D uint8"):
        unpack_bucket(flat.view(torch.float32), metas)


def test_iter_buckets_sizes_by_hand():
    ts = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([100, 100, 300, 10, 10])]  # 400, 400, 1200, 40, 40 B
    # rounded to 64: 448, 448, 1216, 64, 64; limit 1000: [t0 t1] (896), [t2] alone (> limit), [t3 t4]
    got = [[n for n, _ in b] for b in iter_buckets(iter(ts), 1000)]
    assert got == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    # cast to bf16 halves the float bytes: 200 -> 256, 256, 640, 64, 64: [t0 t1], [t2 t3 t4]
    got = [[n for n, _ in b] for b in iter_buckets(iter(ts), 1000, torch.bfloat16)]
    assert got == [["t0", "t1"], ["t2", "t3", "t4"]]
    with pytest.raises(ValueError, match="--weight_sync_bucket_mb"):
        list(iter_buckets(iter(ts), 0))


def test_iter_buckets_consumes_everything():
    seen = []

    def gen():
        for i in range(5):
            seen.append(i)
            yield f"t{i}", torch.zeros(8)

    assert sum(len(b) for b in iter_buckets(gen(), 10)) == 5 and seen == [0, 1, 2, 3, 4]


CPU = Endpoint("n0", (), "cpu")


def gpu(node: str, gid: str) -> Endpoint:
    return Endpoint(node, (gid,), "cuda:0")


def test_choose_transport():
    # CPU: auto -> gloo broadcast; ipc impossible -> broadcast with the reason
    c = choose_transport("auto", [CPU], [CPU])
    assert isinstance(c, BroadcastTransport) and c.backend == "gloo" and "CPU" in c.reason
    c = choose_transport("ipc", [CPU, CPU], [CPU])
    assert isinstance(c, BroadcastTransport) and c.backend == "gloo" and "--weight_sync ipc falls back" in c.reason
    # disaggregated GPUs: NCCL; --vllm_sync_backend gloo forces gloo
    dis = ([gpu("n0", "0")], [gpu("n0", "1")])
    assert choose_transport("auto", *dis) == choose_transport("broadcast", *dis) == BroadcastTransport("nccl")
    assert choose_transport("broadcast", *dis, backend="gloo").backend == "gloo"
    # colocated over 2 GPUs: engine i on policy rank i's GPU -> ipc from rank i
    col = ([gpu("n0", "0"), gpu("n0", "1")], [gpu("n0", "1"), gpu("n0", "0")])
    c = choose_transport("auto", *col)
    assert isinstance(c, IpcTransport) and c.sources == (1, 0)
    # asked for broadcast while an engine shares rank 0's GPU: NCCL cannot, gloo it is
    c = choose_transport("broadcast", *col)
    assert isinstance(c, BroadcastTransport) and c.backend == "gloo" and "rank 0's GPU" in c.reason
    # same GPU id on another node is not the same GPU
    assert choose_transport("auto", [gpu("n0", "0")], [gpu("n1", "0")]) == BroadcastTransport("nccl")
    # vLLM engines keep the object store, with the reason; object_store as asked
    c = choose_transport("broadcast", *dis, engine_direct=False)
    assert isinstance(c, ObjectStoreTransport) and "vLLM" in c.reason
    assert choose_transport("object_store", *col) == ObjectStoreTransport()
    with pytest.raises(ValueError, match="--weight_sync 'nccl'"):
        choose_transport("nccl", *dis)


def test_gloo_group_broadcasts_buckets_in_threads():
    """Rank 0 + 2 receivers in threads of this process: bit-identical buckets, own store."""
    port = free_port()
    spec = GroupSpec("127.0.0.1", port, 3, "gloo", timeout_s=30)
    flat, metas = pack_bucket(mixed(), "cpu")
    got: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            store, pg = make_group(spec, rank)
            check_group(pg, rank, "cpu")
            buf = flat.clone() if rank == 0 else torch.empty_like(flat)
            broadcast(pg, buf)
            got[rank] = buf
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for r in (1, 2):
        assert torch.equal(got[r], flat)
        for (n, a), (_, b) in zip(unpack_bucket(got[r], metas), mixed(), strict=True):
            assert torch.equal(a, b), n


def test_missing_peer_times_out_instead_of_hanging():
    import time

    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(Exception) as e:  # noqa: B017 - the store / gloo error type differs across torch versions
        make_group(GroupSpec("127.0.0.1", port, 2, "gloo", timeout_s=2), 0)  # rank 1 never comes
    assert time.monotonic() - t0 < 30, e.value
