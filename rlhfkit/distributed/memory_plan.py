"""Per-GPU memory plan of an RL placement, before any actor starts: pure functions (no Ray, no GPU).

    MemoryInputs(roles, engine, dtypes, ZeRO stage, --adam_offload, colocation, sleep flags, tokens)
      -> plan_memory(inputs, device_bytes) -> MemoryPlan: per pool (GPUs holding the same members)
           the bytes of each member's components and the total of each phase; the peak is the largest
      -> plan.table(device_bytes)                 a compact text table
      -> over_budget(inputs, device_bytes)        None, or a message with the flags that would fit

Parameters (`ModelShape.num_params`), with q = heads x head_dim, kv = kv_heads x head_dim:
    per decoder layer  2 H q [q, o] + 2 H kv [k, v] (+ q + 2 kv biases) + 3 H I [gate, up, down] + 2 H [norms]
    root               V H [embedding] + H [final norm] + V H [head, untied] (a value model: H x 1 score)
    a MoE layer        the router E H and E experts' 3 H I_e in place of the dense MLP (E routed experts of
                       intermediate size I_e; Qwen3-MoE's mlp_only_layers stay dense); LoRA and --load_in_4bit
                       reach only its linear layers (attention), and its activations hold each token's k routed
                       copies (2 H + 4 I_e each) and E router logits in place of the dense MLP's 4 I

One GPU of a role group of W ranks; b = bytes of --param_dtype; S = W at ZeRO stage >= 1, else 1:
    trainable (policy, critic) under FSDP2 (W > 1, or --adam_offload: a one-rank group):
        master 4P/S (the fp32 sharded parameters), optimizer 8P/S (AdamW's two moments),
        grads 4P/S and the gathered compute-dtype weights while it trains: b P at stages 0-2
        (blocks stay gathered between forward and backward), b (root + 2 blocks) at stage 3.
        --adam_offload keeps master, optimizer and grads in host memory (0 here).
    trainable, one process (W = 1): a bf16 module b P beside fp32 masters 4P, optimizer 8P, grads 4P.
    --optim adamw_8bit: optimizer (2 + 8/256) P instead of 8 P; --master_weights bf16_stochastic: the
        weights and grads 2P (and no separate bf16 module), bf16_kahan: the same + 2P of compensation in
        the optimizer column (rlhfkit/backend/lean_adamw.py). The --critic_* flags set the critic's.
    --lora_rank r (the policy, and a critic, which trains adapters too): the frozen base b P / S, and master,
        optimizer and grads of the adapters' n = L r (2 (H + q) + 2 (H + kv) + 3 (H + I)) parameters in
        place of P's.
    --load_in_4bit (QLoRA; one process): the blocks' linear weights Q = L (2 H q + 2 H kv + 3 H I) in
        bitsandbytes NF4 with nested scales, NF4_BYTES a value; the rest (embeddings, head, norms, biases) b
        each. While a call runs, one linear weight dequantized (b H I, the largest) beside the 4-bit weights.
    ref (frozen, stored in the compute dtype): b P / S resident; b P gathered while and after it runs
        at stages < 3 (a no-grad forward leaves the blocks gathered until an offload reshards them).
    reward (a plain module on every rank): b P.
    engine (one GPU of its tensor-parallel group of T): weights b P / T (serving the policy's own weights:
        only the packed LoRA adapters, and over a 4-bit base one layer's dequantized projections); KV cache
        2 x layers x max_num_seqs x ceil(kv_heads / T) x max_model_len x head_dim x b (builtin / hf);
        vllm reserves --vllm_gpu_memory_utilization of the GPU (weights included) when it is known.
Activations of a training call, T tokens per micro-batch, per layer and token
    A = 16 H [two RMSNorms' fp32 input and normalised copies]
        + b (2 H + 3 q + 3 kv + 4 I) [norm outputs, q k v, rotated q k, attention output; gate, up,
                                      act(gate), act(gate) * up]
    Under --torch_compile a trained model's blocks keep no fp32 copies of their norms: inductor fuses each
    RMSNorm into one kernel that saves one fp32 scale a token, so A = 8 + b (...) in its training calls
    (measured on one H100: docs/performance.md, "One GPU, full size").
    T L A + T A, or with --gradient_checkpointing T (L b H + 2 A) [block inputs; one block recomputed
    and the gradients of its activations], plus one chunk of the fused log-prob head's logits
    (min(HEAD_CHUNK_BYTES, T V b)). A forward-only call: T A + the chunk. A sharded trainable role
    also holds one vocabulary matrix's unsharded gradient (b V H) while it is reduce-scattered.
The head keeps a micro-batch's whole logits (T V b) instead of recomputing them when half of the
memory still free allows it (rlhfkit/models/fused_logprobs.py); given the GPU's size the plan adds
that as `optional` (used only when there is room, so never a reason to refuse a layout).
Every process on a GPU holds a CUDA context: a trainable role sharded over ranks also NCCL's
buffers and cuBLAS workspaces (CONTEXT_SHARDED_BYTES), one process CONTEXT_BYTES, an engine
CONTEXT_BYTES plus its CUDA graphs' pool and sampling buffers (ENGINE_WORKSPACE_BYTES; more with
tensor parallelism's communicators). These constants are calibrated against measured peaks
(docs/performance.md, "Memory plan against measured peaks"); the caching allocator's fragmentation
is kept small by expandable segments (`rlhfkit.parallel.dist.use_expandable_segments`).

Phases of a pool: "generate" (engines awake, roles resident unless --deepspeed_enable_sleep) and
one per role while it runs (its active footprint; the other roles resident unless
--deepspeed_enable_sleep; engines awake, or asleep under --vllm_enable_sleep: the builtin engine
keeps its weights at sleep level 1, vllm and hf keep nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from rlhfkit.config.configs import BackendFlags, ModelFlags
from rlhfkit.config.declare import default_of
from rlhfkit.config.rl_flags import PlacementFlags

GiB = 2**30
QUANT_BLOCK = 256  # values per fp32 maximum of --optim adamw_8bit (rlhfkit.backend.lean_adamw.BLOCK; no torch here)
# bitsandbytes NF4 with nested scales (--load_in_4bit): 4 bits a value, a uint8 scale per 64 values and an fp32
# per 256 scales
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
CONTEXT_BYTES = 3 * GiB // 4  # CUDA context of one process
CONTEXT_SHARDED_BYTES = 11 * GiB // 4  # a sharded trainable rank: context, NCCL buffers, cuBLAS workspaces
ENGINE_WORKSPACE_BYTES = 3 * GiB // 2  # an engine: CUDA graphs' pool, sampling and logits buffers
ENGINE_TP_BYTES = GiB  # an engine of tensor parallelism > 1: its communicators' buffers
KEEP_FRACTION = 0.5  # rlhfkit.models.fused_logprobs.KEEP_FRACTION
HEAD_CHUNK_BYTES = GiB  # rlhfkit.models.fused_logprobs.CHUNK_BYTES
TRAINABLE = ("policy", "critic")
COMPONENTS = ("weights", "master", "grads", "optimizer", "activations", "kv_cache", "context")
LABELS = ("weights", "master", "grads", "adam", "activ", "kv", "ctx")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    head_dim: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k
    value_head: bool = False  # critic / reward model: a 1-output score head instead of the LM head
    # a mixture of experts: routed experts per MoE layer (0: a dense model), each expert's intermediate size, the
    # experts a token is routed to, and how many layers keep a dense MLP (e.g. Qwen3-MoE's mlp_only_layers)
    experts: int = 0
    expert_intermediate: int = 0
    experts_per_token: int = 0
    dense_layers: int = 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def _attention_linear(self) -> int:
        h, q, kv = self.hidden, self.heads * self.hd, self.kv_heads * self.hd
        return 2 * h * q + 2 * h * kv

    def _layer_rest(self) -> int:
        """A layer's norms and attention biases."""
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        return 2 * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0) + (2 * self.hd if self.qk_norm else 0)

    def layer_params(self, moe: bool = False) -> int:
        """A dense layer's parameters; `moe`: a MoE layer's (the router and every expert's gate, up and down in
        place of the dense MLP)."""
        h = self.hidden
        mlp = self.experts * (h + 3 * h * self.expert_intermediate) if moe else 3 * h * self.intermediate
        return self._attention_linear() + mlp + self._layer_rest()

    def largest_layer_params(self) -> int:
        return max(self.layer_params(), self.layer_params(moe=True)) if self.moe_layers else self.layer_params()

    def root_params(self) -> int:
        head = self.hidden if self.value_head else (0 if self.tied else self.vocab * self.hidden)
        return self.vocab * self.hidden + self.hidden + head

    def num_params(self) -> int:
        dense = self.layers - self.moe_layers
        return dense * self.layer_params() + self.moe_layers * self.layer_params(moe=True) + self.root_params()

    def linear_params(self) -> int:
        """The blocks' linear layers (q, k, v, o, and a dense MLP's gate, up, down): what --load_in_4bit quantizes
        (a MoE layer's router and experts are not linear layers: they stay in the compute dtype)."""
        dense = self.layers - self.moe_layers
        return self.layers * self._attention_linear() + dense * 3 * self.hidden * self.intermediate

    def base_bytes(self, b: int, four_bit: bool) -> int:
        """A frozen base's bytes: every parameter in b bytes, or the linear weights in NF4 (--load_in_4bit)."""
        p = self.num_params()
        return int(NF4_BYTES * self.linear_params()) + b * (p - self.linear_params()) if four_bit else b * p

    def lora_params(self, rank: int) -> int:
        """Adapter parameters of rank `rank` on every linear layer of the blocks (--target_modules all-linear;
        a MoE layer's experts are not linear layers)."""
        h, q, kv, i = self.hidden, self.heads * self.hd, self.kv_heads * self.hd, self.intermediate
        dense = self.layers - self.moe_layers
        return rank * (self.layers * ((h + q) * 2 + (h + kv) * 2) + dense * (h + i) * 3)

    def lora_pack_params(self, rank: int) -> int:
        """What an engine serving those adapters unmerged holds of its own (rollout weights.LoraPack): the A
        of each tensor's parts stacked, and their B on the tensor's rows and every part's rank columns."""
        h, q, kv, i = self.hidden, self.heads * self.hd, self.kv_heads * self.hd, self.intermediate
        attention = rank * (3 * h + q) + 3 * rank * (q + 2 * kv) + rank * h
        mlp = rank * (2 * h + i) + 2 * rank * 2 * i + rank * h
        return self.layers * attention + (self.layers - self.moe_layers) * mlp

    def activation_bytes_per_token_layer(self, b: int, compiled: bool = False) -> int:
        """A layer's saved activations a token (the larger of a dense and a MoE layer's): a MoE layer keeps each
        routed copy of the token (its input and output, gate, up, act(gate), act(gate) * up) and the router's
        logits."""
        h, q, kv = self.hidden, self.heads * self.hd, self.kv_heads * self.hd
        norms = 2 * 4 if compiled else 16 * h  # two RMSNorms: a fused kernel's fp32 scale, or eager's fp32 copies
        mlp = 4 * self.intermediate if self.moe_layers < self.layers else 0
        if self.moe_layers:
            mlp = max(mlp, self.experts_per_token * (2 * h + 4 * self.expert_intermediate) + self.experts)
        return norms + b * (2 * h + 3 * q + 3 * kv + mlp)

    @classmethod
    def from_config(cls, cfg: Any, value_head: bool = False) -> "ModelShape":
        """From a Hugging Face config (object or dict) of a Llama / Qwen2 / Qwen3 / Mistral-like model, dense or
        a mixture of experts (Qwen3-MoE, Mixtral: routed experts of `moe_intermediate_size`, else
        `intermediate_size`); a vision-language model's language model (its `text_config`; the vision tower is
        not counted)."""
        get: Callable[..., Any] = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        if get("vision_config", None) is not None and get("text_config", None) is not None:
            return cls.from_config(get("text_config"), value_head)
        kind = get("model_type", "")
        bias = get("attention_bias", None)
        heads = get("num_attention_heads")
        layers = get("num_hidden_layers")
        experts = get("num_experts", None) or get("num_local_experts", None) or 0
        return cls(hidden=get("hidden_size"), layers=layers, heads=heads,
                   kv_heads=get("num_key_value_heads", None) or heads, intermediate=get("intermediate_size"),
                   vocab=get("vocab_size"), tied=bool(get("tie_word_embeddings", False)),
                   head_dim=get("head_dim", None),
                   qkv_bias=bool(bias) if bias is not None else kind in ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text"),
                   qk_norm=kind in ("qwen3", "qwen3_vl_text", "qwen3_moe"), value_head=value_head,
                   experts=experts,
                   expert_intermediate=(get("moe_intermediate_size", None) or get("intermediate_size")) if experts else 0,
                   experts_per_token=(get("num_experts_per_tok", None) or 0) if experts else 0,
                   dense_layers=len(get("mlp_only_layers", None) or []) if experts else 0)


