"""torchrun worker of test_context_parallel.py: SFT, DPO, RL and critic passes with ring attention.

    torchrun --nproc_per_node W cp_worker.py --model DIR --cp C --out FILE.pt [--break WHAT]

The mesh is dp = W / C x cp = C (C = 1, W = 1: one process, no process group, the reference). Every
case builds fresh backends from the same weights and runs the same global batch (each dp rank its
share; the cp ranks of a dp rank the same rows), and rank 0 saves with torch.save:

  sft_padded / sft_packed / dpo / dpo_packed: the loss and every parameter's full gradient after one
      backward (summed over the dp ranks: that is what the optimizer steps with)
  rl / rl_packed: ActorRole.forward_logprobs of the rollout, its entropy (backend.token_logprobs), and
      the metrics and full weights after a PPO step (entropy bonus on, 4 micro-batches over the dp ranks)
  critic: CriticRole.forward_values, a reward-model score on left-padded rows, and the metrics and
      weights after a clipped value-loss step
  sft_loop: the offline loop's step metrics (loss group reductions) and eval loss
  sft_aux (mixture-of-experts models, not by default): the router loss, equal on the cp ranks

`--break shift` moves the targets by one token after the split (the mistake of shifting per shard);
`--break grad` shards FSDP over dp only, so the cp ranks' partial gradients are never summed. Both
must make the test's comparisons fail.
"""

from __future__ import annotations

import argparse

import torch

from rlhfkit.algo.advantages import AdvantageConfig
from rlhfkit.algo.experience import finish_experience
from rlhfkit.backend import FSDP2Backend
from rlhfkit.parallel import context_parallel, init_distributed
from rlhfkit.parallel.mesh import ParallelDims, attach_mesh
from rlhfkit.parallel.sharding import full
from rlhfkit.config.configs import BackendConfig, ModelConfig, OptimConfig
from rlhfkit.data.items import PreferenceItem, SFTItem
from rlhfkit.losses.policy import PolicyLossConfig
from rlhfkit.models.loader import load_causal_lm
from rlhfkit.models.value import load_value_model, reward_at_last_token
from rlhfkit.roles.actor import ActorRole, UpdateConfig
from rlhfkit.roles.critic import CriticRole
from rlhfkit.trainers.dpo_task import DPOTask, FrozenModel
from rlhfkit.trainers.metrics import NullLogger
from rlhfkit.trainers.offline import LoopConfig, evaluate, train_offline
from rlhfkit.trainers.sft_task import SFTTask
from rlhfkit.types import ExperienceBatch

ROWS, SEQ, PROMPT = 4, 13, 4


def items(vocab: int, n: int, seed: int) -> list[SFTItem]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(PROMPT + 2, SEQ + 1, (), generator=g))
        out.append(SFTItem(input_ids=torch.randint(6, vocab, (k,), generator=g).tolist(),
                           loss_mask=[0] * PROMPT + [1] * (k - PROMPT)))
    return out


def pairs(vocab: int) -> list[PreferenceItem]:
    a, b = items(vocab, ROWS, 11), items(vocab, ROWS, 12)
    return [PreferenceItem(x.input_ids, x.loss_mask, y.input_ids, y.loss_mask) for x, y in zip(a, b)]


def rollout(vocab: int) -> ExperienceBatch:
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(PROMPT + 2, SEQ + 1, (ROWS,), generator=g)
    attn = (torch.arange(SEQ)[None, :] < lens[:, None]).long()
    ids = torch.randint(6, vocab, (ROWS, SEQ), generator=g) * attn
    loss_mask = attn.clone()
    loss_mask[:, :PROMPT] = 0
    return ExperienceBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, rewards=torch.randn(ROWS, generator=g))


