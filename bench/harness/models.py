"""Offline model directories for the benchmarks: random weights of a named shape + a tokenizer.

    make_bench_model(path, "tiny")         # hidden 128, 4 layers, the character tokenizer (rlhfkit.models.tiny)
    make_bench_model(path, "qwen2-0.5b")   # Qwen2-0.5B's shape, bf16, a 151936-entry offline tokenizer
    make_bench_model(path, "qwen2.5-7b", device="cuda")    # 7.62B, streamed (below)
    make_bench_model(path, "qwen2.5-14b", device="cuda")   # 14.8B, streamed
    make_bench_model(path, "qwen2.5-32b", device="cuda")   # 32.8B, streamed
    python -m bench.harness.models --shape qwen2.5-7b --out /path [--device cuda] [--seed 0]

Nothing is downloaded. The 0.5B shape needs a tokenizer whose vocabulary covers every id the
random model can sample, so that any completion decodes: `build_filler_tokenizer(vocab_size)`
makes a character-level BPE (no merges) over the printable characters, the ChatML special tokens
and filler tokens "<t123>" up to `vocab_size`. Text encodes one character per token (so a prompt
of k characters is k tokens); a filler id decodes to its "<t123>" string.

Streamed shapes (7B, 14B, 32B) never build a model: `qwen2_tensors` lists every tensor's name, shape and
init; `write_random_model` plans the shards (<= `max_shard_bytes`, 5 GB like Hugging Face), writes
each safetensors header first and then, tensor by tensor, draws the values on `device` with a
generator seeded from (seed, name), copies them to the host and appends their bytes (a writer
thread overlaps the disk with the next tensor), then model.safetensors.index.json. Host memory: two
tensors (the largest, the embedding, is 1.6 GB at 32B). Init as Hugging Face's Qwen2 does it:
normal(0, initializer_range=0.02) for projections and embeddings, ones for RMSNorm weights, zeros
for the q/k/v biases, so activations stay O(1) through the layers and sampling sees finite logits.
`tensor_values(name, shape, init, seed, device)` regenerates any tensor (the tests compare the
loaded model with it).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import queue
import string
import struct
import threading
import time
import zlib
from typing import Any

import torch

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=512, max_position_embeddings=4096)
QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                 max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
QWEN25_14B = dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                  intermediate_size=13824, vocab_size=152064, tie_word_embeddings=False,
                  max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-5)
QWEN25_32B = dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                  intermediate_size=27648, vocab_size=152064, tie_word_embeddings=False,
                  max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-5)
# Qwen3-30B-A3B's shape (128 experts of width 768, 8 per token), and the same at half its depth
QWEN3_MOE_30B = dict(arch="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1_000_000.0,
                     rms_norm_eps=1e-6)
QWEN3_MOE_15B = {**QWEN3_MOE_30B, "num_hidden_layers": 24}
STREAMED = {"qwen2.5-7b": QWEN25_7B, "qwen2.5-14b": QWEN25_14B, "qwen2.5-32b": QWEN25_32B,
            "qwen3-moe-15b": QWEN3_MOE_15B, "qwen3-moe-30b": QWEN3_MOE_30B}
SHAPES = ("tiny", "qwen2-0.5b", *STREAMED)
SHARD_BYTES = 5 * 10**9
INIT_STD = 0.02

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def filler_vocab(vocab_size: int) -> dict[str, int]:
    """specials, then printable characters, then "<t{i}>" fillers: exactly `vocab_size` entries."""
    vocab: dict[str, int] = {}
    for tok in (ENDOFTEXT, IM_START, IM_END):
        vocab[tok] = len(vocab)
    for c in string.printable:
        if c not in "\x0b\x0c\r":
            vocab.setdefault(c, len(vocab))
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(vocab)} special + character tokens")
    i = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<t{i}>"] = i
        i += 1
    return vocab


def build_filler_tokenizer(vocab_size: int) -> Any:
    """A fast tokenizer with exactly `vocab_size` ids, ChatML template, eos <|im_end|>, pad <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab=filler_vocab(vocab_size), merges=[], unk_token=None))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([ENDOFTEXT, IM_START, IM_END])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT,
                                  additional_special_tokens=[IM_START], padding_side="right")
    tok.chat_template = CHATML
    if len(tok) != vocab_size:
        raise AssertionError(f"filler tokenizer has {len(tok)} ids, expected {vocab_size}")
    return tok