@dataclass(frozen=True)
class RoleMemory:
    name: str  # policy | ref | critic | reward
    shape: ModelShape
    world: int  # ranks of the group, one GPU each


@dataclass(frozen=True)
class EngineMemory:
    shape: ModelShape
    num_engines: int
    max_num_seqs: int
    max_model_len: int
    tp: int = 1
    kind: str = "builtin"  # builtin | hf | vllm
    gpu_memory_utilization: float = 0.9
    shares_weights: bool = False  # train_ppo's builtin engine serving the policy's own weights (--engine_weights)


@dataclass(frozen=True)
class MemoryInputs:
    roles: tuple[RoleMemory, ...]
    engine: EngineMemory | None = None
    param_bytes: int = 2
    zero_stage: int = default_of(BackendFlags, "zero_stage")
    adam_offload: bool = default_of(BackendFlags, "adam_offload")
    gradient_checkpointing: bool = default_of(ModelFlags, "gradient_checkpointing")
    torch_compile: bool = default_of(ModelFlags, "torch_compile")  # the trained models' blocks compiled
    train_tokens: int = 2048
    forward_tokens: int = 2048
    colocate_all: bool = False
    colocate_actor_ref: bool = default_of(PlacementFlags, "colocate_actor_ref")
    colocate_critic_reward: bool = default_of(PlacementFlags, "colocate_critic_reward")
    engine_sleep: bool = False
    train_sleep: bool = False
    # trainable roles train adapters of this rank over a frozen base (--lora_rank)
    lora_rank: int = default_of(ModelFlags, "lora_rank")
    load_in_4bit: bool = default_of(ModelFlags, "load_in_4bit")  # the policy's, a reference's and a critic's base in NF4
    # (--optim, --master_weights) of the policy and of the critic (--critic_optim, --critic_master_weights)
    optimizers: tuple[tuple[str, str, str], ...] = (("policy", "adam", "fp32"), ("critic", "adam", "fp32"))
    local: bool = False  # train_ppo: every role and the engine in each rank's process (no Ray pools; only the engine sleeps)


