"""The compilation cache folder: the user's TORCHINDUCTOR_CACHE_DIR wins, else one under XDG_CACHE_HOME."""

from __future__ import annotations

import os

from rlhfkit.compile_cache import use_persistent_cache


def test_user_folder_wins_else_xdg_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_persistent_cache() == str(tmp_path / "mine")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert use_persistent_cache() == os.path.join(str(tmp_path / "xdg"), "rlhfkit", "torchinductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(str(tmp_path / "xdg"), "rlhfkit", "torchinductor")
