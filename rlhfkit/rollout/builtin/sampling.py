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
times multipliers below 2^31), so int64 arithmetic never overflows on any device.

The reported log-prob is that of the temperature-scaled, *unprocessed* distribution: what the
trainer's `log_softmax(logits / T)` gives for the same token. Top-k/top-p find a cutoff value on
the sorted scores and then mask the unsorted ones, so rows without those filters sample exactly as
they would in a batch without any filtering.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

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


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[B, vocab]` Gumbel(0, 1) noise, a pure function of (seed, counter, token index)."""
    row = _mix32((seeds & _M32) ^ _mix32(((seeds >> 32) & _M32) ^ _mix32(counters & _M32)))
    idx = _mix32(torch.arange(vocab, device=seeds.device))
    h = _mix32(_mix32(row[:, None] ^ idx[None, :]))
    u = ((h >> 8).float() + 0.5) * (1.0 / 16777216.0)  # 24 bits, in (0, 1)
    return -torch.log(-torch.log(u))


def _banned(vocab: int, stop_ids: torch.Tensor, ban_mask: torch.Tensor) -> torch.Tensor:
    """`[B, vocab]` bool: token i is one of the row's banned stop ids (M compares, fused when compiled)."""
    ids = torch.arange(vocab, device=stop_ids.device)[None, :]
    out = torch.zeros(stop_ids.shape[0], vocab, dtype=torch.bool, device=stop_ids.device)
    for j in range(stop_ids.shape[1]):
        out = out | ((ids == stop_ids[:, j:j + 1]) & ban_mask[:, j:j + 1])
    return out


def _top_k_top_p_cutoff(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`[B, 1]` smallest kept score: top-k first, then the top-p nucleus of the top-k renormalised mass."""
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
                  filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits [B, V]`; returns `(tokens [B], fp32 logprobs [B])`.

    `ban_mask [B, M]` marks the entries of `stop_ids [B, M]` that are banned now (min_new_tokens).
    `filtered` (a Python bool, constant per CUDA graph) turns on the top-k/top-p path; rows
    with top_k = V and top_p = 1 are unaffected by it.
    """
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / temp[:, None]
    lse = torch.logsumexp(scaled, dim=-1)
    masked = scaled.masked_fill(_banned(vocab, stop_ids, ban_mask), NEG_INF)
    if filtered:
        masked = masked.masked_fill(masked < _top_k_top_p_cutoff(masked, top_k, top_p), NEG_INF)
    noisy = torch.where(greedy[:, None], masked, masked + gumbel_noise(seeds, counters, vocab))
    tokens = noisy.argmax(dim=-1)
    logprobs = scaled.gather(1, tokens[:, None]).squeeze(1) - lse
    return tokens, logprobs


def sample_and_advance(state: SlotState, rows: torch.Tensor, logits: torch.Tensor, filtered: bool,
                       max_model_len: int) -> None:
    """Sample the next token of `rows` and append it to their outputs; rows already done keep still.

    A row becomes done on a stop id (eos included), at max_new tokens, or when the new token
    takes the last position of the cache (`max_model_len - 1`).
    """
    gen = state.gen[rows]
    active = ~state.done[rows]
    stop_ids, stop_valid = state.stop_ids[rows], state.stop_valid[rows]
    ban_mask = stop_valid & (gen < state.min_new[rows])[:, None]
    tok, logprob = sample_tokens(logits, state.temperature[rows], state.top_p[rows], state.top_k[rows],
                                 stop_ids, ban_mask, state.seeds[rows], gen, filtered)
    col = torch.where(active, gen, torch.full_like(gen, state.cap))
    state.out_tokens[rows, col] = tok
    state.out_logprobs[rows, col] = logprob
    step = active.long()
    new_gen, new_pos = gen + step, state.pos[rows] + step
    is_stop = ((stop_ids == tok[:, None]) & stop_valid).any(dim=-1)
    finished = is_stop | (new_gen >= state.max_new[rows]) | (new_pos >= max_model_len - 1)
    state.done[rows] = ~active | finished
    state.tokens[rows] = torch.where(active, tok, state.tokens[rows])
    state.gen[rows] = new_gen
    state.pos[rows] = new_pos
