"""Per-slot decoding state and token sampling on the device (no Python work per token).

`SlotState` holds, for each KV-cache slot, the token to feed next, its position, how many tokens
were generated, whether the sequence is done, its sampling settings and its output buffers. One
decode step reads and writes only these tensors, so many steps run back to back (or as CUDA graph
replays) before the host looks at the results.

Sampling of one row, given fp32 logits z and temperature T (T = 0 means greedy):

    s = z / T (T := 1 for greedy rows),  logprob(tok) = s[tok] - logsumexp(s)      (reported)
    s' = s with stop ids set to -inf while generated < min_new_tokens
    s' = s' with tokens outside top-k / top-p (Holtzman et al. 2019, arXiv 1904.09751) set to -inf
    tok = argmax s' (greedy) or argmax (s' + g), g_i iid Gumbel(0, 1)      (Gumbel-max trick)

Gumbel-max (Gumbel 1954; Maddison et al. 2014, arXiv 1411.0433) samples exactly from softmax(s')
with one fused pass over the logits. The noise is counter-based: g_i is a function of (the row's
seed, the number of tokens it generated, i) through an integer hash, so a seeded request samples
the same tokens whatever else shares the batch (up to the logits' bitwise equality) and nothing
random is drawn on the host per token. The hash keeps every product below 2^63 (32-bit values
times multipliers below 2^31), so int64 arithmetic never overflows on any device. On a GPU,
unfiltered batches are sampled by a Triton kernel (`triton_ops.gumbel_sample_partials`) that
computes the same hash in uint32 and the log-sum-exp and argmax in one pass over the logits.

The reported log-prob is that of the temperature-scaled, *unprocessed* distribution: what the
trainer's `log_softmax(logits / T)` gives for the same token. Top-k/top-p find a cutoff value on
the sorted scores and then mask the unsorted ones, so rows without those filters sample exactly as
they would in a batch without any filtering.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rlhfkit.rollout.builtin import triton_ops

NEG_INF = float("-inf")


@dataclass
class SlotState:
    """Device tensors indexed by slot. `cap` = max model length (the output buffers' width)."""

    tokens: torch.Tensor  # [S] token fed at the next decode step
    pos: torch.Tensor  # [S] its position (its K/V goes there)
    gen: torch.Tensor  # [S] tokens generated so far
    done: torch.Tensor  # [S] bool
    temperature: torch.Tensor  # [S] f32, 0 = greedy
    top_p: torch.Tensor  # [S] f32
    top_k: torch.Tensor  # [S] int, vocab size when disabled
    min_new: torch.Tensor  # [S]
    max_new: torch.Tensor  # [S]
    stop_ids: torch.Tensor  # [S, M] stop token ids (eos included), padded with the first one
    stop_valid: torch.Tensor  # [S, M] bool
    seeds: torch.Tensor  # [S] int64 in [0, 2^63): the sample's noise stream
    out_tokens: torch.Tensor  # [S, cap + 1]; column cap is scratch for done rows
    out_logprobs: torch.Tensor  # [S, cap + 1] f32

    @classmethod
    def allocate(cls, num_slots: int, cap: int, max_stop_ids: int, device: torch.device) -> "SlotState":
        def z(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        f32 = torch.float32
        return cls(
            tokens=z(num_slots), pos=z(num_slots), gen=z(num_slots),
            done=torch.ones(num_slots, dtype=torch.bool, device=device),
            temperature=z(num_slots, dtype=f32), top_p=z(num_slots, dtype=f32), top_k=z(num_slots),
            min_new=z(num_slots), max_new=z(num_slots), stop_ids=z(num_slots, max_stop_ids),
            stop_valid=z(num_slots, max_stop_ids, dtype=torch.bool), seeds=z(num_slots),
            out_tokens=z(num_slots, cap + 1), out_logprobs=z(num_slots, cap + 1, dtype=f32),
        )

    @property
    def cap(self) -> int:
        return self.out_tokens.shape[1] - 1

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.tensors():
            t[dst] = t[src]

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the fields one decode step advances (to undo a CUDA-graph warm-up run)."""
        return [t.clone() for t in (self.tokens, self.pos, self.gen, self.done)]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for t, s in zip((self.tokens, self.pos, self.gen, self.done), snap):
            t.copy_(s)


_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, after Wellons' lowbias32) on int64 values < 2^32."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x546CA68B) & _M32
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`[B]` 32-bit key of each row's noise at its current counter (three chained mixes)."""
    return _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ _mix32(counters & _M32)))


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[B, vocab]` Gumbel(0, 1) noise, a pure function of (seed, counter, token index).

    u_i = ((mix32(key ^ mix32(i)) >> 9) + 0.5) / 2^23 and g_i = -log(-log(u_i)) (the Triton
    sampler evaluates the same hash in uint32). 23 bits, so that every u_i, 1 - 2^-24 included,
    is an exact float32 below 1 and g_i stays finite (<= 16.6).
    """
    idx = _mix32(torch.arange(vocab, device=seeds.device))
    u = hash_uniform(_mix32(row_keys(seeds, counters)[:, None] ^ idx[None, :]))
    return -torch.log(-torch.log(u))


def hash_uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms ((h >> 9) + 0.5) / 2^23, strictly inside (0, 1)."""
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def _banned(vocab: int, stop_ids: torch.Tensor, ban_mask: torch.Tensor) -> torch.Tensor:
    """`[B, vocab]` bool: token i is one of the row's banned stop ids (M compares, fused when compiled)."""
    ids = torch.arange(vocab, device=stop_ids.device)[None, :]
    out = torch.zeros(stop_ids.shape[0], vocab, dtype=torch.bool, device=stop_ids.device)
    for j in range(stop_ids.shape[1]):
        out = out | ((ids == stop_ids[:, j:j + 1]) & ban_mask[:, j:j + 1])
    return out


@torch.compiler.disable  # inductor (torch 2.11, CUDA) failed to generate this [B, V] softmax + cumsum
def _top_k_top_p_cutoff(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`[B, 1]` smallest kept score: top-k first, then the top-p nucleus of the top-k renormalised mass.

    Runs eagerly inside the compiled sampler (a graph break), and is captured as such in CUDA graphs.
    """
    vocab = scores.shape[-1]
    sorted_vals = scores.sort(dim=-1, descending=True).values
    ranks = torch.arange(vocab, device=scores.device)[None, :]
    in_k = ranks < top_k[:, None]
    sorted_vals = sorted_vals.masked_fill(~in_k, NEG_INF)
    probs = torch.softmax(sorted_vals, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    n_keep = keep.sum(dim=-1).clamp(min=1)
    return sorted_vals.gather(1, (n_keep - 1)[:, None])


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  top_k: torch.Tensor, stop_ids: torch.Tensor, ban_mask: torch.Tensor,
                  seeds: torch.Tensor, counters: torch.Tensor,
                  filtered: bool, fast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits [B, V]`; returns `(tokens [B], fp32 logprobs [B])`.

    `ban_mask [B, M]` marks the entries of `stop_ids [B, M]` that are banned now (min_new_tokens).
    `filtered` (a Python bool, constant per CUDA graph) turns on the top-k/top-p path; rows
    with top_k = V and top_p = 1 are unaffected by it. Unfiltered batches on a GPU take the
    one-pass Triton sampler (same noise, same result up to float rounding) when `fast`.
    """
    if fast and not filtered and logits.is_cuda and triton_ops.available():
        parts = torch.ops.rlhfkit.gumbel_sample_partials(logits, temperature, seeds, counters, stop_ids, ban_mask)
        return combine_partials(logits, temperature, *parts)
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / temp[:, None]
    lse = torch.logsumexp(scaled, dim=-1)
    masked = scaled.masked_fill(_banned(vocab, stop_ids, ban_mask), NEG_INF)
    if filtered:
        cutoff = _top_k_top_p_cutoff(masked, top_k, top_p)
        masked = torch.where(masked < cutoff, NEG_INF, masked)
    noisy = torch.where(greedy[:, None], masked, masked + gumbel_noise(seeds, counters, vocab))
    tokens = noisy.argmax(dim=-1)
    logprobs = scaled.gather(1, tokens[:, None]).squeeze(1) - lse
    return tokens, logprobs


def combine_partials(logits: torch.Tensor, temperature: torch.Tensor, best: torch.Tensor, best_idx: torch.Tensor,
                     chunk_max: torch.Tensor, chunk_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-chunk results `[B, C]` of the Triton sampler into `(tokens [B], logprobs [B])`.

    token = the best chunk's argmax (the first chunk on ties, as `argmax`);
    lse = M + log(sum_c S_c exp(m_c - M)) with M = max_c m_c; logprob = z_tok / T - lse.
    """
    top = chunk_max.max(dim=-1, keepdim=True).values
    lse = top.squeeze(1) + torch.log((chunk_sum * torch.exp(chunk_max - top)).sum(dim=-1))
    tokens = best_idx.gather(1, best.argmax(dim=-1, keepdim=True)).long()
    temp = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    logprobs = logits.gather(1, tokens).squeeze(1).float() / temp - lse
    return tokens.squeeze(1), logprobs


