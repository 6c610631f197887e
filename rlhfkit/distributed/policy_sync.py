"""`RayWeightSync`: the policy's weights into every engine shard, once per step (the Ray placement's
weight-sync object; `roles.group.LocalWeightSync` is the in-process one).

    sync()
      router.updating(): wait for the batch being generated (the router's weight lock), or under
          --partial_rollout pause the engines at a step boundary (generations in flight continue
          after the update, with the new weights)
      policy states on the device (--deepspeed_enable_sleep: reloaded if they were offloaded)
      direct (broadcast / ipc, weight_sync.py): every policy rank runs `push_weights`: all ranks
          gather each full tensor (FSDP2), the sending ranks pack buckets and hand them to their
          engine shards (a broadcast group of policy rank 0 + every shard, or a CUDA IPC handle to
          the shard on the same GPU); each shard copies its own slice of each full tensor
      object_store: the policy ranks gather, rank 0 leaves CPU buckets in the object store; every
          shard actor fetches them and copies its slices
      every shard must have loaded the same number of tensors; the policy version goes up by one
          and the engines resume with it (each token they sample records its version)

Bucketing happens in one place, `weight_sync.iter_buckets`. Metrics of the last sync:
`time/weight_push`, `weight_sync_mb`, `weight_sync/<method>` = 1.
"""

from __future__ import annotations

import time
from typing import Any

from rlhfkit.distributed.weight_sync import SyncChoice


class RayWeightSync:
    def __init__(self, policy: Any, router: Any, choice: SyncChoice, dtype: str | None, bucket_bytes: int) -> None:
        self.policy, self.router, self.choice = policy, router, choice
        self.dtype, self.bucket_bytes = dtype, bucket_bytes

    def _states_on_device(self):
        phases = self.policy.phases
        if phases is not None:
            return phases.states_on_device(self.policy)
        from contextlib import nullcontext

        return nullcontext()

    def sync(self) -> dict[str, float]:
        router = self.router
        router.before_update()
        with router.updating():
            t0 = time.perf_counter()
            with self._states_on_device():
                if self.choice.method == "object_store":
                    refs, nbytes = self.policy.run_all("publish_weights", self.dtype, self.bucket_bytes)[0]
                else:
                    stats = self.policy.run_all("push_weights", self.dtype, self.bucket_bytes)
            if self.choice.method == "object_store":
                counts = router.load_from_object_store(refs)
                method = "object_store"
            else:
                merged: dict[int, int] = {}
                for s in stats:
                    merged.update(s["engine_tensors"])
                counts = [merged.get(i) for i in range(len(router.shards))]
                nbytes, method = max(s["bytes"] for s in stats), stats[0]["method"]
            if len(set(counts)) > 1:
                raise RuntimeError(f"engine shards loaded different numbers of tensors ({method}): {counts}")
        return {"time/weight_push": time.perf_counter() - t0, "weight_sync_mb": nbytes / 2**20,
                f"weight_sync/{method}": 1.0}

