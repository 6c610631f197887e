"""Per-slot decoding state and token sampling on the device (no Python work per token).

`SlotState` holds, for each KV-cache slot, the token to feed next, its position, how many tokens
were generated, whether the sequence is done, its sampling settings and its output buffers. One
decode step reads and writes only these tensors, so many steps run back to back (or as CUDA graph
replays) before the host looks at the results.

Sampling of one row, given fp32 logits z and temperature T (T = 0 means greedy):

    s = z / T (T := 1 for greedy rows),  logprob(tok) = s[tok] - logsumexp(s)      (reported)
    s' = s, or (z penalised: z / r where z > 0, z * r otherwise, for the tokens of the prompt and
         the completion so far, r = repetition penalty) / T
    s' = s' with stop ids set to -inf while generated < min_new_tokens, and banned ids (a VLM's
         picture placeholder and markers, which a policy never writes) always
    s' = s' with tokens outside top-k / top-p (nucleus) set to -inf
    tok = argmax s' (greedy), or a draw from softmax(s') in two Gumbel-max steps:
          chunk c = argmax_c (logsumexp(s'[chunk c]) + g_c)      (chunks of SAMPLE_CHUNK tokens)
          tok     = argmax_{i in chunk c} (s'_i + g_i),           g iid Gumbel(0, 1)

Gumbel-max (argmax of logits plus iid Gumbel noise) samples exactly from a softmax;
drawing the chunk by its total mass and then the token inside it is the same distribution
(P(i) = P(c) P(i | c)), and only one chunk per row needs noise, so on a GPU the pass over the whole
`[B, V]` logits does one exp per entry and no hashing (`triton_sampling.sample_partials`). A vocabulary
of one chunk (V <= 8192) is plain Gumbel-max. The noise is counter-based: g is a function of (the
row's seed, the number of tokens it generated, the index) through an integer hash, so a seeded
request samples the same tokens whatever else shares the batch (up to the logits' bitwise
equality) and nothing random is drawn on the host per token; chunk noise uses indices from 2^31 on,
token noise the token ids. The hash keeps every product below 2^63 (32-bit values times
multipliers below 2^31), so int64 arithmetic never overflows on any device. The GPU path and the
torch path draw the same tokens up to float rounding of the chunk masses.

The reported log-prob is that of the temperature-scaled, *unprocessed* distribution: what the
trainer's `log_softmax(logits / T)` gives for the same token. Top-k/top-p find a cutoff value on
the sorted scores and then mask the unsorted ones, so rows without those filters sample exactly as
they would in a batch without any filtering.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

from rlhfkit.rollout.builtin.kernels import triton_launch, triton_sampling

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
    ban_always: torch.Tensor  # [S, M] bool: entries of stop_ids that are never sampled (not stops)
    seeds: torch.Tensor  # [S] int64 in [0, 2^63): the sample's noise stream
    rep_penalty: torch.Tensor  # [S] f32 repetition penalty, 1 = none
    seen: torch.Tensor  # [S, V] bool: tokens in the prompt or the completion so far ([S, 0] until a penalty is used)
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
            stop_valid=z(num_slots, max_stop_ids, dtype=torch.bool),
            ban_always=z(num_slots, max_stop_ids, dtype=torch.bool), seeds=z(num_slots),
            rep_penalty=torch.ones(num_slots, dtype=f32, device=device), seen=z(num_slots, 0, dtype=torch.bool),
            out_tokens=z(num_slots, cap + 1), out_logprobs=z(num_slots, cap + 1, dtype=f32),
        )

    @property
    def cap(self) -> int:
        return self.out_tokens.shape[1] - 1

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def track_seen(self, vocab: int) -> bool:
        """Allocate the `[S, V]` token-presence mask a repetition penalty needs; True if it was new."""
        if self.seen.shape[1] == vocab:
            return False
        self.seen = torch.zeros(self.seen.shape[0], vocab, dtype=torch.bool, device=self.seen.device)
        return True

    def admit(self, to_device: Callable, slot: list, pos: list, temp: list, top_p: list, top_k: list,
              min_new: list, max_new: list, stop: list, valid: list, banned: list, seed: list,
              penalty: list) -> torch.Tensor:
        """Fresh counters and the sampling settings of newly admitted slots (one host list per
        field, `to_device(list, dtype=None)` copies one over); returns the slot indices on the device."""
        f32 = torch.float32
        idx = to_device(slot)
        self.pos[idx] = to_device(pos)
        self.gen[idx] = 0
        self.done[idx] = False
        self.temperature[idx] = to_device(temp, f32)
        self.top_p[idx] = to_device(top_p, f32)
        self.top_k[idx] = to_device(top_k)
        self.min_new[idx] = to_device(min_new)
        self.max_new[idx] = to_device(max_new)
        self.stop_ids[idx] = to_device(stop)
        self.stop_valid[idx] = to_device(valid)
        self.ban_always[idx] = to_device(banned)
        self.seeds[idx] = to_device(seed)
        self.rep_penalty[idx] = to_device(penalty, f32)
        return idx

    def read_out(self, reads: torch.Tensor, width: int, wait: bool) -> tuple:
        """Done flags and lengths `[2, n]` of rows 0..n-1 (n = len(reads)) and each row's `width`
        output tokens and log-probs from column `reads[row]` on (`[n, width]`), on the host:
        `(flags, tokens, logprobs, event)`. `wait=False` (CUDA) queues copies into pinned memory
        and returns the event to wait on; else the copies are made at once and `event` is None."""
        n = reads.shape[0]
        cols = (reads[:, None] + torch.arange(min(width, self.cap), device=reads.device)).clamp_(max=self.cap)
        out = (torch.stack([self.done[:n].long(), self.gen[:n]]), self.out_tokens[:n].gather(1, cols),
               self.out_logprobs[:n].gather(1, cols))
        if wait:
            return tuple(t.cpu() for t in out) + (None,)
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in out)
        for h, t in zip(host, out):
            h.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host + (event,)

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.tensors():
            t[dst] = t[src]

    def _advanced(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.pos, self.gen, self.done, self.seen

    def snapshot(self, with_seen: bool = True) -> list[torch.Tensor]:
        """Copies of the fields one decode step advances (to undo a CUDA-graph warm-up run).
        `with_seen=False` leaves out the `[S, V]` presence mask (`restore` then keeps it as it is)."""
        fields_ = self._advanced()
        return [t.clone() for t in (fields_ if with_seen else fields_[:-1])]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for t, s in zip(self._advanced(), snap):
            if t.shape == s.shape:  # (seen may have been allocated since)
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
    """`[B, vocab]` Gumbel(0, 1) token noise, a pure function of (seed, counter, token index).

    u_i = ((mix32(key ^ mix32(i)) >> 9) + 0.5) / 2^23 and g_i = -log(-log(u_i)). 23 bits, so that
    every u_i, 1 - 2^-24 included, is an exact float32 below 1 and g_i stays finite (<= 16.6).
    """
    return _gumbel(row_keys(seeds, counters), torch.arange(vocab, device=seeds.device))


def hash_uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms ((h >> 9) + 0.5) / 2^23, strictly inside (0, 1)."""
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


