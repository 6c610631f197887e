"""Weight sync: the policy's weights into the rollout engines after each step.

    sync.py          WeightSync (the loop's `sync() -> metrics`): LocalWeightSync (in-process
                     engine), RayWeightSync (policy ranks -> engine shards through a transport)
    protocol.py      the seams: WeightTransport, WeightSender, BucketReceiver, EngineShards,
                     SyncPeers (the actors a transport connects), PushStats
    choice.py        choose_transport(--weight_sync, where the actors run) -> WeightTransport
    broadcast.py     BroadcastTransport: policy rank 0 -> a gloo / NCCL group with every shard
    ipc.py           IpcTransport: CUDA IPC handles to the shards on a policy rank's GPU
    object_store.py  ObjectStoreTransport: CPU buckets in Ray's object store (`put_buckets`)
    direct.py        the bucket-by-bucket push loop of broadcast and IPC (DirectSender)
    collective.py    the broadcast group: GroupSpec, make_group, broadcast, check_group
    buckets.py       iter_buckets (the one grouping by --weight_sync_bucket_mb), the flat layout

Ray is imported only inside the functions that talk to actors, so this package loads without it.
"""
