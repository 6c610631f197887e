"""Small datasets for the README's and docs/' commands: `rlhfkit make_data KIND [KIND ...] --out data/`.

    rlhfkit make_data addition preference --out data/      # == python -m rlhfkit.cli.make_data ...

Every row is built from the quickstart's task (`rlhfkit.tasks.addition`: "57+68=" -> the sum,
written least-significant digit first unless --plain_order, "521"), so the tiny model learns
from them on a CPU. The same --seed writes the same files. Kinds and the files they write:

  addition    train.jsonl (SFT: input, output, label), prompts.jsonl (RL prompts: input, label),
              eval.jsonl (held-out questions never in train.jsonl: input, output, label)
  preference  preference.jsonl, preference_eval.jsonl (RM / DPO pairs: prompt, chosen, rejected;
              chosen is the right sum, rejected a wrong one)
  kto         kto.jsonl (unpaired: input, output, label true for a right sum / false for a wrong one)
  prm         prm.jsonl (process rewards: input "a+b=c#d+e=f#", value one "+" / "-" per step;
              train_prm --placeholder_token '#' --reward_tokens + -)
  chat        chat.jsonl (messages: a user question and the assistant's answer, for
              --apply_chat_template / --multiturn)
  shapes      pictures for vision-language models (rlhfkit.tasks.shapes: "What colour is the
              background?", answered by the picture alone), under shapes/, and shapes_train.jsonl (SFT:
              prompt, images, output, label; --num_train rows), shapes_prompts.jsonl (RL prompts;
              --num_prompts), shapes_eval.jsonl (held-out pictures; --num_eval) and
              shapes_preference.jsonl (DPO: prompt, images, chosen, rejected; --num_pairs)
  examples    the shipped reward and agent files (rlhfkit.examples: reward_func.py, agent_func.py, ...)
  all         every data kind above but shapes (not examples)

Nothing here imports torch: it takes about as long as Python's start (shapes draws its pictures
with Pillow).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import random
from typing import Callable

from rlhfkit.config.flags import FlagParser, add_arithmetic_flags, add_seed_flag

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # also when run as __main__

KINDS = ("addition", "preference", "kto", "prm", "chat", "shapes", "examples")
NOT_IN_ALL = ("shapes", "examples")


def build_parser() -> FlagParser:
    p = FlagParser("make_data", __doc__ or "")
    p.add_argument("kinds", nargs="*", metavar="KIND",  # checked in main (argparse rejects an empty list with choices)
                   help=f"what to write: {', '.join(KINDS)}, or all (every data kind but shapes)")
    p.flag("--out", type=str, default="data", help="folder the files go to (made if missing)")
    add_seed_flag(p, "the same seed writes the same rows")
    add_arithmetic_flags(p)
    p.flag("--num_prompts", type=int, default=256, help="RL prompts in prompts.jsonl (taken from the train questions)")
    p.set_defaults(seed=0)
    p.flag("--num_pairs", type=int, default=256, help="rows in preference.jsonl, kto.jsonl, prm.jsonl and chat.jsonl")
    return p


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


class Maker:
    """Rows for each kind, all drawn from one train / held-out split of addition questions."""

    def __init__(self, args) -> None:
        from rlhfkit.tasks.addition import addition_splits

        self.args = args
        self.train, self.held = addition_splits(args.num_train, args.num_eval, args.digits, seed=args.seed,
                                                reverse_answer=not args.plain_order)
        self.rng = random.Random(args.seed + 1)

    def wrong(self, answer: str) -> str:
        """A wrong answer of the same form (same digit order) as `answer`."""
        value = int(answer[::-1] if not self.args.plain_order else answer)
        while True:
            w = max(0, value + self.rng.choice([-10, -2, -1, 1, 2, 10]))
            if w != value:
                text = str(w)
                return text[::-1] if not self.args.plain_order else text

    def pairs(self, rows: list[dict]) -> list[dict]:
        return [{"prompt": r["input"], "chosen": r["output"], "rejected": self.wrong(r["output"])} for r in rows]

    def addition(self, out: str) -> list[str]:
        prompts = [{"input": r["input"], "label": r["label"]} for r in self.train[:self.args.num_prompts]]
        return [write_jsonl(os.path.join(out, "train.jsonl"), self.train),
                write_jsonl(os.path.join(out, "prompts.jsonl"), prompts),
                write_jsonl(os.path.join(out, "eval.jsonl"), self.held)]

    def preference(self, out: str) -> list[str]:
        return [write_jsonl(os.path.join(out, "preference.jsonl"), self.pairs(self.train[:self.args.num_pairs])),
                write_jsonl(os.path.join(out, "preference_eval.jsonl"), self.pairs(self.held))]

    def kto(self, out: str) -> list[str]:
        rows = []
        for i, r in enumerate(self.train[:self.args.num_pairs]):
            good = i % 2 == 0
            rows.append({"input": r["input"], "output": r["output"] if good else self.wrong(r["output"]),
                         "label": good})
        return [write_jsonl(os.path.join(out, "kto.jsonl"), rows)]

    def prm(self, out: str) -> list[str]:
        rows = []
        for i in range(self.args.num_pairs):
            steps = [self.train[(2 * i + k) % len(self.train)] for k in range(1 + i % 2)]
            text, labels = "", []
            for r in steps:
                ok = self.rng.random() < 0.5
                text += f"{r['input']}{r['output'] if ok else self.wrong(r['output'])}#"
                labels.append("+" if ok else "-")
            rows.append({"input": text, "value": labels})
        return [write_jsonl(os.path.join(out, "prm.jsonl"), rows)]

    def chat(self, out: str) -> list[str]:
        rows = [{"messages": [{"role": "user", "content": r["input"]}, {"role": "assistant", "content": r["output"]}]}
                for r in self.train[:self.args.num_pairs]]
        return [write_jsonl(os.path.join(out, "chat.jsonl"), rows)]

    def shapes(self, out: str) -> list[str]:
        from rlhfkit.tasks.shapes import shapes_rows, wrong_colour

        a, seed = self.args, self.args.seed
        train = shapes_rows(a.num_train, out, "train", seed)
        held = shapes_rows(a.num_eval, out, "eval", seed + 10_007)
        prompts = [{k: r[k] for k in ("prompt", "images", "label")} for r in train[:a.num_prompts]]
        rng = random.Random(seed + 3)
        pairs = [{"prompt": r["prompt"], "images": r["images"], "chosen": r["output"],
                  "rejected": wrong_colour(r["output"], rng)} for r in train[:a.num_pairs]]
        return [write_jsonl(os.path.join(out, "shapes_train.jsonl"), train),
                write_jsonl(os.path.join(out, "shapes_prompts.jsonl"), prompts),
                write_jsonl(os.path.join(out, "shapes_eval.jsonl"), held),
                write_jsonl(os.path.join(out, "shapes_preference.jsonl"), pairs)]

    def examples(self, out: str) -> list[str]:
        from rlhfkit.examples import copy_to

        return copy_to(out)


def make(args) -> list[str]:
    """Write the requested kinds into args.out; returns the written paths in order."""
    kinds = [k for k in KINDS if k not in NOT_IN_ALL] if "all" in args.kinds else []
    kinds += [k for k in dict.fromkeys(args.kinds) if k != "all" and k not in kinds]
    os.makedirs(args.out, exist_ok=True)
    maker = Maker(args)
    written: list[str] = []
    for kind in kinds:
        fn: Callable[[str], list[str]] = getattr(maker, kind)
        written += fn(args.out)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse(argv)
    if not args.kinds:
        parser.error(f"name what to write: one or more of {', '.join(KINDS)}, all")
    for kind in args.kinds:
        if kind not in (*KINDS, "all"):
            close = difflib.get_close_matches(kind, [*KINDS, "all"], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            parser.error(f"unknown KIND {kind!r}{hint}; choose from {', '.join(KINDS)}, all")
    if min(args.num_train, args.num_prompts, args.num_eval, args.num_pairs, args.digits) < 1:
        parser.error("--num_train, --num_prompts, --num_eval, --num_pairs and --digits must be at least 1")
    try:
        written = make(args)
    except (ValueError, OSError) as e:
        parser.exit(1, f"make_data: error: {e}\n")
    for path in written:
        rows = ""
        if path.endswith(".jsonl"):
            with open(path) as f:
                rows = f" ({sum(1 for _ in f)} rows)"
        log.info(f"wrote {path}{rows}")


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
