"""`with_index`: an engine actor's "cuda" becomes "cuda:<current>" (set_device and NCCL refuse a bare "cuda");
`use_expandable_segments`."""

import torch

from rlhfkit.parallel.dist import with_index


def test_bare_cuda_gets_the_current_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert with_index("cuda") == "cuda:3"


def test_indexed_and_cpu_unchanged(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert with_index("cuda:1") == "cuda:1"
    assert with_index("cpu") == "cpu"


def test_expandable_segments_unless_the_user_set_the_allocator(monkeypatch):
    """`use_expandable_segments` turns them on in this process's allocator on a GPU, and leaves a CPU run and
    a user's PYTORCH_CUDA_ALLOC_CONF alone."""
    from rlhfkit.parallel.dist import use_expandable_segments

    seen = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", seen.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    use_expandable_segments("cpu")
    assert seen == []
    use_expandable_segments("cuda:0")
    assert seen == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    use_expandable_segments("cuda:0")
    assert seen == ["expandable_segments:True"]
