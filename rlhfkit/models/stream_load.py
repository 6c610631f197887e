"""Load a causal LM without ever holding the whole model in host memory.

    build_meta_model(auto, path, dtype, **kw)  -> the model with its parameters on the meta device
                                                 (buffers, e.g. rotary inv_freq, built for real on the
                                                 host), each tagged with its checkpoint tensor; or None
                                                 (a one-line note says why) when its checkpoint cannot
                                                 be streamed: the caller loads it with transformers
    has_pending_weights(model)                 -> whether a model still has parameters to stream in
    stream_plan(model)                         -> {parameter name: checkpoint name}; take it before
                                                 FSDP2 / tensor parallelism replace the parameters
    materialize(model, device, plan=None)      -> allocate the parameters on `device` and stream the
                                                 checkpoint into them: into FSDP2 / DTensor shards
                                                 (each rank reads only the rows it keeps) or into
                                                 plain tensors (one process, the GPU included)

Host memory. The safetensors files are read with plain reads, not mapped, in chunks of at most
`CHUNK_BYTES` of a tensor's rows (of the rows a rank keeps when the tensor is sharded on its first
dimension), cast on the destination device, and copied into the parameter. So a rank's host memory
grows by what it keeps on the host (its shards on a CPU run, nothing on a GPU run) plus one chunk.

Exactness. A checkpoint value goes checkpoint dtype -> load dtype (what `from_pretrained(dtype=...)`
would have made) -> parameter dtype (what the backend cast it to), so the numbers are those of the
transformers loader followed by the backend's casts, bit for bit.

Not streamed (transformers' loader instead, with a note): checkpoints without safetensors files,
models whose parameter names or shapes differ from the checkpoint's (transformers 5's conversions,
e.g. a mixture of experts whose per-expert checkpoint tensors it fuses into 3-D weights), and
classes that keep modules in fp32 at a lower --param_dtype. Parameters that are real when
`materialize` runs (LoRA adapters, kept on the host by `apply_lora_on_meta`) keep their values.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import Any, Iterator

import torch
from torch import nn

CHUNK_BYTES = 16 << 20  # rows of one tensor read at a time
_TAG = "_rlhfkit_ckpt"  # attribute on a meta parameter: its checkpoint tensor's name
_SOURCE = "_rlhfkit_weights"  # attribute on the model: its WeightSource

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointTensor:
    """Where one tensor lies in a safetensors file."""

    __slots__ = ("file", "dtype", "shape", "start", "end")

    def __init__(self, file: str, dtype: torch.dtype, shape: tuple[int, ...], start: int, end: int) -> None:
        self.file, self.dtype, self.shape, self.start, self.end = file, dtype, shape, start, end


def safetensors_index(path: str) -> dict[str, CheckpointTensor] | None:
    """Every tensor of the model directory's safetensors files, from their headers; None without any."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        return None
    out: dict[str, CheckpointTensor] = {}
    for name in files:
        file = os.path.join(path, name)
        with open(file, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        base = 8 + n
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if entry["dtype"] not in _ST_DTYPES:
                return None
            a, b = entry["data_offsets"]
            out[key] = CheckpointTensor(file, _ST_DTYPES[entry["dtype"]], tuple(entry["shape"]), base + a, base + b)
    return out


class WeightSource:
    """The checkpoint of a model built on the meta device, and the dtype transformers would load it in."""

    def __init__(self, path: str, index: dict[str, CheckpointTensor], load_dtype: torch.dtype) -> None:
        self.path, self.index, self.load_dtype = path, index, load_dtype


# ---------------------------------------------------------------------------------------------- building


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside put their parameters on the meta device; buffers stay real (on the host),
    so non-persistent ones such as rotary `inv_freq` are computed as usual."""
    orig = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        orig(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = orig  # type: ignore[method-assign]


def _note(msg: str) -> None:
    from rlhfkit.config.notes import note_once

    note_once(msg)


def build_meta_model(auto: Any, path: str, dtype: torch.dtype, **kwargs: Any) -> nn.Module | None:
    """`auto.from_config` of `path`'s config with its parameters on the meta device and `kwargs`
    (attn_implementation, experts_implementation), tagged with their checkpoint tensors; in eval mode,
    with the directory's generation config, as `from_pretrained` returns it. None (with a note) when
    the checkpoint cannot be streamed into it (module docstring)."""
    from transformers import AutoConfig

    index = safetensors_index(path)
    if index is None:
        _note(f"note: {path} has no safetensors files: loaded whole by transformers (not streamed)")
        return None
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    with params_on_meta():
        model = auto.from_config(config, dtype=dtype, trust_remote_code=False, **kwargs)
    if dtype != torch.float32 and (model._keep_in_fp32_modules_strict
                                   or (dtype == torch.float16 and model._keep_in_fp32_modules)):
        _note(f"note: {type(model).__name__} keeps some modules in fp32: loaded whole by transformers")
        return None
    why = _tag_params(model, index)
    if why:
        _note(f"note: {path}: {why}; loaded whole by transformers (not streamed)")
        return None
    for name, buf in model.named_buffers():  # persistent buffers the checkpoint has (rare): read now
        entry = index.get(name)
        if entry is not None and entry.shape == tuple(buf.shape):
            _read_box(entry, buf, (0,) * buf.dim(), dtype if buf.is_floating_point() else buf.dtype)
    model.name_or_path = path
    model.config._name_or_path = path
    if os.path.isfile(os.path.join(path, "generation_config.json")) and getattr(model, "generation_config", None):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    setattr(model, _SOURCE, WeightSource(path, index, dtype))
    return model.eval()


def _tag_params(model: nn.Module, index: dict[str, CheckpointTensor]) -> str | None:
    """Tag each parameter with the checkpoint tensor it loads from (tied parameters: any of their
    names the checkpoint has); the reason it cannot be done, or None."""
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        params[id(p)] = p
    for key, names in aliases.items():
        found = next((n for n in names if n in index), None)
        if found is None:
            return f"no checkpoint tensor for parameter {names[0]} (its names differ from the model's)"
        p = params[key]
        if index[found].shape != tuple(p.shape):
            return f"checkpoint tensor {found} has shape {list(index[found].shape)}, the model {list(p.shape)}"
        setattr(p, _TAG, found)
    return None


@contextlib.contextmanager
def adapters_on_host(model: nn.Module) -> Iterator[None]:
    """peft moves each new adapter to its base layer's device, which for a meta base would drop the
    adapter's initial values: inside, while `model` has meta parameters, moving a module to the meta
    device keeps it where it is (a dtype given with the move still applies), so adapters start on the
    host as they would on a loaded model, with the same values from the same random numbers."""
    if not has_pending_weights(model):
        yield
        return
    orig = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "meta":
            return orig(self, dtype=dtype) if dtype is not None else self
        return orig(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = orig  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------- loading


def weight_source(model: nn.Module) -> WeightSource | None:
    for m in model.modules():
        src = m.__dict__.get(_SOURCE)
        if src is not None:
            return src
    return None


def has_pending_weights(model: nn.Module) -> bool:
    """Whether `model` was built by `build_meta_model` and its weights are not streamed in yet."""
    src = weight_source(model)
    return src is not None and any(_local(p).device.type == "meta" for p in model.parameters())


def stream_plan(model: nn.Module) -> dict[str, str]:
    """{parameter name (every alias of a tied one): checkpoint tensor name} from the tags."""
    return {n: getattr(p, _TAG) for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, _TAG)}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _box(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the local tensor to write, its offset in the full tensor) of a parameter, plain or DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p.data, (0,) * p.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"streamed load: a DTensor shard of shape {list(local.shape)}, expected {list(shape)}")
    return local, tuple(offset)


class _ReadBuffer:
    """One host buffer that every read goes through (freed allocations of this size would stay in the
    process's heap, one per chunk read)."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self.data is None or self.data.numel() < nbytes:
            self.data = None
            self.data = torch.empty(max(nbytes, CHUNK_BYTES), dtype=torch.uint8)
        return self.data[:nbytes]


def _read_box(entry: CheckpointTensor, dst: torch.Tensor, offset: tuple[int, ...], load_dtype: torch.dtype,
              buffer: _ReadBuffer | None = None) -> int:
    """Copy the part of the checkpoint tensor `entry` at `offset` with `dst`'s shape into `dst`, reading
    whole rows of the first dimension, at most CHUNK_BYTES at a time (one row at least) into `buffer`;
    the bytes read."""
    if dst.numel() == 0:
        return 0
    buffer = buffer or _ReadBuffer()
    item = torch.empty((), dtype=entry.dtype).element_size()
    shape = entry.shape
    if not shape:  # a scalar
        rows, row_bytes, first, count = 1, item, 0, 1
    else:
        inner = 1
        for s in shape[1:]:
            inner *= s
        rows, row_bytes, first, count = shape[0], inner * item, offset[0], dst.shape[0]
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    cast = load_dtype if entry.dtype.is_floating_point and load_dtype.is_floating_point else entry.dtype
    read = 0
    with open(entry.file, "rb", buffering=0) as f:
        for r in range(first, first + count, step):
            n = min(step, first + count - r)
            buf = buffer.take(n * row_bytes)
            f.seek(entry.start + r * row_bytes)
            view, got = memoryview(buf.numpy()), 0
            while got < len(view):
                k = f.readinto(view[got:])
                if not k:
                    raise OSError(f"{entry.file}: file ends inside a tensor")
                got += k
            read += got
            piece = buf.view(entry.dtype).reshape((n, *shape[1:]) if shape else ())
            if shape and len(shape) > 1:
                piece = piece[(slice(None),) + tuple(slice(o, o + s) for o, s in zip(offset[1:], dst.shape[1:]))]
            piece = piece.to(dst.device).to(cast)
            target = dst[r - first:r - first + n] if shape else dst
            target.copy_(piece)
            del buf, piece
    return read


def _real_tensors(model: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """Copies of the parameters (local shards) and buffers that are not on the meta device."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    for n, p in model.named_parameters():
        if _local(p).device.type != "meta":
            out[("p", n)] = _local(p).detach().clone()
    for n, b in model.named_buffers():
        if b.device.type != "meta":
            out[("b", n)] = b.detach().clone()
    return out


@torch.no_grad()
def materialize(model: nn.Module, device: str | torch.device, plan: dict[str, str] | None = None,
                buffers_device: str | torch.device | None = None) -> int:
    """Allocate `model`'s meta parameters on `device` and stream its checkpoint into them (module
    docstring). `plan`: `stream_plan(model)` taken before the parameters were replaced (FSDP2, tensor
    parallelism); default: read now. Buffers and real parameters go to `buffers_device` (default
    `device`) with their values. Returns the checkpoint bytes read."""
    src = weight_source(model)
    if src is None:
        raise RuntimeError("materialize: the model was not built by build_meta_model")
    plan = stream_plan(model) if plan is None else plan
    device = torch.device(device)
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if sharded:
        keep = _real_tensors(model)
        model.to_empty(device=device)
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        for (kind, n), t in keep.items():
            (_local(params[n]) if kind == "p" else buffers[n]).copy_(t)
        del keep
        if buffers_device is not None and torch.device(buffers_device) != device:
            for m in model.modules():
                for k, b in m._buffers.items():
                    if b is not None:
                        m._buffers[k] = b.to(buffers_device)
    else:
        made: dict[int, nn.Parameter] = {}  # tied parameters stay one parameter
        for m in model.modules():
            for k, p in list(m._parameters.items()):
                if p is not None and p.device.type == "meta":
                    if id(p) not in made:
                        made[id(p)] = type(p)(torch.empty(p.shape, dtype=p.dtype, device=device),
                                              requires_grad=p.requires_grad)
                    m._parameters[k] = made[id(p)]
        del made
        model.to(buffers_device or device)
    jobs: dict[str, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for n, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        ckpt = plan.get(n)
        if ckpt is None:
            if _local(p).device.type == "meta":
                raise RuntimeError(f"streamed load: parameter {n} has no checkpoint tensor")
            continue
        jobs.setdefault(ckpt, []).append(p)
    # file by file, in file order: sequential reads
    read, buffer = 0, _ReadBuffer()
    for ckpt in sorted(jobs, key=lambda k: (src.index[k].file, src.index[k].start)):
        for p in jobs[ckpt]:
            local, offset = _box(p)
            read += _read_box(src.index[ckpt], local, offset, src.load_dtype, buffer)
    return read
