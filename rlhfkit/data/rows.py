"""One input record and where it came from; the error every data problem raises.

Every row remembers its origin, so that a bad row is reported as

    data/train.jsonl row 17: missing key 'question' (--input_key)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


class DataError(ValueError):
    """Bad input data or data flags; the message names the file, row, key or flag."""


@dataclass(frozen=True)
class Row:
    """One input record and its origin (`source` path or dataset name, 1-based `row`)."""

    data: Mapping[str, Any]
    source: str
    row: int

    @property
    def where(self) -> str:
        return f"{self.source} row {self.row}"

    def error(self, message: str) -> DataError:
        """A DataError prefixed with this row's origin."""
        return DataError(f"{self.where}: {message}")

    def get(self, key: str, flag: str) -> Any:
        """`data[key]`; a missing key raises a DataError naming `flag` (e.g. '--input_key')."""
        if key not in self.data:
            have = ", ".join(repr(k) for k in list(self.data)[:8])
            raise self.error(f"missing key {key!r} ({flag}); row has {have}")
        return self.data[key]

    def get_str(self, key: str, flag: str) -> str:
        """`data[key]`, which must be a string."""
        value = self.get(key, flag)
        if not isinstance(value, str):
            raise self.error(f"key {key!r} ({flag}) must be a string, got {type(value).__name__}")
        return value

    def opt(self, key: str, default: Any = None) -> Any:
        """`data[key]` or `default` when absent or None."""
        value = self.data.get(key)
        return default if value is None else value
