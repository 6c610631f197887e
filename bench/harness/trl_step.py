"""bench/rl_step.py's TRL side: `GRPOTrainer` on the same model, prompts, reward and batch as the rlhfkit
run, timed between consecutive `on_step_end` callbacks, its generation timed around
`_generate_single_turn` (HF `generate`). TRL is imported lazily; see rl_step.py's docstring for the
settings both sides share."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable


def _sync(device: str) -> None:
    from bench.harness.timing import sync

    sync(device)


def run_trl(a: argparse.Namespace, model_dir: str, prompts_text: list[str], reward: str, work: str,
            prompts: int) -> dict:
    """TRL's GRPOTrainer on the same model, prompts, reward and batch; `a.steps + 1` optimizer steps."""
    from bench.harness.models import peak_gib
    from bench.harness.rl_run import load_reward_module, micro
    import datasets
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    gpu = a.device.startswith("cuda")
    total = prompts * a.n
    mb = micro(total, a.trl_micro_train_batch_size or a.micro_train_batch_size)
    digit_fraction = load_reward_module(reward).digit_fraction

    def digit_reward(completions: list[str], **kw: Any) -> list[float]:
        return [digit_fraction(c) for c in completions]

    cfg = trl.GRPOConfig(
        output_dir=os.path.join(work, f"trl_{prompts}"), per_device_train_batch_size=mb,
        gradient_accumulation_steps=total // mb, num_generations=a.n, max_completion_length=a.new_tokens,
        generation_kwargs={"min_new_tokens": a.new_tokens}, temperature=1.0, beta=0.0, num_iterations=1,
        learning_rate=a.lr, max_steps=a.steps + 1, bf16=gpu, use_cpu=not gpu,
        gradient_checkpointing=a.gradient_checkpointing, logging_steps=1, report_to="none", save_strategy="no",
        shuffle_dataset=False, seed=a.seed, disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        model_init_kwargs={"dtype": a.trl_dtype})
    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = datasets.Dataset.from_dict({"prompt": prompts_text[:prompts * (a.steps + 1)]})
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=[digit_reward], args=cfg, train_dataset=ds,
                              processing_class=tok)
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    timer = _TRLTimer(a.device)
    trainer.add_callback(timer.callback(TrainerCallback))
    trainer._generate_single_turn = timer.wrap_generate(trainer._generate_single_turn)
    trainer.train()
    out = timer.summary(total)
    out.update(prompts=prompts, completions=total, optimizer_steps=trainer.state.global_step, model_dtype=a.trl_dtype,
               peak_gpu_gib=peak_gib(a.device), per_device_train_batch_size=mb,
               gradient_accumulation_steps=total // mb, steps_per_generation=cfg.steps_per_generation,
               trl_version=trl.__version__, transformers_version=transformers.__version__)
    del trainer
    return out


class _TRLTimer:
    """Step ends (wall clock, synchronized) and generation times of a TRL run, plus its logs."""

    def __init__(self, device: str) -> None:
        self.device, self.ends, self.gen, self.logs = device, [], [], []

    def callback(self, base: type) -> Any:
        timer = self

        class StepTimer(base):
            def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
                _sync(timer.device)
                timer.ends.append(time.perf_counter())

            def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
                timer.logs.append(dict(logs or {}))

        return StepTimer()

    def wrap_generate(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kw: Any) -> Any:
            _sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            _sync(self.device)
            self.gen.append(time.perf_counter() - t0)
            return out

        return timed

    def summary(self, completions: int) -> dict:
        from bench.harness.timing import mean, median

        steps = [b - e for e, b in zip(self.ends, self.ends[1:])]  # the first step (warm-up) is not timed
        gen = mean(self.gen[1:])
        lengths = [g["completions/mean_length"] for g in self.logs[1:] if "completions/mean_length" in g]
        step = mean(steps)
        resp = mean(lengths)
        return {"framework": "trl", "step_s": step, "step_s_median": median(steps), "step_s_each": steps,
                "generate_s": gen,
                "generate_calls": len(self.gen),
                "generate_share": gen / step if gen and step else None,
                "gen_tokens_per_s": completions * resp / gen if gen and resp else None, "response_length": resp,
                "reward": mean([g["reward"] for g in self.logs[1:] if "reward" in g])}
