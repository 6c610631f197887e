"""The builtin engine's forward passes: batched prefill and one decode step over a slot KV cache.

KV cache layout (per layer, one tensor each for K and V): `[num_slots, num_kv_heads, max_len, head_dim]`.
A running sequence owns one slot (row); its token at position p has its K/V at `[slot, :, p]`.

    prefill(tokens [b, P], lengths [b], slots [b])  -> logits of each prompt's last token [b, V]
        writes K/V of positions 0..P-1 into the rows `slots` (positions past a prompt's length hold
        padding and are overwritten by decode before they are ever read)
    decode(tokens [B], pos [B], kv_len=Lb)  -> logits [B, V]
        row i = slot i; writes K/V of `tokens` at `pos`; key j is visible iff j <= pos[i]

Decode attention, three implementations (`DecoderModel.attn`):
    "triton"  (GPU default) one fused kernel per layer (`triton_attention.decode_attention`): RoPE, K/V
              write, and attention over each row's own length read from `pos` on the device,
              so one CUDA graph per batch size serves every context length;
    "sdpa"    (CPU default) the G = num_heads / num_kv_heads query heads that share one KV head
              become G query rows of a single-head problem (`[B, KV, G, D]` against
              `[B, KV, Lb, D]`) under an additive 0 / -inf bias over the first `Lb` (length
              bucket) positions, so plain SDPA handles grouped-query attention (GQA)
              without repeating K/V;
    "matmul"  the same with two batched matmuls.
Decode projections, two implementations (`DecoderModel.gemm`):
    "torch"   F.linear (cuBLAS) for every projection;
    "triton"  (GPU default for batches of at least `gemm_min_rows`) the MLP as one fused
              gate/up + SiLU-mul kernel and a split-K down projection, and a split-K o projection
              (`triton_gemm`); the split-K partials `[S, B, H]` travel to the consumer (the next
              residual add + RMSNorm), which sums them inside its own kernel.
Tensor parallelism (`spec.tp.active`, a shard's spec: model/spec.py): column-parallel q/k/v and
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
(RMSNorm in fp32, then cast).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed._functional_collectives  # noqa: F401 - registers the _c10d_functional ops
import torch.nn.functional as F

from rlhfkit.rollout.builtin.kernels import triton_attention, triton_gemm, triton_launch, triton_norm  # triton_gemm registers the GEMM ops
from rlhfkit.rollout.builtin.model.experts import routed
from rlhfkit.rollout.builtin.model.quantized import dequantize_layer
from rlhfkit.rollout.builtin.model.spec import ModelSpec
from rlhfkit.rollout.builtin.model.weights import LayerWeights, ModelWeights

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "llama") -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: normalise in fp32, then scale in one of the families'
    three roundings (model/families.py): "llama" casts back and scales, "fp32" scales in fp32 and casts,
    "gemma" scales by (1 + weight) in fp32 and casts."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if style == "llama":
        return weight * xf.to(dtype)
    w = weight.float() + 1.0 if style == "gemma" else weight.float()
    return (w * xf).to(dtype)


def _norm(spec: ModelSpec, weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The family's RMSNorm of `x` by `weight`; `x` itself where the family has no such norm. On a GPU
    outside compiled regions one Triton kernel (kernels/triton_norm.py) instead of six or more eager ones."""
    if weight is None:
        return x
    if triton_norm.applies(x, weight, spec.family.norm) and not torch.compiler.is_compiling():
        return torch.ops.rlhfkit.rms_norm(x, weight, spec.rms_norm_eps, triton_norm.STYLES[spec.family.norm])
    return rms_norm(x, weight, spec.rms_norm_eps, spec.family.norm)


