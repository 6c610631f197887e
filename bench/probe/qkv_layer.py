"""Probe (not a benchmark of record): one compiled Qwen2-0.5B decoder layer, fwd + bwd at 8 x 2048, with the
q/k/v projections unfused, fused (models/fused_qkv.py) and fused with variants; prints ms per layer."""
import os, sys, time, json
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
from rlhfkit.models import fused_qkv

cfg = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6)
cfg._attn_implementation = "sdpa"
B, S = 8, 2048
torch.manual_seed(0)
rot = Qwen2RotaryEmbedding(cfg).cuda()
x0 = torch.randn(B, S, 896, device="cuda", dtype=torch.bfloat16)
pos = torch.arange(S, device="cuda")[None].expand(B, S)
cos, sin = rot(x0, pos)
res = {}
import types
import torch.nn.functional as F


def gate_up_forward(self, x):
    gu = F.linear(x, torch.cat((self.gate_proj.weight, self.up_proj.weight)))
    g, u = gu.chunk(2, dim=-1)
    return self.down_proj(self.act_fn(g) * u)


for variant in sys.argv[1].split(","):
    torch.manual_seed(0)
    torch.backends.cuda.preferred_blas_library("cublaslt" if "lt" in variant else "cublas")
    layer = Qwen2DecoderLayer(cfg, 0).cuda().to(torch.bfloat16)
    fused_qkv.ENABLED = "unfused" not in variant
    fused_qkv.fuse_qkv(layer)
    if "gateup" in variant:
        layer.mlp.forward = types.MethodType(gate_up_forward, layer.mlp)
    import torch._inductor.config as icfg
    icfg.coordinate_descent_tuning = "cdt" in variant
    icfg.aggressive_fusion = "aggr" in variant
    layer.compile()
    x = x0.clone().requires_grad_(True)
    from contextlib import nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    def ctx(variant=variant):
        return (sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if "flashattn" in variant else
                sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]) if "effattn" in variant else nullcontext())

    def step():
        with ctx():
            out = layer(x, attention_mask=None, position_embeddings=(cos, sin), position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    try:
        for _ in range(3):
            step()
    except Exception as e:  # noqa: BLE001
        print(variant, "failed", type(e).__name__, str(e)[:300])
        continue
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    res[variant] = (time.perf_counter() - t) / 20 * 1e3
    print(variant, round(res[variant], 4), "ms", flush=True)
print(json.dumps(res))