def _qwen2_config(shape: dict, tok: Any) -> Any:
    """The config of a Qwen2 shape, or of a Qwen3-MoE one (`arch="qwen3_moe"`)."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    shape = dict(shape)
    cls = Qwen3MoeConfig if shape.pop("arch", "qwen2") == "qwen3_moe" else Qwen2Config
    return cls(**shape, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)


# ----------------------------------------------------------------------------- streamed random weights


def qwen2_tensors(shape: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every tensor of a Qwen2 model, in checkpoint order; init is
    "normal" (std INIT_STD), "ones" (RMSNorm) or "zeros" (q/k/v biases)."""
    h, n_layers = shape["hidden_size"], shape["num_hidden_layers"]
    i, v = shape["intermediate_size"], shape["vocab_size"]
    hd = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, h), "normal")]
    for n in range(n_layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,), "ones"),
                (p + "self_attn.q_proj.weight", (q, h), "normal"), (p + "self_attn.q_proj.bias", (q,), "zeros"),
                (p + "self_attn.k_proj.weight", (kv, h), "normal"), (p + "self_attn.k_proj.bias", (kv,), "zeros"),
                (p + "self_attn.v_proj.weight", (kv, h), "normal"), (p + "self_attn.v_proj.bias", (kv,), "zeros"),
                (p + "self_attn.o_proj.weight", (h, q), "normal"),
                (p + "post_attention_layernorm.weight", (h,), "ones"),
                (p + "mlp.gate_proj.weight", (i, h), "normal"), (p + "mlp.up_proj.weight", (i, h), "normal"),
                (p + "mlp.down_proj.weight", (h, i), "normal")]
    out.append(("model.norm.weight", (h,), "ones"))
    if not shape.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h), "normal"))
    return out