def _add_norm(spec: ModelSpec, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + delta, _norm(x + delta))`, the sum rounded to x's dtype; one kernel where `_norm` is one."""
    if (weight is not None and delta.shape == x.shape and delta.dtype == x.dtype
            and triton_norm.applies(x, weight, spec.family.norm) and delta.stride(-1) == 1
            and not torch.compiler.is_compiling()):
        return torch.ops.rlhfkit.add_rms_norm(x, delta, weight, spec.rms_norm_eps,
                                              triton_norm.STYLES[spec.family.norm])
    x = x + delta
    return x, _norm(spec, weight, x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int | None = None) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + rotate_half(x) * sin, cos/sin broadcast over heads. With a
    partial rotary dimension `rot` only x[..., :rot] rotates (the tables hold cos 1, sin 0 past it)."""
    if rot is None:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    else:
        half = rot // 2
        rotated = torch.cat((-x[..., half:rot], x[..., :half], torch.zeros_like(x[..., rot:])), dim=-1)
    return x * cos + rotated * sin


def _qkv(layer: LayerWeights, spec: ModelSpec, h: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_project_qkv` with RoPE applied to q and k."""
    q, k, v = _project_qkv(layer, spec, h)
    return apply_rope(q, cos, sin, spec.rotary_dim), apply_rope(k, cos, sin, spec.rotary_dim), v


def _project_qkv(layer: LayerWeights, spec: ModelSpec, h: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projections of normalised hidden states `h [..., H]` -> q `[..., Hq, D]`, k, v `[..., KV, D]`
    (q/k norms applied: over the whole projection (OLMo) or over each head; no RoPE)."""
    qkv = _lora(layer, "qkv", h, F.linear(h, layer.qkv, layer.qkv_bias))
    q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    if spec.family.qk_norm == "full":
        q, k = _norm(spec, layer.q_norm, q), _norm(spec, layer.k_norm, k)
    q = q.unflatten(-1, (spec.num_heads, spec.head_dim))
    k = k.unflatten(-1, (spec.num_kv_heads, spec.head_dim))
    v = v.unflatten(-1, (spec.num_kv_heads, spec.head_dim))
    if spec.family.qk_norm == "head":
        q, k = _norm(spec, layer.q_norm, q), _norm(spec, layer.k_norm, k)
    return q, k, v