@dataclass
class PoolPlan:
    name: str
    gpus: int
    members: list[str]
    parts: dict[str, dict[str, int]] = field(default_factory=dict)  # member -> component -> bytes (active)
    phases: dict[str, int] = field(default_factory=dict)
    optional: dict[str, int] = field(default_factory=dict)  # phase -> the head's kept logits, when room

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def expected_peak(self) -> int:
        """The peak with what the phases may take when there is room (what a GPU shows)."""
        return max(v + self.optional.get(k, 0) for k, v in self.phases.items())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])


@dataclass
class MemoryPlan:
    pools: list[PoolPlan]

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.pools)

    def table(self, device_bytes: int | None = None) -> str:
        def g(n: int) -> str:
            return f"{n / GiB:.1f}" if n else "-"

        lines = ["memory plan per GPU (GiB, estimate; rlhfkit/distributed/memory_plan.py)"]
        for p in self.pools:
            lines.append(f" pool {p.name}: {p.gpus} GPU(s) x [{', '.join(p.members)}]")
            lines.append("   " + f"{'':8}" + "".join(f"{c:>8}" for c in LABELS))
            for m, parts in p.parts.items():
                lines.append("   " + f"{m:8}" + "".join(f"{g(parts.get(c, 0)):>8}" for c in COMPONENTS))
            of = f" of {device_bytes / GiB:.1f}" if device_bytes else ""
            phases = " | ".join(f"{k} {v / GiB:.1f}" for k, v in p.phases.items())
            more = (f"; up to {p.expected_peak / GiB:.1f} keeping the head's logits when there is room"
                    if p.expected_peak > p.peak else "")
            lines.append(f"   phases: {phases} -> peak {p.peak / GiB:.1f}{of} GiB ({p.peak_phase}){more}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- one member's footprint


def _role_parts(r: RoleMemory, x: MemoryInputs) -> tuple[dict[str, int], dict[str, int]]:
    """(resident between its calls, active while it runs) component bytes on one of its GPUs."""
    P, b, s = r.shape.num_params(), x.param_bytes, r.shape
    S = r.world if x.zero_stage >= 1 else 1
    act_layer = s.activation_bytes_per_token_layer(b)
    head = min(HEAD_CHUNK_BYTES, x.forward_tokens * s.vocab * b)
    forward_act = x.forward_tokens * act_layer + head
    if r.name == "reward":
        return {"weights": b * P}, {"weights": b * P, "activations": forward_act}
    gathered = b * P if x.zero_stage < 3 else b * (s.root_params() + 2 * s.largest_layer_params())
    four_bit = x.load_in_4bit and r.name in ("policy", "ref", "critic")
    dequantized = b * s.hidden * s.intermediate if four_bit else 0  # one linear weight at a time, while it runs
    if four_bit:
        gathered = s.base_bytes(b, True)
    if r.name not in TRAINABLE:  # ref
        if four_bit:  # a 4-bit base is held whole
            held = gathered
        else:
            held = b * P if x.zero_stage < 3 or r.world == 1 else b * (P // S + s.root_params())
        return {"weights": held}, {"weights": max(held, gathered) + dequantized, "activations": forward_act}
    tokens = x.train_tokens
    train_layer = s.activation_bytes_per_token_layer(b, compiled=x.torch_compile)  # forwards above run eager
    if x.gradient_checkpointing:
        train_act = tokens * (s.layers * b * s.hidden + 2 * train_layer)
    else:
        train_act = tokens * (s.layers + 1) * train_layer
    train_act += min(HEAD_CHUNK_BYTES, tokens * s.vocab * b)
    host = x.adam_offload
    wb, ob = _optimizer_bytes(r.name, x)  # bytes a trainable parameter: stored weight (= its gradient), state
    if x.lora_rank > 0:  # (a trainable role) a frozen base in the compute dtype (or NF4) + the adapters
        n = s.lora_params(x.lora_rank)
        base = s.base_bytes(b, four_bit) // S
        resident = {"weights": base, "master": 0 if host else int(wb * n) // S,
                    "optimizer": 0 if host else int(ob * n) // S}
        return resident, {**resident, "weights": max(base, gathered) + dequantized,
                          "grads": 0 if host else int(wb * n) // S, "activations": train_act}
    if r.world == 1 and not host:  # one process: bf16 module + fp32 masters, or the bf16 weights alone
        resident = {"weights": b * P if wb == 4 else 0, "master": int(wb * P), "optimizer": int(ob * P)}
        return resident, {**resident, "grads": int(wb * P), "activations": train_act}
    vocab_grad = b * s.vocab * s.hidden if r.world > 1 else 0
    resident = {"master": 0 if host else int(wb * P) // S, "optimizer": 0 if host else int(ob * P) // S}
    return resident, {**resident, "weights": gathered, "grads": (0 if host else int(wb * P) // S) + vocab_grad,
                      "activations": train_act}


def _optimizer_bytes(role: str, x: MemoryInputs) -> tuple[float, float]:
    """(bytes of a stored trainable weight, and of its gradient; optimizer state bytes) a parameter:
    fp32 masters 4, bf16 weights 2 (--master_weights bf16_*); AdamW's moments 8, 8-bit ones 2 + 8 / 256
    (--optim adamw_8bit: a byte each and an fp32 maximum per 256 values), + 2 for bf16_kahan's compensation
    (rlhfkit/backend/lean_adamw.py)."""
    optim, weights = next(((o, w) for name, o, w in x.optimizers if name == role), ("adam", "fp32"))
    wb = 4.0 if weights == "fp32" else 2.0
    ob = (2.0 + 8.0 / QUANT_BLOCK if optim == "adamw_8bit" else 8.0) + (2.0 if weights == "bf16_kahan" else 0.0)
    return wb, ob


def _kept_logits(r: RoleMemory, x: MemoryInputs) -> int:
    """Bytes the fused head keeps beyond its chunk when memory allows: a micro-batch's whole logits."""
    t, s = x.train_tokens, r.shape
    return max(0, t * s.vocab * x.param_bytes - min(HEAD_CHUNK_BYTES, t * s.vocab * x.param_bytes))


def _context(member: str, x: MemoryInputs, roles: dict[str, RoleMemory]) -> int:
    if member == "engine":
        assert x.engine is not None  # a pool holds an engine only when there is one
        return CONTEXT_BYTES + ENGINE_WORKSPACE_BYTES + (ENGINE_TP_BYTES if x.engine.tp > 1 else 0)
    return CONTEXT_SHARDED_BYTES if roles[member].world > 1 else CONTEXT_BYTES


def _engine_parts(e: EngineMemory, b: int, device_bytes: int | None,
                  lora_rank: int, four_bit: bool = False) -> tuple[dict[str, int], dict[str, int]]:
    """(asleep, awake) component bytes on one GPU of an engine (`lora_rank`: the policy's adapters, which an
    engine sharing its weights serves packed; `four_bit`: the shared base is NF4, dequantized a layer at a
    time into one layer's projections)."""
    s = e.shape
    weights = b * s.lora_pack_params(lora_rank) if e.shares_weights else b * s.num_params() // e.tp
    if e.shares_weights and four_bit:
        weights += b * s.linear_params() // s.layers
    kv = 2 * s.layers * e.max_num_seqs * math.ceil(s.kv_heads / e.tp) * e.max_model_len * s.hd * b
    if e.kind == "vllm" and device_bytes:
        kv = max(kv, int(e.gpu_memory_utilization * device_bytes) - weights)
    asleep = {"weights": weights} if e.kind == "builtin" else {}
    return asleep, {"weights": weights, "kv_cache": kv}


# ----------------------------------------------------------------------------- pools and phases


def _pools(x: MemoryInputs) -> list[tuple[str, int, list[str]]]:
    """(name, GPUs, members) as rlhfkit.distributed.placement.plan_pools lays them out."""
    roles = {r.name: r for r in x.roles}
    engine_gpus = x.engine.num_engines * x.engine.tp if x.engine else 0
    if x.colocate_all:
        return [("all", roles["policy"].world, [*roles, *(["engine"] if x.engine else [])])]
    pools, done = [], set()
    for a, c, on in (("policy", "ref", x.colocate_actor_ref), ("critic", "reward", x.colocate_critic_reward)):
        if on and a in roles and c in roles:
            pools.append((f"{a}+{c}", roles[a].world, [a, c]))
            done |= {a, c}
    pools += [(n, r.world, [n]) for n, r in roles.items() if n not in done]
    if x.engine:
        pools.append(("engines", engine_gpus, ["engine"]))
    return pools


def _sum(*parts: dict[str, int]) -> int:
    return sum(v for p in parts for v in p.values())


def plan_memory(x: MemoryInputs, device_bytes: int | None = None) -> MemoryPlan:
    """The plan of `x`; `device_bytes` (one GPU's memory) sizes a vllm engine's reservation and the
    head's kept logits (`PoolPlan.optional`)."""
    roles = {r.name: r for r in x.roles}
    out = []
    for name, gpus, members in _pools(x):
        pool = PoolPlan(name, gpus, members)
        ctx = sum(_context(m, x, roles) for m in members)
        rest, active = {}, {}
        for m in members:
            if m == "engine":
                assert x.engine is not None
                asleep, awake = _engine_parts(x.engine, x.param_bytes, device_bytes, x.lora_rank, x.load_in_4bit)
                pool.parts[m] = {**awake, "context": _context(m, x, roles)}
            else:
                rest[m], active[m] = _role_parts(roles[m], x)
                pool.parts[m] = {**active[m], "context": _context(m, x, roles)}

        def resident(but: str | None) -> int:
            return 0 if x.train_sleep else sum(_sum(v) for k, v in rest.items() if k != but)

        if "engine" in members:
            pool.phases["generate"] = _sum(awake) + resident(None) + ctx
        for m in active:
            eng = (_sum(asleep) if x.engine_sleep else _sum(awake)) if "engine" in members else 0
            pool.phases[m] = _sum(active[m]) + resident(m) + eng + ctx
            if m in TRAINABLE and device_bytes:
                free = max(0, device_bytes - pool.phases[m])
                whole = x.train_tokens * roles[m].shape.vocab * x.param_bytes
                pool.optional[m] = _kept_logits(roles[m], x) if whole <= KEEP_FRACTION * free else 0
        out.append(pool)
    return MemoryPlan(out)


# ----------------------------------------------------------------------------- the check


def _candidates(x: MemoryInputs) -> list[tuple[str, MemoryInputs]]:
    """Single flag changes that lower the plan, as (flag, inputs with it)."""
    out: list[tuple[str, MemoryInputs]] = []
    if not x.adam_offload:  # the policy's weights become sharded: an engine no longer shares them
        eng = replace(x.engine, shares_weights=False) if x.engine else None
        out.append(("--adam_offload", replace(x, adam_offload=True, engine=eng)))
    if not x.gradient_checkpointing:
        out.append(("--gradient_checkpointing", replace(x, gradient_checkpointing=True)))
    shared = x.colocate_all or x.colocate_actor_ref or x.colocate_critic_reward
    if x.engine and x.colocate_all and not x.engine_sleep:
        out.append(("--vllm_enable_sleep", replace(x, engine_sleep=True)))
    if shared and not x.train_sleep and not x.local:
        out.append(("--deepspeed_enable_sleep", replace(x, train_sleep=True)))
    if x.zero_stage < 3 and any(r.world > 1 for r in x.roles):
        out.append(("--zero_stage 3", replace(x, zero_stage=3)))
    pol = next((o for o in x.optimizers if o[0] == "policy"), ("policy", "adam", "fp32"))
    if pol[1] == "adam":
        out.append(("--optim adamw_8bit", replace(x, optimizers=((*pol[:1], "adamw_8bit", pol[2]),
                                                                 *(o for o in x.optimizers if o[0] != "policy")))))
    if pol[2] == "fp32" and x.param_bytes == 2:
        out.append(("--master_weights bf16_stochastic",
                    replace(x, optimizers=((*pol[:2], "bf16_stochastic"),
                                           *(o for o in x.optimizers if o[0] != "policy")))))
    if x.engine and x.engine.max_num_seqs > 1:
        n = x.engine.max_num_seqs // 2
        out.append((f"--rollout_max_num_seqs {n}", replace(x, engine=replace(x.engine, max_num_seqs=n))))
    more = tuple(replace(r, world=2 * r.world) for r in x.roles)
    eng = replace(x.engine, num_engines=2 * x.engine.num_engines) if x.engine and x.colocate_all else x.engine
    policy = next(r for r in x.roles if r.name == "policy")
    if x.local:  # torchrun ranks: the policy becomes sharded, so an engine no longer shares its weights
        eng = replace(eng, shares_weights=False) if eng else None
        out.append((f"more GPUs (torchrun --nproc_per_node {2 * policy.world})", replace(x, roles=more, engine=eng)))
    else:
        out.append((f"more GPUs (--actor_num_gpus_per_node {2 * policy.world}, the other groups alike)",
                    replace(x, roles=more, engine=eng)))
    return out


def over_budget(x: MemoryInputs, device_bytes: int) -> str | None:
    """None when every pool's peak fits `device_bytes`; else what is over and which flags would fit."""
    plan = plan_memory(x, device_bytes)
    over = [p for p in plan.pools if p.peak > device_bytes]
    if not over:
        return None
    worst = max(over, key=lambda p: p.peak)
    fits: list[str] = []
    others: list[str] = []
    for flag, y in _candidates(x):
        peak = plan_memory(y, device_bytes).peak
        (fits if peak <= device_bytes else others).append(f"{flag} ({peak / GiB:.1f} GiB)")
    msg = (f"the memory plan needs about {worst.peak / GiB:.1f} GiB per GPU in pool {worst.name} "
           f"({worst.peak_phase}) but the GPU has {device_bytes / GiB:.1f} GiB")
    if fits:
        rest = f"; not enough alone: {', '.join(others)}" if others else ""
        return msg + "; it would fit with " + ", or ".join(fits) + rest
    return msg + "; no single change fits (" + ", ".join(others) + "): combine them or use more GPUs"


# ----------------------------------------------------------------------------- a hint: larger micro-batches

HINT_MAX_TOKENS = 32768  # past this a micro-batch gains little, and a GPU's memory swings more per step
HINT_FRACTION = 0.85  # the hint keeps the plan this far inside the GPU (the plan is an estimate)


def larger_train_tokens(x: MemoryInputs, device_bytes: int, fraction: float = HINT_FRACTION,
                        cap: int = HINT_MAX_TOKENS) -> int | None:
    """The largest power of two of tokens per micro-batch (training and experience making alike, as
    --use_dynamic_batch --train_max_tokens_per_gpu T gives) that is at least twice `x.train_tokens`, at most
    `cap`, and whose plan stays within `fraction` of `device_bytes`; None when there is none."""
    best, t = None, 1 << (2 * x.train_tokens - 1).bit_length()
    while t <= cap:
        if plan_memory(replace(x, train_tokens=t, forward_tokens=t), device_bytes).peak > fraction * device_bytes:
            break
        best, t = t, 2 * t
    return best

