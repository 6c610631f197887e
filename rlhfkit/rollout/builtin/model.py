"""The builtin engine's forward passes: batched prefill and one decode step over a slot KV cache.

KV cache layout (per layer, one tensor each for K and V): `[num_slots, num_kv_heads, max_len, head_dim]`.
A running sequence owns one slot (row); its token at position p has its K/V at `[slot, :, p]`.

    prefill(tokens [b, P], lengths [b], slots [b])  -> logits of each prompt's last token [b, V]
        writes K/V of positions 0..P-1 into the rows `slots` (positions past a prompt's length hold
        padding and are overwritten by decode before they are ever read)
    decode(tokens [B], pos [B], kv_len=Lb)  -> logits [B, V]
        row i = slot i; writes K/V of `tokens` at `pos`; key j is visible iff j <= pos[i]

Decode attention, three implementations (`DecoderModel.attn`):
    "triton"  (GPU default) one fused kernel per layer (`triton_ops.decode_attention`): RoPE, K/V
              write, and attention over each row's own length read from `pos` on the device,
              so one CUDA graph per batch size serves every context length;
    "sdpa"    (CPU default) the G = num_heads / num_kv_heads query heads that share one KV head
              become G query rows of a single-head problem (`[B, KV, G, D]` against
              `[B, KV, Lb, D]`) under an additive 0 / -inf bias over the first `Lb` (length
              bucket) positions, so plain SDPA handles grouped-query attention (Ainslie et al.
              2023, arXiv 2305.13245) without repeating K/V;
    "matmul"  the same with two batched matmuls.
Decode projections, two implementations (`DecoderModel.gemm`):
    "torch"   F.linear (cuBLAS) for every projection;
    "triton"  (GPU default for batches of at least `gemm_min_rows`) the MLP as one fused
              gate/up + SiLU-mul kernel and a split-K down projection, and a split-K o projection
              (`triton_gemm`); the split-K partials `[S, B, H]` travel to the consumer (the next
              residual add + RMSNorm), which sums them inside its own kernel.
Tensor parallelism (`spec.tp.active`, a shard's spec: weights.py): column-parallel q/k/v and
gate/up need no communication; the o and down projections are row-parallel, each followed by one
all-reduce of its `[B, H]` output (`_row_parallel`, biases added after it); the lm_head is
vocab-parallel and its `[B, V / N]` logits are all-gathered, so every shard holds the same full
logits and the sampler (replicated, counter-based noise) draws the same tokens on every shard,
equal to the unsharded engine's up to the reduction order. Collectives are the functional ops
(`torch.ops._c10d_functional`, by process-group name): traced by torch.compile, captured in CUDA
graphs on NCCL, and plain gloo calls on CPU. The Triton split-K GEMMs are single-GPU only (their partials are
summed in the next kernel, before any all-reduce could see them).

All ops have static shapes for fixed (B, Lb), which is what lets the engine capture each decode
step as a CUDA graph. The math mirrors Hugging Face's Llama/Qwen2/Qwen3 modules op for op
(RMSNorm in fp32, then cast; Zhang & Sennrich 2019, arXiv 1910.07467).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers the _c10d_functional ops
import torch.nn.functional as F

from rlhfkit.rollout.builtin import triton_gemm, triton_ops  # triton_gemm registers the GEMM ops
from rlhfkit.rollout.builtin.weights import LayerWeights, ModelSpec, ModelWeights

_c10d = torch.ops._c10d_functional  # functional collectives: traceable, capturable, gloo on CPU


@dataclass
class KVCache:
    """One K and one V tensor per layer, each `[num_slots, num_kv_heads, max_len, head_dim]`.

    Separate tensors (not one stacked tensor) so that the decode step's in-place K/V write is a
    mutation of a whole graph input, which torch.compile performs in place; a write into a view
    of a stacked tensor would make it copy the layer's whole cache every step.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, spec: ModelSpec, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> "KVCache":
        shape = (num_slots, spec.num_kv_heads, max_len, spec.head_dim)

        def make() -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]

        return cls(make(), make())

    @staticmethod
    def bytes_needed(spec: ModelSpec, num_slots: int, max_len: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * spec.num_layers * num_slots * spec.num_kv_heads * max_len * spec.head_dim * elem

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """K/V of positions `< length` from slots `src` to slots `dst` (n-sample fan-out, compaction)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]


@torch.library.custom_op("rlhfkit::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """`k_cache[rows[i], :, pos[i]] = k[i]` (and v): one token per row into the slot cache.

    A custom op with declared mutations, so torch.compile writes into the cache in place instead
    of functionalising the scatter into a copy of the whole cache.
    """
    k_cache[rows, :, pos] = k
    v_cache[rows, :, pos] = v


@write_kv.register_fake
def _write_kv_fake(k_cache, v_cache, rows, pos, k, v) -> None:
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: normalise in fp32, cast back, scale."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + rotate_half(x) * sin, cos/sin broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _qkv(layer: LayerWeights, spec: ModelSpec, h: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_project_qkv` with RoPE applied to q and k."""
    q, k, v = _project_qkv(layer, spec, h)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _project_qkv(layer: LayerWeights, spec: ModelSpec, h: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projections of normalised hidden states `h [..., H]` -> q `[..., Hq, D]`, k, v `[..., KV, D]`
    (q/k norms applied, no RoPE)."""
    qkv = F.linear(h, layer.qkv, layer.qkv_bias)
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    q = q.unflatten(-1, (spec.num_heads, spec.head_dim))
    k = k.unflatten(-1, (spec.num_kv_heads, spec.head_dim))
    v = v.unflatten(-1, (spec.num_kv_heads, spec.head_dim))
    if layer.q_norm is not None:
        q = rms_norm(q, layer.q_norm, spec.rms_norm_eps)
        k = rms_norm(k, layer.k_norm, spec.rms_norm_eps)
    return q, k, v


def _row_parallel(spec: ModelSpec, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` of a row-parallel projection: each shard's partial product is
    summed over the tensor-parallel group, then the (replicated) bias is added once."""
    if not spec.tp.active:
        return F.linear(x, weight, bias)
    out = _c10d.wait_tensor(_c10d.all_reduce(F.linear(x, weight), "sum", spec.tp.group))
    return out if bias is None else out + bias


def _gather_vocab(spec: ModelSpec, logits: torch.Tensor) -> torch.Tensor:
    """A shard's `[B, V / N]` logits -> the full `[B, V]` on every shard (padding rows cut)."""
    if not spec.tp.active:
        return logits
    n, (rows, cols) = spec.tp.size, logits.shape
    full = _c10d.wait_tensor(_c10d.all_gather_into_tensor(logits.contiguous(), n, spec.tp.group))  # [n * rows, cols]
    return full.view(n, rows, cols).permute(1, 0, 2).reshape(rows, n * cols)[:, :spec.vocab_size]


def _mlp_block(layer: LayerWeights, spec: ModelSpec, x: torch.Tensor) -> torch.Tensor:
    return x + _mlp(layer, spec, rms_norm(x, layer.post_norm, spec.rms_norm_eps))


def _mlp(layer: LayerWeights, spec: ModelSpec, h: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
    return _row_parallel(spec, F.silu(gate) * up, layer.down, layer.down_bias)


def _residual(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """x + delta, where delta is a layer output `[B, H]` or split-K partials `[S, B, H]` (fp32),
    summed and rounded to x's dtype first (as a GEMM's output is) so both paths round alike."""
    if delta.dim() == x.dim() + 1:
        delta = delta.sum(0).to(x.dtype)
    return x + delta


def triton_gemm_supported(spec: ModelSpec, weights: ModelWeights) -> bool:
    """Whether the Triton decode GEMMs apply: no o / MLP biases and K dims they tile."""
    if not triton_gemm.available() or spec.tp.active:
        return False
    if any(lw.o_bias is not None or lw.gate_up_bias is not None or lw.down_bias is not None
           for lw in weights.layers):
        return False
    inter = weights.layers[0].down.shape[1]
    return (triton_gemm.supported(spec.hidden_size, spec.q_size) and triton_gemm.supported(spec.hidden_size, inter)
            and spec.hidden_size % 64 == 0)


def _torch_decode_attention(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, bias: torch.Tensor, scale: float, use_sdpa: bool) -> torch.Tensor:
    """RoPE, K/V write and attention over the first `kv_len = bias.shape[-1]` positions -> `[B, Hq, D]`."""
    nrows, kv_len = q.shape[0], bias.shape[-1]
    cos_p, sin_p = cos[pos][:, None, :], sin[pos][:, None, :]  # [B, 1, D]
    q, k = apply_rope(q, cos_p, sin_p), apply_rope(k, cos_p, sin_p)
    write_kv(k_cache, v_cache, torch.arange(nrows, device=q.device), pos, k, v)
    keys, values = k_cache[:nrows, :, :kv_len], v_cache[:nrows, :, :kv_len]  # [B, KV, Lb, D]
    qg = q.reshape(nrows, spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim)
    if use_sdpa:
        return F.scaled_dot_product_attention(qg, keys, values, attn_mask=bias, scale=scale)
    # explicit: scores in the model dtype, softmax in fp32 (as HF's eager attention)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale + bias.float()
    return torch.matmul(torch.softmax(scores, dim=-1).to(qg.dtype), values)


def decode_layer(spec: ModelSpec, layer: LayerWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 x: torch.Tensor, delta: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 bias: torch.Tensor | None, scale: float, attn: str = "sdpa", gemm: str = "torch"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer for one token per row; the residual stream enters as `x + delta`.

    Returns `(x', delta')` with the layer's output `x' + delta'` (delta' = the MLP's output): the
    add is left to the next layer (or the head), where torch.compile fuses it with the RMSNorm
    that follows it, one kernel fewer per layer. K/V of the new token go to `[row, :, pos[row]]`.
    The same function serves every layer (only the tensors differ), so a torch.compile'd version
    is compiled once, not once per layer. `cos`/`sin` are the full rope tables `[L, D]`.

    attn: "triton" (fused RoPE + K/V write + attention kernel over each row's own length; `bias`
    unused), "sdpa" or "matmul" (attend over the first `Lb` positions under `bias [B, 1, 1, Lb]`,
    0 where a key is visible and -inf elsewhere, built once per step).
    gemm: "torch" (delta' is `[B, H]`) or "triton" (delta' is the down projection's split-K
    partials `[S, B, H]` fp32; `delta` may be either; partials are summed by the Triton
    residual-add + RMSNorm kernel, `triton_gemm.residual_rmsnorm`, as the o projection's are).
    """
    nrows = x.shape[0]
    if gemm == "triton" and delta.dim() == 3:  # the residual add + RMSNorm kernel sums the partials
        x, h = torch.ops.rlhfkit.residual_rmsnorm(x, delta, layer.input_norm, spec.rms_norm_eps)
    else:
        x = _residual(x, delta)
        h = rms_norm(x, layer.input_norm, spec.rms_norm_eps)
    q, k, v = _project_qkv(layer, spec, h)
    if attn == "triton":
        out = torch.ops.rlhfkit.decode_attention(q, k, v, k_cache, v_cache, cos, sin, pos, scale)
    else:
        out = _torch_decode_attention(spec, q, k, v, k_cache, v_cache, pos, cos, sin, bias, scale, attn == "sdpa")
    if gemm == "triton":
        o = torch.ops.rlhfkit.mm_partials(out.reshape(nrows, spec.q_size), layer.o)
        x, h = torch.ops.rlhfkit.residual_rmsnorm(x, o, layer.post_norm, spec.rms_norm_eps)
        return x, torch.ops.rlhfkit.mm_partials(torch.ops.rlhfkit.gate_up_silu(h, layer.gate_up), layer.down)
    # the residual add in fp32 (as bf16 + bf16 rounds anyway) keeps inductor from folding it into
    # an addmm, which would first copy x into the GEMM's output buffer
    x = (x.float() + _row_parallel(spec, out.reshape(nrows, spec.q_size), layer.o, layer.o_bias).float()).to(x.dtype)
    return x, _mlp(layer, spec, rms_norm(x, layer.post_norm, spec.rms_norm_eps))


def prefill_layer(spec: ModelSpec, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  scale: float, last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer over right-padded prompts `x [b, P, H]` (causal); returns the layer's
    output and the post-RoPE keys and values `[b, KV, P, D]` for the cache.

    With `last [b]` (each prompt's last position; used for the final layer) only those positions
    go on past the K/V projection: the output is `[b, H]`, the hidden state the logits need, and
    the attention, o projection and MLP of every other position are skipped."""
    q, k, v = _qkv(layer, spec, rms_norm(x, layer.input_norm, spec.rms_norm_eps), cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, P, D]
    gqa = spec.num_heads != spec.num_kv_heads
    if last is None:
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        x = x + _row_parallel(spec, attn.transpose(1, 2).flatten(2), layer.o, layer.o_bias)
        return _mlp_block(layer, spec, x), k, v
    rows = torch.arange(x.shape[0], device=x.device)
    q_last = q[rows, :, last].unsqueeze(2)  # [b, Hq, 1, D]
    visible = torch.arange(x.shape[1], device=x.device)[None, :] <= last[:, None]  # [b, P]
    attn = F.scaled_dot_product_attention(q_last, k, v, attn_mask=visible[:, None, None, :], scale=scale,
                                          enable_gqa=gqa)
    x = x[rows, last] + _row_parallel(spec, attn.flatten(1), layer.o, layer.o_bias)
    return _mlp_block(layer, spec, x), k, v


def final_logits(spec: ModelSpec, final_norm: torch.Tensor, lm_head: torch.Tensor, x: torch.Tensor,
                 delta: torch.Tensor | None = None) -> torch.Tensor:
    if delta is not None and delta.dim() == 3 and delta.is_cuda and triton_gemm.available():
        _, h = torch.ops.rlhfkit.residual_rmsnorm(x, delta, final_norm, spec.rms_norm_eps)  # split-K partials
        return F.linear(h, lm_head)
    if delta is not None:
        x = _residual(x, delta)
    return _gather_vocab(spec, F.linear(rms_norm(x, final_norm, spec.rms_norm_eps), lm_head))


DECODE_ATTENTION = ("triton", "sdpa", "matmul")
DECODE_GEMM = ("triton", "torch")


def resolve_decode_attention(choice: str, spec, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when Triton is installed and the head shape fits the kernel, else 'sdpa'."""
    if choice != "auto":
        if choice == "triton" and not (device.type == "cuda" and triton_ops.available()):
            raise ValueError("decode_attention='triton' needs a CUDA device and the triton package")
        if choice == "triton" and not triton_ops.attention_supported(spec.num_heads, spec.num_kv_heads,
                                                                      spec.head_dim):
            raise ValueError(f"decode_attention='triton' does not support head_dim={spec.head_dim} with "
                             f"{spec.num_heads} / {spec.num_kv_heads} heads; use 'sdpa'")
        return choice
    fits = triton_ops.attention_supported(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    return "triton" if device.type == "cuda" and triton_ops.available() and fits else "sdpa"


def resolve_decode_gemm(choice: str, spec, weights, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when the Triton GEMMs apply to the model, else 'torch'."""
    fits = device.type == "cuda" and triton_gemm_supported(spec, weights)
    if choice == "triton" and not fits:
        raise ValueError("decode_gemm='triton' needs a CUDA device, the triton package, one GPU (no tensor "
                         "parallelism) and a model without o / MLP biases whose hidden size is a multiple of 64")
    return "triton" if choice == "triton" or (choice == "auto" and fits) else "torch"


class DecoderModel:
    """Functional decoder over `ModelWeights`; holds the rope tables and the model constants.

    `layer_fn` / `head_fn` / `prefill_fn` default to the eager functions above; the decode runner
    replaces them with compiled versions. `attn` is the decode attention ("triton" needs CUDA).
    """

    def __init__(self, spec: ModelSpec, weights: ModelWeights, cos: torch.Tensor, sin: torch.Tensor,
                 decode_attention: str = "sdpa", decode_gemm: str = "torch", gemm_min_rows: int = 1):
        if decode_gemm not in DECODE_GEMM:
            raise ValueError(f"decode_gemm must be one of {DECODE_GEMM}, got {decode_gemm!r}")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
        if decode_attention == "triton" and not cos.is_cuda:
            raise ValueError("decode_attention='triton' needs a CUDA device")
        self.spec, self.weights, self.cos, self.sin = spec, weights, cos, sin
        self.attn = decode_attention
        self.gemm, self.gemm_min_rows = decode_gemm, gemm_min_rows
        self.scale = spec.head_dim ** -0.5
        self.layer_fn: Callable = decode_layer
        self.head_fn: Callable = final_logits
        self.prefill_fn: Callable = prefill_layer

    @property
    def uses_kv_len(self) -> bool:
        """Whether a decode step depends on the KV length bucket (the triton kernel reads `pos`)."""
        return self.attn != "triton"

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return final_logits(self.spec, self.weights.final_norm, self.weights.lm_head, x)

    def prefill(self, cache: KVCache, tokens: torch.Tensor, lengths: torch.Tensor,
                slots: torch.Tensor, slot_slice: slice | None = None, mm: Any = None) -> torch.Tensor:
        """Right-padded prompts `tokens [b, P]`; returns the last real position's logits `[b, V]`.

        `slot_slice`: the caller's word that `slots` are the rows of this slice (evenly spaced), so the
        K/V go to the cache as one strided copy per layer instead of an indexed scatter. `mm` (a
        vision.PrefillInputs, a VLM's batch with pictures): the embeddings with the pictures spliced
        in and per-row rotary tables replace the token embeddings and the 1-D tables; its deepstack
        features are added at the picture positions after the first layers."""
        spec, w = self.spec, self.weights
        b, plen = tokens.shape
        if mm is None:
            cos, sin = self.cos[:plen, None, :], self.sin[:plen, None, :]  # [P, 1, D]
            x = F.embedding(tokens, w.embed)
        else:
            cos, sin, x = mm.cos, mm.sin, mm.embeds  # [b, P, 1, D], [b, P, H]
            if len(mm.deepstack) >= len(w.layers):
                raise ValueError(f"{len(mm.deepstack)} deepstack layers need a deeper model than {len(w.layers)} layers")
        last = lengths - 1
        rows = slots if slot_slice is None else slot_slice
        for li, layer in enumerate(w.layers):
            x, k, v = self.prefill_fn(spec, layer, x, cos, sin, self.scale,
                                      last if li == len(w.layers) - 1 else None)
            if mm is not None and li < len(mm.deepstack):
                x = x.index_put((mm.rows, mm.cols), mm.deepstack[li], accumulate=True)
            cache.k[li][rows, :, :plen] = k
            cache.v[li][rows, :, :plen] = v
        return self._logits(x)

    def decode(self, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One token for each of the rows 0..B-1 (row = slot); returns logits `[B, V]` (model dtype).

        `kv_len` (the length bucket) matters only when `uses_kv_len`."""
        w = self.weights
        bias = None
        if self.uses_kv_len:
            hidden = torch.arange(kv_len, device=tokens.device)[None, :] > pos[:, None]  # [B, Lb]
            bias = torch.zeros(hidden.shape, dtype=self.cos.dtype, device=tokens.device)
            bias = bias.masked_fill(hidden, float("-inf"))[:, None, None, :]
        x = F.embedding(tokens, w.embed)
        gemm = self.gemm if tokens.shape[0] >= self.gemm_min_rows else "torch"
        if gemm == "triton":  # partials of the shape every layer returns: one compiled graph for all layers
            splits = triton_gemm.splits_for(self.spec.hidden_size, w.layers[0].down.shape[1])
            delta = torch.zeros((splits,) + x.shape, dtype=torch.float32, device=x.device)
        else:
            delta = torch.zeros_like(x)
        for li, layer in enumerate(w.layers):
            x, delta = self.layer_fn(self.spec, layer, cache.k[li], cache.v[li], x, delta, pos, self.cos, self.sin,
                                     bias, self.scale, self.attn, gemm)
        return self.head_fn(self.spec, w.final_norm, w.lm_head, x, delta)
