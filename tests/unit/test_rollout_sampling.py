"""Sampling of the builtin engine on hand-made 4-token distributions (values worked out by hand)."""

from __future__ import annotations

import math

import torch

from rlhfkit.rollout.builtin.loop.sampling import (SlotState, gumbel_noise, hash_uniform, hierarchical_gumbel_argmax,
                                                   sample_and_advance, sample_tokens)

PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])
LOGITS = PROBS.log()


def _draw(n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 4, banned: tuple[int, ...] = (),
          filtered: bool = False, logits: torch.Tensor = LOGITS) -> tuple[torch.Tensor, torch.Tensor]:
    """n rows with the same logits and settings and seeds 0..n-1: (tokens [n], logprobs [n])."""
    stop = list(banned) or [0]
    ban_mask = torch.tensor([[bool(banned)] * len(stop)] * n)
    return sample_tokens(logits[None].expand(n, -1), torch.full((n,), temperature), torch.full((n,), top_p),
                         torch.full((n,), top_k), torch.tensor([stop] * n), ban_mask,
                         torch.arange(n), torch.zeros(n, dtype=torch.long), filtered)


def _freq(tokens: torch.Tensor) -> list[float]:
    return (torch.bincount(tokens, minlength=4).float() / len(tokens)).tolist()


def test_gumbel_max_samples_the_softmax():
    tok, lp = _draw(20000)
    assert all(abs(f - p) < 0.012 for f, p in zip(_freq(tok), PROBS.tolist()))
    assert torch.allclose(lp, PROBS.log()[tok], atol=1e-6)
    # T = 0.5 squares the probabilities: p ~ [1, 4, 9, 16] / 30; the reported log-prob is of that distribution
    tok, lp = _draw(20000, temperature=0.5)
    expected = [1 / 30, 4 / 30, 9 / 30, 16 / 30]
    assert all(abs(f - p) < 0.012 for f, p in zip(_freq(tok), expected))
    assert torch.allclose(lp, torch.tensor(expected).log()[tok], atol=1e-6)


def test_hierarchical_draw_samples_the_softmax_across_chunks():
    """Chunk by mass, then token inside it: the same distribution for 2 chunks of 2, 2 chunks of 3
    (the second padded) and chunks of 1 (every token its own chunk); excluded tokens never drawn."""
    n = 20000
    rows = LOGITS[None].expand(n, -1)
    for chunk in (1, 2, 3):
        tok = hierarchical_gumbel_argmax(rows, torch.arange(n), torch.zeros(n, dtype=torch.long), chunk=chunk)
        assert all(abs(f - p) < 0.012 for f, p in zip(_freq(tok), PROBS.tolist())), chunk
    masked = rows.clone()
    masked[:, 1] = float("-inf")  # the rest renormalises to [1, 3, 4] / 8
    f = _freq(hierarchical_gumbel_argmax(masked, torch.arange(n), torch.zeros(n, dtype=torch.long), chunk=2))
    assert f[1] == 0 and abs(f[0] - 1 / 8) < 0.012 and abs(f[3] - 0.5) < 0.012


def test_one_chunk_is_plain_gumbel_max():
    """V <= SAMPLE_CHUNK: the draw is argmax(s + token noise), as before chunking existed."""
    seeds, ctr = torch.arange(50), torch.zeros(50, dtype=torch.long)
    rows = torch.randn(50, 300)
    assert torch.equal(hierarchical_gumbel_argmax(rows, seeds, ctr), (rows + gumbel_noise(seeds, ctr, 300)).argmax(1))


def test_noise_is_a_function_of_seed_counter_and_index():
    a = gumbel_noise(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), 1000)
    b = gumbel_noise(torch.tensor([5]), torch.tensor([0]), 1000)
    assert torch.equal(a[0], b[0])  # independent of the other rows
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    # Gumbel(0, 1): mean = Euler's gamma 0.5772, variance = pi^2 / 6
    g = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096)
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - math.pi ** 2 / 6) < 0.03


def test_hash_uniforms_stay_inside_the_unit_interval():
    """The extreme hashes give u = 2^-24 and 1 - 2^-24 exactly, so the Gumbel noise stays finite
    (with 24 bits, h = 2^32 - 1 rounded to u = 1.0 and an infinite noise that forced its token)."""
    u = hash_uniform(torch.tensor([0, 511, 512, 2**32 - 1]))
    assert u.dtype == torch.float32
    assert u.tolist() == [2.0**-24, 2.0**-24, 3 * 2.0**-24, 1 - 2.0**-24]
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all() and g.max().item() < 16.7


def test_greedy_is_argmax_with_raw_logprob():
    tok, lp = _draw(3, temperature=0.0)
    assert tok.tolist() == [3, 3, 3] and math.isclose(lp[0].item(), math.log(0.4), abs_tol=1e-6)