SAMPLE_CHUNK = triton_sampling.SAMPLE_CHUNK
_CHUNK_INDEX_BASE = 2**31  # chunk-noise indices, disjoint from token ids


def _gumbel(keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise of rows with 32-bit `keys [B]` at indices `idx` (`[B, K]` or `[K]`)."""
    if idx.dim() == 1:
        idx = idx[None, :]
    u = hash_uniform(_mix32(keys[:, None] ^ _mix32(idx)))
    return -torch.log(-torch.log(u))


def hierarchical_gumbel_argmax(masked: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                               chunk: int = SAMPLE_CHUNK,
                               chunk_logmass: torch.Tensor | None = None) -> torch.Tensor:
    """A draw from softmax(masked) per row (`masked [B, V]` fp32 scores, -inf = excluded): a chunk
    by Gumbel-max over the chunks' log-masses (`chunk_logmass [B, C]`, computed here when None),
    then a token by Gumbel-max inside it (module docstring). Returns token ids `[B]`."""
    rows, vocab = masked.shape
    nchunks = -(-vocab // chunk)
    if chunk_logmass is None:
        if nchunks == 1:
            chunk_logmass = torch.logsumexp(masked, dim=-1, keepdim=True)
        else:
            padded = torch.nn.functional.pad(masked, (0, nchunks * chunk - vocab), value=NEG_INF)
            chunk_logmass = torch.logsumexp(padded.view(rows, nchunks, chunk), dim=-1)
    return _draw_in_chunks(chunk_logmass, row_keys(seeds, counters), chunk, vocab,
                           lambda idx: masked.gather(1, idx.clamp(max=vocab - 1)))


def _draw_in_chunks(chunk_logmass: torch.Tensor, keys: torch.Tensor, chunk: int, vocab: int,
                    scores_at: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The two Gumbel-max steps given the chunks' log-masses `[B, C]` and `scores_at(idx [B, K])`,
    the rows' scores at token ids `idx` (ids >= vocab are masked here)."""
    # `|`, not `+` (the same value below 2^31): inductor folds `arange + 2^31` into an int32 index
    # expression that Triton rejects (torch 2.11)
    cidx = torch.arange(chunk_logmass.shape[1], device=keys.device) | _CHUNK_INDEX_BASE
    c = (chunk_logmass + _gumbel(keys, cidx)).argmax(dim=-1)
    idx = c[:, None] * chunk + torch.arange(min(chunk, vocab), device=keys.device)[None, :]  # one chunk: V wide
    vals = scores_at(idx).masked_fill(idx >= vocab, NEG_INF)
    j = (vals + _gumbel(keys, idx)).argmax(dim=-1, keepdim=True)
    return idx.gather(1, j).squeeze(1)


def _banned(vocab: int, stop_ids: torch.Tensor, ban_mask: torch.Tensor,
            ids: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, vocab]` bool (or the shape of token `ids [B, K]`): the token is one of the row's banned
    stop ids (M compares, fused when compiled)."""
    if ids is None:
        ids = torch.arange(vocab, device=stop_ids.device)[None, :]
    out = torch.zeros(stop_ids.shape[0], ids.shape[1], dtype=torch.bool, device=stop_ids.device)
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
                  filtered: bool, fast: bool = True, penalty: torch.Tensor | None = None,
                  seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits [B, V]`; returns `(tokens [B], fp32 logprobs [B])`.

    `ban_mask [B, M]` marks the entries of `stop_ids [B, M]` that are banned now (min_new_tokens).
    `filtered` (a Python bool, constant per CUDA graph) turns on the top-k/top-p path and, with
    `seen [B, V]` (tokens in the prompt and completion) and `penalty [B]`, the repetition penalty;
    rows with top_k = V, top_p = 1 and penalty 1 are unaffected by it. Unfiltered batches on a GPU
    take the one-pass Triton sampler (same noise, same result up to float rounding) when `fast`.
    """
    if fast and not filtered and logits.is_cuda and triton_launch.available():
        parts = torch.ops.rlhfkit.sample_partials(logits, temperature, stop_ids, ban_mask)
        return combine_partials(logits, temperature, seeds, counters, stop_ids, ban_mask, *parts)
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    z = logits.float()
    scaled = z / temp[:, None]
    lse = torch.logsumexp(scaled, dim=-1)
    scores = scaled
    if filtered and seen is not None and penalty is not None and seen.shape[-1] == vocab:
        r = penalty[:, None]
        scores = torch.where(seen, torch.where(z > 0, z / r, z * r), z) / temp[:, None]
    masked = scores.masked_fill(_banned(vocab, stop_ids, ban_mask), NEG_INF)
    if filtered:
        cutoff = _top_k_top_p_cutoff(masked, top_k, top_p)
        masked = torch.where(masked < cutoff, NEG_INF, masked)
    tokens = torch.where(greedy, masked.argmax(dim=-1), hierarchical_gumbel_argmax(masked, seeds, counters))
    logprobs = scaled.gather(1, tokens[:, None]).squeeze(1) - lse
    return tokens, logprobs


def reference_partials(logits: torch.Tensor, temperature: torch.Tensor, stop_ids: torch.Tensor,
                       ban_mask: torch.Tensor, chunk: int = SAMPLE_CHUNK) -> tuple[torch.Tensor, ...]:
    """What `triton_sampling.sample_partials` computes, in torch (tests; any device): per chunk `[B, C]`
    the best banned-masked z / T and its id, max of z / T, sum exp(z / T - max), the same sum over
    tokens not banned."""
    rows, vocab = logits.shape
    nchunks = -(-vocab // chunk)
    temp = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    x = logits.float() * (1.0 / temp)[:, None]
    z = x.masked_fill(_banned(vocab, stop_ids, ban_mask), NEG_INF)

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, nchunks * chunk - vocab), value=NEG_INF).view(rows, nchunks, chunk)

    xc, zc = chunks(x), chunks(z)
    m = xc.max(dim=-1).values
    best, j = zc.max(dim=-1)
    idx = (j + torch.arange(nchunks, device=logits.device)[None, :] * chunk).int()
    return best, idx, m, torch.exp(xc - m[..., None]).sum(-1), torch.exp(zc - m[..., None]).sum(-1)


def combine_partials(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                     stop_ids: torch.Tensor, ban_mask: torch.Tensor, best: torch.Tensor, best_idx: torch.Tensor,
                     chunk_max: torch.Tensor, chunk_sum: torch.Tensor, chunk_sum_kept: torch.Tensor,
                     chunk: int = SAMPLE_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-chunk results `[B, C]` of the sampling pass into `(tokens [B], logprobs [B])`.

    lse = M + log(sum_c S_c exp(m_c - M)) with M = max_c m_c; logprob = z_tok / T - lse;
    greedy rows: the best chunk's argmax (the first chunk on ties, as `argmax`); sampled rows:
    `hierarchical_gumbel_argmax` with chunk log-masses m_c + log(kept sum_c), the chosen chunk's
    scores gathered from `logits` (banned ids masked).
    """
    rows, vocab = logits.shape
    top = chunk_max.max(dim=-1, keepdim=True).values
    lse = top.squeeze(1) + torch.log((chunk_sum * torch.exp(chunk_max - top)).sum(dim=-1))
    greedy_tok = best_idx.gather(1, best.argmax(dim=-1, keepdim=True)).long().squeeze(1)
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    inv_t = (1.0 / temp)[:, None]
    logmass = chunk_max + torch.log(chunk_sum_kept)
    if logits.is_cuda and triton_launch.available() and chunk == SAMPLE_CHUNK:
        # the hash chain in one Triton kernel (inductor failed to compile it as generated code)
        drawn = torch.ops.rlhfkit.chunk_draw(logits, temperature, seeds, counters, stop_ids, ban_mask, logmass)
        return _finish(logits, greedy, greedy_tok, drawn.long(), inv_t, lse)

    def scores_at(idx: torch.Tensor) -> torch.Tensor:
        scores = logits.gather(1, idx.clamp(max=vocab - 1)).float() * inv_t
        return scores.masked_fill(_banned(vocab, stop_ids, ban_mask, idx), NEG_INF)

    drawn = _draw_in_chunks(logmass, row_keys(seeds, counters), chunk, vocab, scores_at)
    return _finish(logits, greedy, greedy_tok, drawn, inv_t, lse)


def _finish(logits: torch.Tensor, greedy: torch.Tensor, greedy_tok: torch.Tensor, drawn: torch.Tensor,
            inv_t: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.where(greedy, greedy_tok, drawn)
    logprobs = logits.gather(1, tokens[:, None]).squeeze(1).float() * inv_t.squeeze(1) - lse
    return tokens, logprobs


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
    ban_mask = (stop_valid & (gen < get(state.min_new))[:, None]) | get(state.ban_always)
    tracked = filtered and state.seen.shape[1] == logits.shape[1]  # a repetition penalty is in use
    tok, logprob = sample_tokens(logits, get(state.temperature), get(state.top_p), get(state.top_k),
                                 stop_ids, ban_mask, get(state.seeds), gen, filtered, fast,
                                 get(state.rep_penalty) if tracked else None, get(state.seen) if tracked else None)
    col = torch.where(active, gen, torch.full_like(gen, state.cap))
    out_rows = torch.arange(n, device=gen.device) if rows is None else rows
    if tracked:
        state.seen[out_rows, tok] = torch.ones_like(tok, dtype=torch.bool)  # a device value: capturable
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
