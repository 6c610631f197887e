"""torchrun worker of test_mesh_dp.py: SFT steps and an RL step on a (dp x tp) mesh.

    torchrun --nproc_per_node W mesh_dp_worker.py --model DIR --tp T --out FILE

The mesh is dp = W / T (FSDP2 over dp_shard) x tp = T, but the model stays replicated over tp
(`apply_tp` is switched off here only: this test is about the reductions and the data sharding;
test_tensor_parallel.py covers the tensor-parallel layers). The tp ranks of one dp rank must then get the same rows and the same
gradients, so with every reduction over the dp group this run equals a W / T rank pure-DP run.

Rank 0 writes JSON: the SFT loop's per-step metrics and eval loss, the RL step's metrics, the
advantage statistics and a checksum of the final weights of both models; every rank checks that
it agrees with its tp peers.
"""

from __future__ import annotations

import argparse
import json

import torch

from rlhfkit.algo.advantages import AdvantageConfig
from rlhfkit.algo.experience import finish_experience
from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel import apply as parallel_apply, init_distributed
from rlhfkit.parallel.mesh import ParallelDims, attach_mesh
from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig
from rlhfkit.data.items import SFTItem
from rlhfkit.losses.policy import PolicyLossConfig
from rlhfkit.models.loader import load_causal_lm
from rlhfkit.roles.actor import ActorRole, UpdateConfig
from rlhfkit.trainers.metrics import NullLogger
from rlhfkit.trainers.offline import LoopConfig, evaluate, train_offline
from rlhfkit.trainers.sft_task import SFTTask
from rlhfkit.types import ExperienceBatch

SFT_ROWS, RL_ROWS, SEQ, PROMPT = 16, 8, 12, 4


def sft_items(vocab: int) -> list[SFTItem]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(SFT_ROWS):
        n = int(torch.randint(PROMPT + 2, SEQ + 1, (), generator=g))
        ids = torch.randint(6, vocab, (n,), generator=g).tolist()
        out.append(SFTItem(input_ids=ids, loss_mask=[0] * PROMPT + [1] * (n - PROMPT)))
    return out


def rl_batch(vocab: int) -> ExperienceBatch:
    """The global rollout: right-padded rows, response after PROMPT tokens, fixed rewards."""
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(PROMPT + 2, SEQ + 1, (RL_ROWS,), generator=g)
    attn = (torch.arange(SEQ)[None, :] < lens[:, None]).long()
    ids = torch.randint(6, vocab, (RL_ROWS, SEQ), generator=g) * attn
    loss_mask = attn.clone()
    loss_mask[:, :PROMPT] = 0
    rewards = torch.randn(RL_ROWS, generator=g)
    return ExperienceBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, rewards=rewards)


def checksum(backend: FSDP2Backend) -> float:
    sd = backend.full_state_dict()  # every rank gathers, rank 0 holds it
    return float(sum(v.double().abs().sum() for v in sd.values())) if sd else 0.0


def backend_for(model_dir: str, dist, dims: ParallelDims, lr: float = 1e-2) -> FSDP2Backend:
    model = load_causal_lm(ModelConfig(pretrain=model_dir), master_dtype="fp32")
    return FSDP2Backend(model, BackendConfig(param_dtype="fp32", zero_stage=2), OptimConfig(learning_rate=lr), 10,
                        dist, parallel=dims)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    dist = init_distributed("cpu")
    dims = ParallelDims(dp_shard=dist.world_size // a.tp, tp=a.tp, world_size=dist.world_size)
    parallel_apply.apply_tp = lambda model, mesh: model  # replicated over tp: see the module docstring
    dist = attach_mesh(dist, dims)
    assert (dist.dp_rank, dist.dp_size) == (dist.rank // a.tp, dims.dp), (dist.rank, dist.dp_rank, dist.dp_size)

    # ---- SFT: the offline loop (sampling, global token count, metric sums) + evaluation
    backend = backend_for(a.model, dist, dims)
    vocab = backend.unwrap().config.vocab_size
    items = sft_items(vocab)
    task = SFTTask(pad_token_id=0, dist=dist)
    cfg = LoopConfig(train_batch_size=8, micro_train_batch_size=2, max_epochs=1, seed=1, show_progress=False)
    state = train_offline(task, backend, items, cfg, dist, NullLogger())
    sft = [{k: r[k] for k in ("train/loss", "train/grad_norm") if k in r} for r in state.history]
    sft_eval = evaluate(task, backend, items[:7], 2, dist)
    sft_sum = checksum(backend)

    # ---- RL: old log-probs, REINFORCE++ batch whitening over dp, PPO updates on two mini-batches
    policy = ActorRole(backend_for(a.model, dist, dims, lr=1e-3), dist, PolicyLossConfig(),
                       UpdateConfig(train_batch_size=RL_ROWS // 2, micro_train_batch_size=2, seed=1),
                       micro_rollout_batch_size=2)
    full = rl_batch(vocab)
    per = RL_ROWS // dist.dp_size
    batch = full.select(list(range(dist.dp_rank * per, (dist.dp_rank + 1) * per)))
    batch.old_logprobs = policy.forward_logprobs(batch)
    batch, exp_m = finish_experience(batch, AdvantageConfig(advantage_estimator="reinforce"), 0.0, "k1",
                                     kl_in_reward=False, reduce=dist.all_reduce_dp)
    adv = batch.advantages * batch.loss_mask
    adv_stats = dist.all_reduce_dp(torch.tensor([float(adv.sum()), float((adv ** 2).sum())], dtype=torch.float64))
    rl = policy.train_on(batch)
    rl_sum = checksum(policy.backend)

    mine = {"sft": sft, "sft_eval": sft_eval, "rl": {k: rl[k] for k in ("policy_loss", "grad_norm", "ppo_clip_ratio")
                                                      if k in rl},
            "adv": adv_stats.tolist(), "sft_weights": sft_sum, "rl_weights": rl_sum}
    # tp peers hold the same rows: their metrics must agree exactly with their group's first rank
    peer = dist.broadcast_replica(mine)
    for k in ("sft", "sft_eval", "rl", "adv"):
        assert peer[k] == mine[k], (dist.rank, k, peer[k], mine[k])
    if dist.rank == 0:
        with open(a.out, "w") as f:
            json.dump(mine, f)


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