def _lora(layer: LayerWeights, attr: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`y` (the output of engine tensor `attr` for input `x`) with the layer's unmerged LoRA adapters on it
    added in place (weights.LoraPack: two GEMMs whatever the number of adapters on the tensor)."""
    pack = layer.lora.get(attr)
    return y if pack is None else pack.apply(x, y)


def _o_proj(layer: LayerWeights, spec: ModelSpec, x: torch.Tensor) -> torch.Tensor:
    """The attention output projection (row-parallel; engines that serve LoRA adapters are unsharded)."""
    return _lora(layer, "o", x, _row_parallel(spec, x, layer.o, layer.o_bias))


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


def _gate(spec: ModelSpec, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) if spec.activation == "silu" else F.gelu(x, approximate="tanh")


def _mlp(layer: LayerWeights, spec: ModelSpec, h: torch.Tensor) -> torch.Tensor:
    gate_up, down = layer.gate_up, layer.down
    assert gate_up is not None and down is not None, "a dense MLP layer"
    gate, up = _lora(layer, "gate_up", h, F.linear(h, gate_up, layer.gate_up_bias)).chunk(2, dim=-1)
    act = _gate(spec, gate) * up
    return _lora(layer, "down", act, _row_parallel(spec, act, down, layer.down_bias))


def _ffn(layer: LayerWeights, spec: ModelSpec, x: torch.Tensor) -> torch.Tensor:
    """The MLP half of a layer from the residual stream `x`: [norm] -> MLP or experts -> [out norm]."""
    return _ffn_normed(layer, spec, _norm(spec, layer.mlp_norm, x))


def _ffn_normed(layer: LayerWeights, spec: ModelSpec, h: torch.Tensor) -> torch.Tensor:
    """`_ffn` from the already normalised `h`."""
    out = routed(layer, spec, h) if layer.kind.moe else _mlp(layer, spec, h)
    return _norm(spec, layer.mlp_out_norm, out)


def _mlp_block(layer: LayerWeights, spec: ModelSpec, x: torch.Tensor) -> torch.Tensor:
    return x + _ffn(layer, spec, x)


def _residual(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """x + delta, where delta is a layer output `[B, H]` or split-K partials `[S, B, H]` (fp32),
    summed and rounded to x's dtype first (as a GEMM's output is) so both paths round alike."""
    if delta.dim() == x.dim() + 1:
        delta = delta.sum(0).to(x.dtype)
    return x + delta


def triton_gemm_supported(spec: ModelSpec, weights: ModelWeights) -> bool:
    """Whether the Triton decode GEMMs apply: a Llama-style block (pre-norms with Llama's rounding,
    SiLU, dense MLPs), no o / MLP biases or LoRA adapters, and K dims they tile."""
    if not triton_gemm.available() or spec.tp.active:
        return False
    fam = spec.family
    if (fam.norm != "llama" or not fam.pre_norms or fam.post_norms or spec.activation != "silu"
            or spec.moe is not None):
        return False
    if any(lw.o_bias is not None or lw.gate_up_bias is not None or lw.down_bias is not None or lw.lora
           for lw in weights.layers):
        return False
    down = weights.layers[0].down
    if down is None:
        return False
    inter = down.shape[1]
    return (triton_gemm.supported(spec.hidden_size, spec.q_size) and triton_gemm.supported(spec.hidden_size, inter)
            and spec.hidden_size % 64 == 0)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
            scale: float, sinks: torch.Tensor | None, use_sdpa: bool = True) -> torch.Tensor:
    """Grouped-query attention of `q [b, Hq, Lq, D]` over `keys/values [b, KV, Lk, D]`; `visible`
    (bool, broadcast to `[b, 1, Lq, Lk]`) or an additive float mask; `sinks [Hq]`: one extra logit
    per head in every softmax's denominator (gpt-oss). Explicit path: scores in the model dtype,
    softmax in fp32 (as Hugging Face's eager attention)."""
    b, hq, lq, d = q.shape
    kv = keys.shape[1]
    if sinks is None and use_sdpa:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,
                                              enable_gqa=hq != kv)
    qg = q.reshape(b, kv, hq // kv, lq, d)
    scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)).float() * scale  # [b, KV, G, Lq, Lk]
    if visible is not None:
        mask = visible.unsqueeze(1) if visible.dim() == 4 else visible  # [b, 1, 1, Lq, Lk]: over KV and G
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if sinks is not None:
        sink = sinks.float().reshape(1, kv, hq // kv, 1, 1).expand(b, kv, hq // kv, lq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(q.dtype), values.unsqueeze(2)).reshape(b, hq, lq, d)


def _torch_decode_attention(spec: ModelSpec, layer: LayerWeights, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor, scale: float,
                            use_sdpa: bool) -> torch.Tensor:
    """RoPE, K/V write and attention over the first `kv_len = bias.shape[-1]` positions -> `[B, Hq, D]`."""
    nrows, kv_len = q.shape[0], bias.shape[-1]
    cos_p, sin_p = cos[pos][:, None, :], sin[pos][:, None, :]  # [B, 1, D]
    q, k = apply_rope(q, cos_p, sin_p, spec.rotary_dim), apply_rope(k, cos_p, sin_p, spec.rotary_dim)
    write_kv(k_cache, v_cache, torch.arange(nrows, device=q.device), pos, k, v)
    keys, values = k_cache[:nrows, :, :kv_len], v_cache[:nrows, :, :kv_len]  # [B, KV, Lb, D]
    if layer.sinks is None and use_sdpa:
        qg = q.reshape(nrows, spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim)
        return F.scaled_dot_product_attention(qg, keys, values, attn_mask=bias, scale=scale)
    out = _attend(q.unsqueeze(2), keys, values, bias, scale, layer.sinks, use_sdpa=False)  # q [B, Hq, 1, D]
    return out.squeeze(2)


def decode_layer(spec: ModelSpec, layer: LayerWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 x: torch.Tensor, delta: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 bias: torch.Tensor | None, scale: float, attn: str = "sdpa", gemm: str = "torch"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer for one token per row; the residual stream enters as `x + delta`.

    Returns `(x', delta')` with the layer's output `x' + delta'` (delta' = the MLP half's output):
    the add is left to the next layer (or the head), where torch.compile fuses it with the RMSNorm
    that follows it, one kernel fewer per layer. K/V of the new token go to `[row, :, pos[row]]`.
    The same function serves every layer (only the tensors and the layer's `kind` differ), so a
    torch.compile'd version is compiled once per kind of layer, not once per layer. `cos`/`sin`
    are the layer's full rope tables `[L, D]`.

    attn: "triton" (fused RoPE + K/V write + attention kernel over each row's own length and
    window; `bias` unused), "sdpa" or "matmul" (attend over the first `Lb` positions under `bias
    [B, 1, 1, Lb]`, 0 where a key is visible (in the layer's window) and -inf elsewhere, built once
    per step and window). Attention sinks take the explicit (matmul) path.
    gemm: "torch" (delta' is `[B, H]`) or "triton" (delta' is the down projection's split-K
    partials `[S, B, H]` fp32; `delta` may be either; partials are summed by the Triton
    residual-add + RMSNorm kernel, `triton_gemm.residual_rmsnorm`, as the o projection's are).
    """
    nrows = x.shape[0]
    if layer.quant:
        dequantize_layer(layer)
    if gemm == "triton" and delta.dim() == 3:  # the residual add + RMSNorm kernel sums the partials
        x, h = torch.ops.rlhfkit.residual_rmsnorm(x, delta, layer.input_norm, spec.rms_norm_eps)
    elif delta.dim() == x.dim() + 1:
        x = _residual(x, delta)
        h = _norm(spec, layer.input_norm, x)
    else:
        x, h = _add_norm(spec, x, delta, layer.input_norm)
    q, k, v = _project_qkv(layer, spec, h)
    if attn == "triton":
        out = torch.ops.rlhfkit.decode_attention(q, k, v, k_cache, v_cache, cos, sin, pos, scale,
                                                 layer.kind.window or 0, layer.sinks, spec.rotary_dim or 0)
    else:
        assert bias is not None  # sdpa / matmul attention: the step's mask, built once per window
        out = _torch_decode_attention(spec, layer, q, k, v, k_cache, v_cache, pos, cos, sin, bias, scale,
                                      attn == "sdpa")
    if gemm == "triton":
        o = torch.ops.rlhfkit.mm_partials(out.reshape(nrows, spec.q_size), layer.o)
        x, h = torch.ops.rlhfkit.residual_rmsnorm(x, o, layer.mlp_norm, spec.rms_norm_eps)
        return x, torch.ops.rlhfkit.mm_partials(torch.ops.rlhfkit.gate_up_silu(h, layer.gate_up), layer.down)
    a = _norm(spec, layer.attn_out_norm, _o_proj(layer, spec, out.reshape(nrows, spec.q_size)))
    if torch.compiler.is_compiling():
        # the residual add in fp32 (as bf16 + bf16 rounds anyway) keeps inductor from folding it into
        # an addmm, which would first copy x into the GEMM's output buffer
        x = (x.float() + a.float()).to(x.dtype)
        return x, _ffn(layer, spec, x)
    x, h = _add_norm(spec, x, a, layer.mlp_norm)
    return x, _ffn_normed(layer, spec, h)


def _window_visible(window: int | None, plen: int, device: torch.device) -> torch.Tensor | None:
    """Causal visibility `[P, P]` within a window (None: no window, plain causal attention)."""
    if window is None:
        return None
    i = torch.arange(plen, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)


def prefill_layer(spec: ModelSpec, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  scale: float, last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer over right-padded prompts `x [b, P, H]` (causal, within the layer's
    window); returns the layer's output and the post-RoPE keys and values `[b, KV, P, D]` for the cache.

    With `last [b]` (each prompt's last position; used for the final layer) only those positions
    go on past the K/V projection: the output is `[b, H]`, the hidden state the logits need, and
    the attention, o projection and MLP of every other position are skipped."""
    if layer.quant:
        dequantize_layer(layer)
    q, k, v = _qkv(layer, spec, _norm(spec, layer.input_norm, x), cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, P, D]
    window, plen = layer.kind.window, x.shape[1]
    if last is None:
        visible = _window_visible(window, plen, x.device)
        if visible is None and layer.sinks is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=spec.num_heads != spec.num_kv_heads)
        else:
            if visible is None:
                visible = _window_visible(plen, plen, x.device)  # plain causal
            attn = _attend(q, k, v, visible, scale, layer.sinks)
        a = _norm(spec, layer.attn_out_norm, _o_proj(layer, spec, attn.transpose(1, 2).flatten(2)))
        return _mlp_block(layer, spec, x + a), k, v
    rows = torch.arange(x.shape[0], device=x.device)
    q_last = q[rows, :, last].unsqueeze(2)  # [b, Hq, 1, D]
    j = torch.arange(plen, device=x.device)[None, :]
    visible = j <= last[:, None]  # [b, P]
    if window is not None:
        visible = visible & (j > last[:, None] - window)
    attn = _attend(q_last, k, v, visible[:, None, None, :], scale, layer.sinks)
    a = _norm(spec, layer.attn_out_norm, _o_proj(layer, spec, attn.flatten(1)))
    return _mlp_block(layer, spec, x[rows, last] + a), k, v


def final_logits(spec: ModelSpec, final_norm: torch.Tensor, lm_head: torch.Tensor, x: torch.Tensor,
                 delta: torch.Tensor | None = None) -> torch.Tensor:
    if delta is not None and delta.dim() == 3 and delta.is_cuda and triton_gemm.available():
        _, h = torch.ops.rlhfkit.residual_rmsnorm(x, delta, final_norm, spec.rms_norm_eps)  # split-K partials
        return F.linear(h, lm_head)
    if delta is None:
        h = _norm(spec, final_norm, x)
    elif delta.dim() == x.dim() + 1:
        h = _norm(spec, final_norm, _residual(x, delta))
    else:
        h = _add_norm(spec, x, delta, final_norm)[1]
    logits = _gather_vocab(spec, F.linear(h, lm_head))
    if spec.final_softcap:
        logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
    return logits


DECODE_ATTENTION = ("triton", "sdpa", "matmul")
DECODE_GEMM = ("triton", "torch")


def resolve_decode_attention(choice: str, spec, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when Triton is installed and the head shape fits the kernel, else 'sdpa'."""
    if choice != "auto":
        if choice == "triton" and not (device.type == "cuda" and triton_launch.available()):
            raise ValueError("decode_attention='triton' needs a CUDA device and the triton package")
        if choice == "triton" and not triton_attention.attention_supported(spec.num_heads, spec.num_kv_heads,
                                                                      spec.head_dim):
            raise ValueError(f"decode_attention='triton' does not support head_dim={spec.head_dim} with "
                             f"{spec.num_heads} / {spec.num_kv_heads} heads; use 'sdpa'")
        return choice
    fits = triton_attention.attention_supported(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    return "triton" if device.type == "cuda" and triton_launch.available() and fits else "sdpa"


def resolve_decode_gemm(choice: str, spec, weights, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when the Triton GEMMs apply to the model, else 'torch'."""
    fits = device.type == "cuda" and triton_gemm_supported(spec, weights)
    if choice == "triton" and not fits:
        raise ValueError("decode_gemm='triton' needs a CUDA device, the triton package, one GPU (no tensor "
                         "parallelism) and a model without o / MLP biases whose hidden size is a multiple of 64")
    return "triton" if choice == "triton" or (choice == "auto" and fits) else "torch"


class DecoderModel:
    """Functional decoder over `ModelWeights`; holds the rope tables and the model constants.

    `tables` holds one (cos, sin) pair per rope table of the spec's layer kinds (`cos`, `sin` are
    the first). `layer_fn` / `head_fn` / `prefill_fn` default to the eager functions above; the
    decode runner replaces them with compiled versions. `attn` is the decode attention ("triton"
    needs CUDA).
    """

    def __init__(self, spec: ModelSpec, weights: ModelWeights, cos: torch.Tensor, sin: torch.Tensor,
                 decode_attention: str = "sdpa", decode_gemm: str = "torch", gemm_min_rows: int = 1,
                 tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        if decode_gemm not in DECODE_GEMM:
            raise ValueError(f"decode_gemm must be one of {DECODE_GEMM}, got {decode_gemm!r}")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
        if decode_attention == "triton" and not cos.is_cuda:
            raise ValueError("decode_attention='triton' needs a CUDA device")
        self.spec, self.weights = spec, weights
        self.tables = list(tables) if tables is not None else [(cos, sin)]
        if len(self.tables) < spec.num_rope_tables:
            raise ValueError(f"{spec.model_type}: {spec.num_rope_tables} rope tables needed, {len(self.tables)} given")
        self.attn = decode_attention
        self.gemm, self.gemm_min_rows = decode_gemm, gemm_min_rows
        self.scale = spec.scale
        self.layer_fn: Callable = decode_layer
        self.head_fn: Callable = final_logits
        self.prefill_fn: Callable = prefill_layer
        self._embed_scale: torch.Tensor | None = None

    @property
    def cos(self) -> torch.Tensor:
        return self.tables[0][0]

    @property
    def sin(self) -> torch.Tensor:
        return self.tables[0][1]

    def move_tables(self, device: torch.device) -> None:
        self.tables = [(c.to(device), s.to(device)) for c, s in self.tables]

    @property
    def uses_kv_len(self) -> bool:
        """Whether a decode step depends on the KV length bucket (the triton kernel reads `pos`)."""
        return self.attn != "triton"

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return final_logits(self.spec, self.weights.final_norm, self.weights.lm_head, x)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings (Gemma: times sqrt(hidden), the factor rounded to the model dtype first;
        a device tensor made once, so that a captured decode step copies nothing from the host)."""
        x = F.embedding(tokens, self.weights.embed)
        if self.spec.embed_scale is None:
            return x
        scale = self._embed_scale
        if scale is None or scale.device != x.device or scale.dtype != x.dtype:
            scale = self._embed_scale = torch.tensor(self.spec.embed_scale, dtype=x.dtype, device=x.device)
        return x * scale

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
            tables = [(c[:plen, None, :], s[:plen, None, :]) for c, s in self.tables]  # [P, 1, D]
            x = self.embed(tokens)
        else:
            tables, x = [(mm.cos, mm.sin)], mm.embeds  # [b, P, 1, D], [b, P, H]
            if len(mm.deepstack) >= len(w.layers):
                raise ValueError(f"{len(mm.deepstack)} deepstack layers need a deeper model than {len(w.layers)} layers")
        last = lengths - 1
        rows = slots if slot_slice is None else slot_slice
        for li, layer in enumerate(w.layers):
            cos, sin = tables[layer.kind.rope]
            x, k, v = self.prefill_fn(spec, layer, x, cos, sin, self.scale,
                                      last if li == len(w.layers) - 1 else None)
            if mm is not None and li < len(mm.deepstack):
                x = x.index_put((mm.rows, mm.cols), mm.deepstack[li], accumulate=True)
            cache.k[li][rows, :, :plen] = k
            cache.v[li][rows, :, :plen] = v
        return self._logits(x)

    def _biases(self, pos: torch.Tensor, kv_len: int) -> dict[int | None, torch.Tensor]:
        """The additive masks `[B, 1, 1, Lb]` of one decode step, one per window in use (None: full):
        0 where key j is visible from a row at `pos` (j <= pos, and j > pos - window), -inf elsewhere."""
        j = torch.arange(kv_len, device=pos.device)[None, :]
        out = {}
        for window in {layer.kind.window for layer in self.weights.layers}:
            hidden = j > pos[:, None]  # [B, Lb]
            if window is not None:
                hidden = hidden | (j <= pos[:, None] - window)
            bias = torch.zeros(hidden.shape, dtype=self.cos.dtype, device=pos.device)
            out[window] = bias.masked_fill(hidden, float("-inf"))[:, None, None, :]
        return out

    def decode(self, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One token for each of the rows 0..B-1 (row = slot); returns logits `[B, V]` (model dtype).

        `kv_len` (the length bucket) matters only when `uses_kv_len`."""
        w = self.weights
        biases = self._biases(pos, kv_len) if self.uses_kv_len else {}
        x = self.embed(tokens)
        gemm = self.gemm if tokens.shape[0] >= self.gemm_min_rows else "torch"
        if gemm == "triton":  # partials of the shape every layer returns: one compiled graph for all layers
            down = w.layers[0].down
            assert down is not None  # the Triton GEMMs run dense models only (triton_gemm_supported)
            splits = triton_gemm.splits_for(self.spec.hidden_size, down.shape[1])
            delta = torch.zeros((splits,) + x.shape, dtype=torch.float32, device=x.device)
        else:
            delta = torch.zeros_like(x)
        for li, layer in enumerate(w.layers):
            cos, sin = self.tables[layer.kind.rope]
            x, delta = self.layer_fn(self.spec, layer, cache.k[li], cache.v[li], x, delta, pos, cos, sin,
                                     biases.get(layer.kind.window), self.scale, self.attn, gemm)
        return self.head_fn(self.spec, w.final_norm, w.lm_head, x, delta)