def sample_and_advance(state: SlotState, rows: torch.Tensor | None, logits: torch.Tensor, filtered: bool,
                       max_model_len: int, fast: bool = True) -> None:
    """Sample the next token of `rows` and append it to their outputs; rows already done keep still.

    `rows=None` means rows 0..B-1 (B = len(logits)): the decode step, read and written through
    slices rather than gathers and scatters. A row becomes done on a stop id (eos included), at
    max_new tokens, or when the new token takes the last position of the cache (`max_model_len - 1`).
    """
    n = logits.shape[0]

    def get(t: torch.Tensor) -> torch.Tensor:
        return t[:n] if rows is None else t[rows]

    def put(t: torch.Tensor, value: torch.Tensor) -> None:
        if rows is None:
            t[:n] = value
        else:
            t[rows] = value

    gen = get(state.gen)
    active = ~get(state.done)
    stop_ids, stop_valid = get(state.stop_ids), get(state.stop_valid)
    ban_mask = stop_valid & (gen < get(state.min_new))[:, None]
    tok, logprob = sample_tokens(logits, get(state.temperature), get(state.top_p), get(state.top_k),
                                 stop_ids, ban_mask, get(state.seeds), gen, filtered, fast)
    col = torch.where(active, gen, torch.full_like(gen, state.cap))
    out_rows = torch.arange(n, device=gen.device) if rows is None else rows
    state.out_tokens[out_rows, col] = tok
    state.out_logprobs[out_rows, col] = logprob
    step = active.long()
    new_gen, new_pos = gen + step, get(state.pos) + step
    is_stop = ((stop_ids == tok[:, None]) & stop_valid).any(dim=-1)
    finished = is_stop | (new_gen >= get(state.max_new)) | (new_pos >= max_model_len - 1)
    put(state.done, ~active | finished)
    put(state.tokens, torch.where(active, tok, get(state.tokens)))
    put(state.gen, new_gen)
    put(state.pos, new_pos)
