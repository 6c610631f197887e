"""The weight-sync flags' values, without importing torch (the flag tables import this):
`--weight_sync` choices (each resolved by `choice.REQUESTS`) and `--weight_sync_bucket_mb`'s default."""

from typing import Literal, get_args

Method = Literal["auto", "object_store", "broadcast", "ipc"]
METHODS: tuple[str, ...] = get_args(Method)
DEFAULT_BUCKET_MB = 256
