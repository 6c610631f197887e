"""`with_index`: an engine actor's "cuda" becomes "cuda:<current>" (set_device and NCCL refuse a bare "cuda")."""

import torch

from rlhfkit.parallel.dist import with_index


def test_bare_cuda_gets_the_current_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert with_index("cuda") == "cuda:3"


def test_indexed_and_cpu_unchanged(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert with_index("cuda:1") == "cuda:1"
    assert with_index("cpu") == "cpu"
