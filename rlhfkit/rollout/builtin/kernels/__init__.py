"""GPU kernels of the builtin engine's decode step and prefill (each falls back to torch where it cannot run).

    triton_launch.py     whether Triton can run here; programmatic dependent launch of the kernels
    triton_attention.py  decode attention: fused RoPE + K/V write + GQA attention (flash-decoding splits)
    triton_sampling.py   the one-pass sampler: per-chunk partials and the chunk draw
    triton_gemm.py       Triton GEMMs for the decode step's small-M projections (split-K, fused gate/up + SiLU)
    triton_norm.py       RMSNorm (and residual add + RMSNorm) as one Triton kernel
    triton_moe.py        the routed experts' GEMMs of a decode step (few rows per expert)
    eager_fused.py       EagerFused: small pieces of an eager step compiled with torch.compile
"""