def qwen3_moe_tensors(shape: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every tensor of a Qwen3-MoE model as checkpoints store it (one matrix per
    expert); q/k norms per head; no biases."""
    h, n_layers, v = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    hd, e, ie = shape["head_dim"], shape["num_experts"], shape["moe_intermediate_size"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, h), "normal")]
    for n in range(n_layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,), "ones"),
                (p + "self_attn.q_proj.weight", (q, h), "normal"), (p + "self_attn.k_proj.weight", (kv, h), "normal"),
                (p + "self_attn.v_proj.weight", (kv, h), "normal"), (p + "self_attn.o_proj.weight", (h, q), "normal"),
                (p + "self_attn.q_norm.weight", (hd,), "ones"), (p + "self_attn.k_norm.weight", (hd,), "ones"),
                (p + "post_attention_layernorm.weight", (h,), "ones"), (p + "mlp.gate.weight", (e, h), "normal")]
        for x in range(e):
            out += [(p + f"mlp.experts.{x}.gate_proj.weight", (ie, h), "normal"),
                    (p + f"mlp.experts.{x}.up_proj.weight", (ie, h), "normal"),
                    (p + f"mlp.experts.{x}.down_proj.weight", (h, ie), "normal")]
    out.append(("model.norm.weight", (h,), "ones"))
    if not shape.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h), "normal"))
    return out


def tensor_values(name: str, shape: tuple[int, ...], init: str, seed: int, device: str,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The values of one tensor: the same for the same (seed, name, device), in any order."""
    if init == "ones":
        return torch.ones(shape, dtype=dtype, device=device)
    if init == "zeros":
        return torch.zeros(shape, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=g)


def _plan_shards(tensors: list[tuple[str, tuple[int, ...], str]], elem: int, limit: int) -> list[list[int]]:
    shards: list[list[int]] = [[]]
    size = 0
    for k, (_, shape, _) in enumerate(tensors):
        n = math.prod(shape) * elem
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    return shards


DISK_DTYPES = {"bf16": (torch.bfloat16, "BF16"), "fp8": (torch.float8_e4m3fn, "F8_E4M3")}


def _header(tensors: list[tuple[str, tuple[int, ...], str]], idx: list[int], elem: int, tag: str = "BF16") -> bytes:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for k in idx:
        name, shape, _ = tensors[k]
        n = math.prod(shape) * elem
        meta[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_random_model(path: str, shape: dict, device: str = "cpu", seed: int = 0,
                       max_shard_bytes: int = SHARD_BYTES, disk_dtype: str = "bf16") -> dict[str, Any]:
    """Sharded bf16 safetensors + index for a Qwen2 `shape`, streamed; returns {seconds, bytes, files}.
    `disk_dtype` "fp8": the values rounded to float8 e4m3 on disk, half the bytes (a 32B shape on a 64 GiB
    disk); loaders cast them to the run's dtype."""
    t0 = time.perf_counter()
    dtype, tag = DISK_DTYPES[disk_dtype]
    elem = dtype.itemsize
    tensors = qwen3_moe_tensors(shape) if shape.get("arch") == "qwen3_moe" else qwen2_tensors(shape)
    shards = _plan_shards(tensors, elem, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    work: queue.Queue = queue.Queue(maxsize=2)
    failed: list[BaseException] = []

    def writer() -> None:
        f = None
        try:
            while (item := work.get()) is not None:
                if isinstance(item, str):
                    f = open(item, "wb")  # noqa: SIM115 - closed on the next file or at the end
                elif isinstance(item, bytes):
                    f.write(item)
                elif item is _CLOSE:
                    f.close()
                else:
                    f.write(memoryview(item.numpy()))
        except BaseException as e:  # surfaced by the main thread
            failed.append(e)
            while work.get() is not None:
                pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    total = 0
    with torch.no_grad():
        for file, idx in zip(names, shards):
            work.put(os.path.join(path, file))
            work.put(_header(tensors, idx, elem, tag))
            for k in idx:
                name, shp, init = tensors[k]
                t = tensor_values(name, shp, init, seed, device).to(dtype)
                work.put(t.reshape(-1).view(torch.uint8).cpu())
                total += t.numel() * elem
            work.put(_CLOSE)
    work.put(None)
    thread.join()
    if failed:
        raise failed[0]
    index = {"metadata": {"total_size": total},
             "weight_map": {tensors[k][0]: f for f, idx in zip(names, shards) for k in idx}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return {"seconds": time.perf_counter() - t0, "bytes": total, "files": names}


_CLOSE = object()


def _write_streamed(path: str, shape: str, device: str | None, seed: int, max_shard_bytes: int,
                    disk_dtype: str = "bf16") -> dict[str, Any]:
    from transformers import GenerationConfig

    cfg_shape = STREAMED[shape] if isinstance(shape, str) else shape
    tok = build_filler_tokenizer(cfg_shape["vocab_size"])
    os.makedirs(path, exist_ok=True)
    stats = write_random_model(path, cfg_shape, device or "cpu", seed, max_shard_bytes, disk_dtype)
    config = _qwen2_config(cfg_shape, tok)
    config.architectures = ["Qwen3MoeForCausalLM" if cfg_shape.get("arch") == "qwen3_moe" else "Qwen2ForCausalLM"]
    config.initializer_range = INIT_STD
    config.dtype = "bfloat16"
    config.save_pretrained(path)
    GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                     bos_token_id=tok.bos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return stats


def make_bench_model(path: str, shape: str | dict, device: str | None = None, seed: int = 0,
                     max_shard_bytes: int = SHARD_BYTES, disk_dtype: str = "bf16") -> str:
    """Write a random-init model of `shape` (one of SHAPES, or a Qwen2 shape dict: streamed) and its
    tokenizer to `path`.

    The 0.5B model is initialised on `device` (default cpu; cuda is much faster) and saved in
    bf16; the tiny one is saved in fp32; the streamed shapes are drawn on `device` tensor by tensor
    and saved in bf16 shards (`disk_dtype` "fp8": float8 e4m3). Returns `path`. An existing complete
    directory is reused.
    """
    if not isinstance(shape, dict) and shape not in SHAPES:
        raise ValueError(f"--shape must be one of {SHAPES}, got {shape!r}")
    if os.path.exists(os.path.join(path, "config.json")) and os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    if isinstance(shape, dict) or shape in STREAMED:
        _write_streamed(path, shape, device, seed, max_shard_bytes, disk_dtype)
        return path
    from transformers import AutoModelForCausalLM

    if shape == "tiny":
        from rlhfkit.models.tiny import build_tokenizer

        tok, cfg_shape, dtype = build_tokenizer(), dict(TINY), torch.float32
        cfg_shape["vocab_size"] = len(tok)
    else:
        tok, cfg_shape, dtype = build_filler_tokenizer(QWEN2_05B["vocab_size"]), dict(QWEN2_05B), torch.bfloat16
    config = _qwen2_config(cfg_shape, tok)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tok, key))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    del model
    return path


def random_prompt(rng: Any, n_chars: int) -> str:
    """`n_chars` random lowercase letters and spaces (one token each with both tokenizers here)."""
    alphabet = string.ascii_lowercase + " "
    return "".join(alphabet[int(i)] for i in rng.integers(0, len(alphabet), size=n_chars))


def main() -> None:
    ap = argparse.ArgumentParser(description="write a random-init benchmark model directory")
    ap.add_argument("--shape", required=True, choices=SHAPES)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max_shard_gb", type=float, default=SHARD_BYTES / 1e9)
    a = ap.parse_args()
    t0 = time.perf_counter()
    if a.shape in STREAMED:
        stats = _write_streamed(a.out, a.shape, a.device, a.seed, int(a.max_shard_gb * 1e9))
    else:
        make_bench_model(a.out, a.shape, a.device, a.seed)
        stats = {}
    print(json.dumps({"bench": "bench_models", "shape": a.shape, "out": a.out, "device": a.device,
                      "seconds": round(time.perf_counter() - t0, 2), "bytes": stats.get("bytes"),
                      "files": len(stats.get("files", [])) or None}))


__all__ = ["SHAPES", "STREAMED", "QWEN2_05B", "QWEN25_7B", "QWEN25_32B", "TINY", "make_bench_model",
           "write_random_model", "qwen2_tensors", "tensor_values", "build_filler_tokenizer", "filler_vocab",
           "random_prompt"]

if __name__ == "__main__":
    main()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)"