def test_top_k_and_top_p_keep_the_nucleus_and_report_unfiltered_logprobs():
    tok, lp = _draw(20000, top_k=2, filtered=True)  # keeps tokens 2, 3 with mass 3/7, 4/7
    f = _freq(tok)
    assert f[0] == f[1] == 0 and abs(f[2] - 3 / 7) < 0.012
    assert torch.allclose(lp, PROBS.log()[tok], atol=1e-6)
    # top-p 0.5: mass before token 3 is 0, before token 2 is 0.4, before token 1 is 0.7 -> {3, 2}
    f = _freq(_draw(4000, top_p=0.5, filtered=True)[0])
    assert f[0] == f[1] == 0 and f[2] > 0.3
    assert _freq(_draw(200, top_p=0.3, filtered=True)[0]) == [0, 0, 0, 1]
    # top-p applies to the top-k renormalised mass: top-3 gives [2/9, 3/9, 4/9]; p = 0.5 keeps {3, 2}
    assert set(_draw(2000, top_k=3, top_p=0.5, filtered=True)[0].tolist()) == {2, 3}
    # an unfiltered row in a filtered batch samples exactly as without filtering
    assert torch.equal(_draw(500, filtered=True)[0], _draw(500)[0])


def test_min_new_ban_masks_stop_ids_only_for_sampling():
    tok, lp = _draw(3, temperature=0.0, banned=(3,))
    assert tok.tolist() == [3 - 1] * 3 and math.isclose(lp[0].item(), math.log(0.3), abs_tol=1e-6)
    tok, lp = _draw(20000, banned=(0, 3))  # the rest renormalises to [2, 3] / 5
    f = _freq(tok)
    assert f[0] == f[3] == 0 and abs(f[1] - 0.4) < 0.012
    assert torch.allclose(lp, PROBS.log()[tok], atol=1e-6)


def test_sample_and_advance_appends_and_finishes_rows():
    st = SlotState.allocate(num_slots=3, cap=8, max_stop_ids=2, device=torch.device("cpu"))
    rows = torch.tensor([0, 1, 2])
    st.done[:] = torch.tensor([False, False, True])
    st.temperature[:] = 0.0
    st.top_p[:], st.top_k[:] = 1.0, 4
    st.max_new[:] = torch.tensor([5, 1, 5])
    st.pos[:] = torch.tensor([4, 2, 6])
    st.stop_ids[:] = torch.tensor([[2, 2], [2, 2], [2, 2]])
    st.stop_valid[:] = True
    logits = torch.stack([LOGITS, LOGITS, LOGITS.flip(0)])
    before = st.out_tokens.clone()
    sample_and_advance(st, rows, logits, filtered=False, max_model_len=100)
    assert st.out_tokens[0, 0] == 3 and st.out_tokens[1, 0] == 3
    assert torch.equal(st.out_tokens[2, :8], before[2, :8])  # the done row only wrote its scratch column
    assert st.gen.tolist() == [1, 1, 0] and st.pos.tolist() == [5, 3, 6]
    assert st.done.tolist() == [False, True, True]  # row 1 reached max_new = 1
    logits[0] = torch.tensor([0.0, 0.0, 10.0, 0.0])  # row 0 now emits stop id 2
    sample_and_advance(st, rows, logits, filtered=False, max_model_len=100)
    assert st.done.tolist() == [True, True, True] and st.out_tokens[0, 1] == 2
    assert st.tokens[1] == 3 and st.gen[1] == 1  # finished rows stay still


def test_min_new_tokens_bans_stop_ids_until_reached():
    st = SlotState.allocate(num_slots=1, cap=8, max_stop_ids=1, device=torch.device("cpu"))
    st.done[:], st.max_new[:], st.min_new[:] = False, 8, 2
    st.top_p[:], st.top_k[:] = 1.0, 4
    st.stop_ids[:], st.stop_valid[:] = 3, True  # the greedy choice is the stop id
    for _ in range(3):
        sample_and_advance(st, torch.tensor([0]), LOGITS[None], filtered=False, max_model_len=100)
    assert st.out_tokens[0, :3].tolist() == [2, 2, 3] and bool(st.done[0])


def test_position_limit_finishes_a_row():
    st = SlotState.allocate(num_slots=1, cap=8, max_stop_ids=1, device=torch.device("cpu"))
    st.done[:] = False
    st.max_new[:] = 100
    st.top_p[:], st.top_k[:] = 1.0, 4
    st.pos[:] = 8  # new token lands on position 9 = max_model_len - 1: the last one
    sample_and_advance(st, torch.tensor([0]), LOGITS[None], filtered=False, max_model_len=10)
    assert bool(st.done[0])