class Run:
    def __init__(self, a, dist, dims):
        self.a, self.dist, self.dims = a, dist, dims

    def backend(self, lr=1e-2, trainable=True, value=False):
        if value:
            torch.manual_seed(1)  # the new value head's init: the same in every run
            model = load_value_model(self.a.model, init_value_head=True, dtype=torch.float32)
        else:
            model = load_causal_lm(ModelConfig(pretrain=self.a.model), master_dtype="fp32")
        cfg = BackendConfig(param_dtype="fp32", zero_stage=2, ring_head_stride=self.a.head_stride)
        return FSDP2Backend(model, cfg, OptimConfig(learning_rate=lr) if trainable else None, 10, self.dist,
                            parallel=self.dims)

    def share(self, seq):
        per = len(seq) // self.dist.dp_size
        return seq[self.dist.dp_rank * per:(self.dist.dp_rank + 1) * per]

    def loss_and_grads(self, task, backend, batch, count):
        loss, _ = task.loss(backend.model, batch, count)
        backend.backward(loss)
        total = self.dist.all_reduce_dp(loss.detach().double())
        grads = {n: full(p.grad).detach().clone() for n, p in backend.model.named_parameters()}
        return {"loss": float(total), "grads": grads}

    def sft(self, packing):
        backend = self.backend()
        vocab = backend.unwrap().config.vocab_size
        task = SFTTask(pad_token_id=0, packing=packing, dist=self.dist)
        batch = task.collate(self.share(items(vocab, ROWS, 3)))
        count = float(self.dist.all_reduce_dp(torch.tensor(task.count(batch), dtype=torch.float64)))
        return self.loss_and_grads(task, backend, batch, count)

    def sft_aux(self):
        """A mixture-of-experts router loss (--aux_loss_coef): the same value on the cp ranks of a dp rank."""
        from rlhfkit.models.moe import RouterAuxLoss

        backend = self.backend()
        task = SFTTask(pad_token_id=0, dist=self.dist)
        batch = task.collate(self.share(items(backend.unwrap().config.vocab_size, ROWS, 3)))
        with RouterAuxLoss(backend.model) as router:
            loss, _ = task.loss(backend.model, batch, 1.0)
        aux = router.take()
        (loss + 0.01 * aux).backward()
        value = float(aux.detach())
        peer = self.dist.broadcast_replica(value)
        assert peer == value, (self.dist.rank, peer, value)
        return {"aux": value}

    def dpo(self, packing):
        backend = self.backend()
        vocab = backend.unwrap().config.vocab_size
        task = DPOTask(pad_token_id=0, ref=FrozenModel(self.backend(trainable=False)), beta=0.5, packing=packing,
                       nll_loss_coef=0.3, dist=self.dist)
        batch = task.collate(self.share(pairs(vocab)))
        return self.loss_and_grads(task, backend, batch, float(ROWS))

    def rl(self, packing):
        backend = self.backend(lr=1e-3)
        policy = ActorRole(backend, self.dist, PolicyLossConfig(entropy_coef=0.01),
                           UpdateConfig(train_batch_size=ROWS, micro_train_batch_size=1, seed=1, packing=packing),
                           micro_rollout_batch_size=2, packing=packing)
        batch = self.share_batch(rollout(backend.unwrap().config.vocab_size))
        lp = policy.forward_logprobs(batch)
        with torch.no_grad():
            _, ent = backend.token_logprobs(batch.input_ids, attention_mask=batch.attention_mask, return_entropy=True)
        batch.old_logprobs = lp
        batch, _ = finish_experience(batch, AdvantageConfig(advantage_estimator="reinforce"), 0.0, "k1",
                                     kl_in_reward=False, reduce=self.dist.all_reduce_dp)
        noise = torch.randn((ROWS, SEQ), generator=torch.Generator().manual_seed(7))
        noise = noise[self.dist.dp_rank * batch.batch_size:(self.dist.dp_rank + 1) * batch.batch_size]
        batch.old_logprobs = lp + 0.3 * noise * batch.loss_mask  # off-policy: ratios vary, some are clipped
        metrics = policy.train_on(batch)
        return {"logprobs": self.gather_rows(lp), "entropy": self.gather_rows(ent),
                "metrics": {k: metrics[k] for k in ("policy_loss", "grad_norm", "ppo_clip_ratio") if k in metrics},
                "weights": backend.full_state_dict()}

    def critic(self):
        backend = self.backend(lr=1e-3, value=True)
        critic = CriticRole(backend, self.dist, UpdateConfig(train_batch_size=ROWS, micro_train_batch_size=1, seed=1),
                            value_clip=0.2, micro_rollout_batch_size=2)
        batch = self.share_batch(rollout(backend.unwrap().config.vocab_size))
        values = critic.forward_values(batch)
        left = torch.zeros_like(batch.attention_mask)  # the same rows left-padded
        ids = torch.zeros_like(batch.input_ids)
        for i, n in enumerate(batch.attention_mask.sum(-1).tolist()):
            left[i, SEQ - n:] = 1
            ids[i, SEQ - n:] = batch.input_ids[i, :n]
        with torch.no_grad():
            score = reward_at_last_token(backend.forward(input_ids=ids, attention_mask=left), left)
        batch.values = values
        batch.returns = (values + torch.linspace(-1, 1, SEQ)) * batch.loss_mask  # clipped near both ends
        metrics = critic.train_on(batch)
        return {"values": self.gather_rows(values), "score": self.gather_rows(score),
                "metrics": {k: metrics[k] for k in ("value_loss", "critic_grad_norm")},
                "weights": backend.full_state_dict()}

    def sft_loop(self):
        backend = self.backend()
        data = items(backend.unwrap().config.vocab_size, 8, 4)
        task = SFTTask(pad_token_id=0, dist=self.dist)
        cfg = LoopConfig(train_batch_size=4, micro_train_batch_size=1, max_epochs=1, seed=1, show_progress=False)
        state = train_offline(task, backend, data, cfg, self.dist, NullLogger())
        return {"steps": [{k: r[k] for k in ("train/loss", "train/grad_norm")} for r in state.history],
                "eval": evaluate(task, backend, data[:5], 2, self.dist)["eval/loss"]}

    def share_batch(self, batch):
        per = batch.batch_size // self.dist.dp_size
        return batch.select(list(range(self.dist.dp_rank * per, (self.dist.dp_rank + 1) * per)))

    def gather_rows(self, x):
        if self.dist.dp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.dist.dp_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.dist.dp_group)
        return torch.cat(parts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--head_stride", type=int, default=1)
    p.add_argument("--cases", default="sft_padded,sft_packed,dpo,dpo_packed,rl,rl_packed,critic,sft_loop")
    p.add_argument("--break", dest="broken", default=None, choices=["shift", "grad"])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    dist = init_distributed("cpu")
    dims = ParallelDims(dp_shard=dist.world_size // a.cp, cp=a.cp, world_size=dist.world_size)
    dist = attach_mesh(dist, dims)
    if a.broken == "grad":
        context_parallel.fsdp_mesh = lambda mesh, d: mesh["dp_shard"]
        import rlhfkit.parallel.apply as f

        f.fsdp_mesh_of = context_parallel.fsdp_mesh
    if a.broken == "shift":  # each shard's next token from its own ids: wrong at every shard's end
        context_parallel.next_token_targets = lambda plan: torch.roll(plan.local_ids, -1, dims=1)[0]
    run = Run(a, dist, dims)
    cases = {"sft_padded": lambda: run.sft(False), "sft_packed": lambda: run.sft(True),
             "dpo": lambda: run.dpo(False), "dpo_packed": lambda: run.dpo(True),
             "rl": lambda: run.rl(False), "rl_packed": lambda: run.rl(True),
             "critic": run.critic, "sft_loop": run.sft_loop, "sft_aux": run.sft_aux}
    out = {name: cases[name]() for name in a.cases.split(",")}
    if dist.rank == 0:
        torch.save(out, a.out)


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
