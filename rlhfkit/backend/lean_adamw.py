"""Memory-lean AdamW: 8-bit moments (`--optim adamw_8bit`) and bf16 weights without fp32 master copies
(`--master_weights bf16_stochastic | bf16_kahan`).

Bytes per trainable parameter held between steps (weights + gradients + optimizer state):

    --optim adam,       --master_weights fp32             4 + 4 + 8          = 16  (one process: + 2, the bf16 module)
    --optim adamw_8bit, --master_weights fp32             4 + 4 + 2.03       = 10.03 (+ 2)
    --optim adam,       --master_weights bf16_stochastic  2 + 2 + 8          = 12
    --optim adamw_8bit, --master_weights bf16_stochastic  2 + 2 + 2.03       = 6.03
    --optim adamw_8bit, --master_weights bf16_kahan       2 + 2 + 2.03 + 2   = 8.03

8-bit moments. Each moment tensor is viewed as rows of its last dimension; each row is cut into blocks of
`BLOCK` (256) values, and a block is stored as one byte per value plus its fp32 absolute maximum (4 bytes a
block, 0.016 B a value). The byte is a float8 e4m3 code (1 sign, 4 exponent, 3 mantissa bits) of the value
times 448 / absmax, so a block's largest value is kept exactly and every other one to 2^-4 of itself
(round to nearest on a 3-bit mantissa) down to 2^-6 / 448 of the block's maximum, then in steps of
2^-9 / 448 of it (the code's subnormals): about 5 decades of dynamic range, where a linear 8-bit code
would keep 2. The first moment m is coded as it is; the second v as sqrt(v), whose dynamic range is half
of v's (in the logarithm), so v keeps about 10 decades. A step dequantizes both, updates them and computes
the weight update in fp32 exactly as AdamW does, then quantizes them again. Tensors of fewer than
`MIN_8BIT_NUMEL` (4096) values and 1-D ones (biases, norms) keep fp32 moments, as do tensors whose last
dimension is sharded (tensor parallelism), so that a block never straddles two ranks and a checkpoint
reshards like any other state.

bf16 weights. The trainable weights are stored in bf16 (no fp32 master); a step computes the new weight in
fp32 (AdamW's update, as above) and stores it back:
  bf16_stochastic   rounded to one of its two bf16 neighbours at random, up with probability equal to the
                    distance from the lower one over their spacing (the expected stored weight is the fp32
                    one, so updates far smaller than a bf16 step still move the weights on average). The
                    random bits come from a generator seeded from each tensor's key and step count, both
                    kept in the optimizer state: a resumed run draws the same bits.
  bf16_kahan        rounded to nearest, and the rounding error kept in a bf16 compensation tensor (state
                    `kahan_comp`) that is added to the next update (Kahan summation): weight + compensation
                    carry about 16 significant bits, deterministic, 2 more bytes a parameter.
Gradients are bf16 like the weights (FSDP2 reduces them in fp32 and stores them in bf16); gradient
accumulation over micro-batches sums in bf16.

The update in fp32 is torch's AdamW's: w = w (1 - lr wd) - lr / (1 - b1^t) m / (sqrt(v) / sqrt(1 - b2^t) + eps);
with fp32 weights and fp32 moments `LeanAdamW` equals `torch.optim.AdamW` to fp32 rounding. The step runs
in chunks of `CHUNK` values, so its fp32 temporaries stay small at any tensor size. State tensors have the
parameter's shape (DTensors when it is one; the blocks' maxima are `[..., ceil(last dim / BLOCK)]`), so
torch.distributed.checkpoint saves and loads them like AdamW's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 256
MIN_8BIT_NUMEL = 4096
CHUNK = 1 << 22  # values per pass of a step (bounds its fp32 temporaries at about 16 MiB each)
WEIGHT_MODES = ("fp32", "bf16_stochastic", "bf16_kahan")
_SEED_MULT = 0x9E3779B97F4A7C15 % (1 << 62)


# ----------------------------------------------------------------------------- 8-bit blockwise codes


def quantize_blockwise(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, L] (fp32) -> (codes [R, L] uint8, absmax [R, ceil(L / block)] fp32); see the module docstring."""
    rows, length = x.shape
    nb = -(-length // block)
    pad = nb * block - length
    xb = (F.pad(x, (0, pad)) if pad else x).reshape(rows, nb, block)
    absmax = xb.abs().amax(-1)
    inv = torch.where(absmax > 0, FP8_MAX / absmax, torch.zeros_like(absmax))
    q = (xb * inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8).reshape(rows, nb * block)
    return (q[:, :length] if pad else q), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The fp32 values [R, L] of `quantize_blockwise`'s codes."""
    rows, length = codes.shape
    nb = absmax.shape[-1]
    pad = nb * block - length
    c = (F.pad(codes, (0, pad)) if pad else codes).contiguous()
    x = c.view(FP8).to(torch.float32).reshape(rows, nb, block) * (absmax * (1.0 / FP8_MAX)).unsqueeze(-1)
    x = x.reshape(rows, nb * block)
    return x[:, :length] if pad else x


# ----------------------------------------------------------------------------- bf16 rounding


def round_stochastic_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 -> bf16, rounded to one of the two neighbouring bf16 values with probabilities that make the
    expectation `x`: a uniform 16-bit integer added to the fp32 bits, whose low 16 bits are then dropped."""
    r = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = x.contiguous().view(torch.int32) + r
    return bits.bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)


def kahan_add_bf16(w: torch.Tensor, comp: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(new bf16 weight, new bf16 compensation) of adding fp32 `delta` to bf16 `w` with compensation `comp`."""
    wf = w.to(torch.float32)
    y = delta + comp.to(torch.float32)
    new = (wf + y).to(torch.bfloat16)
    return new, (y - (new.to(torch.float32) - wf)).to(torch.bfloat16)


# ----------------------------------------------------------------------------- the optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _last_dim_sharded(p: torch.Tensor) -> bool:
    placements = getattr(p, "placements", ())
    return any(getattr(pl, "dim", None) in (p.ndim - 1, -1) for pl in placements if pl.is_shard())


class LeanAdamW(torch.optim.Optimizer):
    """AdamW with 8-bit blockwise moments (`eight_bit`) and/or bf16 weights updated by stochastic rounding
    or Kahan summation (`weights`); see the module docstring. Groups take `lr`, `betas`, `eps`,
    `weight_decay` as torch's AdamW's do."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, eight_bit: bool = False, weights: str = "fp32",
                 block: int = BLOCK, min_8bit_numel: int = MIN_8BIT_NUMEL, seed: int = 0) -> None:
        if weights not in WEIGHT_MODES:
            raise ValueError(f"--master_weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.eight_bit, self.weights, self.block, self.min_8bit_numel = eight_bit, weights, block, min_8bit_numel
        self.seed = seed
        want = torch.float32 if weights == "fp32" else torch.bfloat16
        for i, p in enumerate(q for g in self.param_groups for q in g["params"]):
            if p.dtype != want:
                raise ValueError(f"--master_weights {weights} steps {want} weights; parameter {i} is {p.dtype}")
        self._generators: dict[torch.device, torch.Generator] = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, except that every state tensor keeps its dtype (torch's optimizers cast floating-point
        state to the parameter's dtype, which would turn the 8-bit codes, their fp32 maxima, the fp32
        moments of bf16 weights and the rounding keys into the weights' dtype); only the device follows
        the parameter's."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        super().load_state_dict(state_dict)
        for i, p in zip(ids, params):
            if i in saved:
                self.state[p] = {k: (v.to(device=p.device) if isinstance(v, torch.Tensor) and k != "step" else v)
                                 for k, v in saved[i].items()}

    def uses_8bit(self, p: torch.Tensor) -> bool:
        """Whether `p`'s moments are 8-bit (decided from the global shape: every rank decides alike)."""
        return (self.eight_bit and p.ndim >= 2 and p.numel() >= self.min_8bit_numel and not _last_dim_sharded(p))

    def _init_state(self, p: torch.Tensor, st: dict[str, Any], index: int) -> None:
        st["step"] = torch.zeros((), dtype=torch.float32)
        if self.uses_8bit(p):
            nb = -(-p.shape[-1] // self.block)
            for k in ("exp_avg", "exp_avg_sq_sqrt"):
                st[f"{k}_code"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
                st[f"{k}_absmax"] = torch.zeros_like(p.narrow(-1, 0, nb), dtype=torch.float32,
                                                     memory_format=torch.contiguous_format)
        else:
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if self.weights == "bf16_kahan":
            st["kahan_comp"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        if self.weights == "bf16_stochastic":
            st["sr_key"] = torch.tensor(self.seed * 1_000_003 + index, dtype=torch.int64)

    def _generator(self, device: torch.device, st: dict[str, Any]) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device=device)
        g.manual_seed((int(st["sr_key"]) * _SEED_MULT + int(st["step"])) % (1 << 62))
        return g

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            lr = float(group["lr"])
            b1, b2 = (float(b) for b in group["betas"])
            eps, wd = float(group["eps"]), float(group["weight_decay"])
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    self._init_state(p, st, index - 1)
                st["step"] += 1
                t = float(st["step"])
                self._update(p, st, lr, b1, b2, eps, wd, 1.0 - b1 ** t, math.sqrt(1.0 - b2 ** t))
        return loss

    def _update(self, p: torch.Tensor, st: dict[str, Any], lr: float, b1: float, b2: float, eps: float,
                wd: float, bc1: float, bc2_sqrt: float) -> None:
        w, g = _local(p), _local(p.grad)
        if w.numel() == 0:
            return
        if not w.is_contiguous():
            raise RuntimeError("LeanAdamW steps contiguous parameters only")
        length = w.shape[-1] if w.ndim >= 1 else 1
        rows = w.numel() // length

        def as2d(t: torch.Tensor) -> torch.Tensor:
            return _local(t).view(rows, -1)

        w2, g2 = as2d(w), _local(g).reshape(rows, length)
        eight = "exp_avg_code" in st
        if eight:
            mc, ma, sc, sa = (as2d(st[k]) for k in ("exp_avg_code", "exp_avg_absmax", "exp_avg_sq_sqrt_code",
                                                    "exp_avg_sq_sqrt_absmax"))
        else:
            m2, v2 = as2d(st["exp_avg"]), as2d(st["exp_avg_sq"])
        comp = as2d(st["kahan_comp"]) if "kahan_comp" in st else None
        gen = self._generator(w.device, st) if self.weights == "bf16_stochastic" else None
        step_size = lr / bc1
        per = max(1, CHUNK // length)
        for r0 in range(0, rows, per):
            sl = slice(r0, r0 + per)
            gf = g2[sl].to(torch.float32)
            if eight:
                m = dequantize_blockwise(mc[sl], ma[sl], self.block)
                s = dequantize_blockwise(sc[sl], sa[sl], self.block)
                v = s.mul_(s)
            else:
                m, v = m2[sl], v2[sl]  # updated in place
            m.mul_(b1).add_(gf, alpha=1.0 - b1)
            v.mul_(b2).addcmul_(gf, gf, value=1.0 - b2)
            s = v.sqrt()
            denom = (s / bc2_sqrt).add_(eps)
            if self.weights == "fp32":  # in place, in torch's AdamW's order of operations
                wf = w2[sl]
                if wd:
                    wf.mul_(1.0 - lr * wd)
                wf.addcdiv_(m, denom, value=-step_size)
            else:
                wf = w2[sl].to(torch.float32)
                delta = (m / denom).mul_(-step_size)
                if wd:
                    delta.add_(wf, alpha=-lr * wd)
                if comp is None:
                    w2[sl] = round_stochastic_bf16(wf.add_(delta), gen)
                else:
                    new, c = kahan_add_bf16(w2[sl], comp[sl], delta)
                    w2[sl], comp[sl] = new, c
            if eight:
                mc[sl], ma[sl] = quantize_blockwise(m, self.block)
                sc[sl], sa[sl] = quantize_blockwise(s, self.block)


def state_bytes_per_param(optim: str, master_weights: str) -> float:
    """Bytes a trainable parameter costs between steps: weights (masters where they exist) + gradients +
    optimizer state, not counting a one-process bf16 module beside fp32 masters."""
    weights = 4.0 if master_weights == "fp32" else 2.0
    moments = 2.0 + 2 * 4.0 / BLOCK if optim == "adamw_8bit" else 8.0
    return weights + weights + moments + (2.0 if master_weights == "bf16_kahan" else 0.0)
