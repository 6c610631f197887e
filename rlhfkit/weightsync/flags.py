"""The weight-sync flags' values, without importing torch (the flag tables import this):
`--weight_sync` choices (each resolved by `choice.REQUESTS`) and `--weight_sync_bucket_mb`'s default."""

METHODS = ("auto", "object_store", "broadcast", "ipc")
DEFAULT_BUCKET_MB = 256
