"""The BOS rule (rlhfkit.data.templates): every encode path starts a sequence with the BOS the tokenizer
adds, once, and never adds one a tokenizer does not add. Checked id for id on a Gemma-3-like tokenizer
(adds `<bos>`; its chat template writes `<bos>` too), a SmolLM2-like one (adds none; ChatML), and the real
SmolLM2-135M-Instruct tokenizer (tests/real_model.py; skipped without it): prompts (RL data, the agent's
request to the engine, the reward's query), SFT rows (prompt/response, chat, multi-turn, pretrain),
preference and KTO rows, PRM rows, batch_inference prompts, the chat command and serve_rm."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tokenizer_kinds import gemma3_like, save_tiny_model, smollm2_like

from rlhfkit.data.io import Row
from rlhfkit.data.preference import PreferenceDataConfig, PreferenceDataset, UnpairedDataConfig, UnpairedDataset
from rlhfkit.data.prm import PRMDataConfig, PRMDataset
from rlhfkit.data.prompts import PromptDataConfig, PromptDataset
from rlhfkit.data.sft import SFTDataConfig, SFTDataset
from rlhfkit.data.templates import added_bos, encode

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"}, {"role": "assistant", "content": "ok"}]


def _real_smollm2():
    from real_model import real_model_path

    from rlhfkit.models.loader import load_tokenizer

    return load_tokenizer(real_model_path())


KINDS = {"gemma3_like": gemma3_like, "smollm2_like": smollm2_like, "smollm2_real": _real_smollm2}


@pytest.fixture(params=list(KINDS), scope="module")
def tok(request):
    return KINDS[request.param]()


def lead(tok) -> list[int]:
    """What every sequence must start with: Gemma's BOS, nothing for SmolLM2."""
    return [tok.bos_token_id] if tok.bos_token == "<bos>" else []


def rows(*dicts):
    return [Row(d, "data.jsonl", k + 1) for k, d in enumerate(dicts)]


def starts_once(tok, ids: list[int], text: str) -> None:
    """`ids` are the BOS (if the tokenizer adds one) then exactly the ids of `text`; a BOS never twice."""
    assert ids == lead(tok) + encode(tok, text)
    if lead(tok):
        assert ids.count(tok.bos_token_id) == 1


def test_the_probe(tok):
    assert added_bos(tok) == (lead(tok) or [None])[0]
    assert encode(tok, "hi", start=True) == lead(tok) + encode(tok, "hi")
    assert encode(tok, "hi") == list(tok("hi", add_special_tokens=False)["input_ids"])
    with_bos = f"{tok.bos_token}hi"  # a text that starts with the BOS token already: never a second one
    assert encode(tok, with_bos, start=True) == encode(tok, with_bos)


def test_prompts_for_rl(tok):
    plain = PromptDataset(rows({"q": "2+2="}), tok, PromptDataConfig(input_key="q"))
    chat = PromptDataset(rows({"q": "2+2="}), tok, PromptDataConfig(input_key="q", apply_chat_template=True))
    assert plain.samples[0].prompt == "2+2=" and plain.lengths == [len(lead(tok)) + len(encode(tok, "2+2="))]
    text = chat.samples[0].prompt
    assert text.startswith("<bos><start_of_turn>user") if lead(tok) else text.startswith("<|im_start|>system")
    assert chat.lengths == [len(encode(tok, text, start=True))]
    starts_once(tok, encode(tok, text, start=True), text.removeprefix("<bos>"))


class _Engine:
    """Answers "4" and an EOS to every request; remembers the prompt ids it was given."""

    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    async def agenerate(self, req):
        from rlhfkit.types import Completion

        self.prompts.append(list(req.prompt_token_ids))
        out = encode(self.tok, "4") + [self.tok.eos_token_id]
        return [Completion(list(req.prompt_token_ids), out, [-0.1] * len(out), "stop", req.request_id)]


def test_agent_sends_the_engine_one_bos_and_the_reward_the_prompt_text(tok):
    from rlhfkit.agents import AgentConfig, SingleTurnAgentExecutor
    from rlhfkit.rewards.sources import PythonRewardSource
    from rlhfkit.types import SamplingParams

    queries = []

    def reward_func(queries_, prompts, labels):
        queries.extend(queries_)
        return [1.0] * len(queries_)

    engine = _Engine(tok)
    ex = SingleTurnAgentExecutor(reward_source=PythonRewardSource(reward_func, name="rf.py")).setup(
        engine, tok, AgentConfig(max_length=64, sampling_params=SamplingParams(max_new_tokens=4), step_timeout_s=5.0))
    for prompt in ["2+2="] + ["<bos>2+2=" for _ in lead(tok)]:  # raw text; text that holds its BOS (Gemma's chat)
        traj = asyncio.run(ex.execute(prompt, None, SamplingParams(max_new_tokens=4)))
        starts_once(tok, engine.prompts[-1], prompt.removeprefix("<bos>"))
        assert traj.token_ids[:traj.prompt_len] == engine.prompts[-1]
        assert queries[-1] == prompt + "4" + tok.eos_token  # query[len(prompt):] is the response


def test_sft_rows(tok):
    pr = SFTDataset(rows({"q": "hi", "a": "yo"}), tok, SFTDataConfig(input_key="q", output_key="a"))[0]
    starts_once(tok, pr.input_ids, "hiyo" + tok.eos_token)
    n = len(lead(tok)) + len(encode(tok, "hi"))
    assert pr.loss_mask[:n + 1] == [0] * n + [1]  # the BOS is prompt

    chat = SFTDataset(rows({"m": CHAT[:2]}), tok, SFTDataConfig(input_key="m", apply_chat_template=True))[0]
    rendered = tok.apply_chat_template(CHAT[:2], tokenize=False)
    assert tok.decode(chat.input_ids).startswith(rendered.rstrip("\n"))
    starts_once(tok, chat.input_ids, tok.decode(chat.input_ids).removeprefix("<bos>"))

    multi = SFTDataset(rows({"m": CHAT}), tok, SFTDataConfig(input_key="m", multiturn=True))[0]
    starts_once(tok, multi.input_ids, tok.decode(multi.input_ids).removeprefix("<bos>"))
    assert multi.loss_mask[0] == 0 and len(multi.loss_mask) == len(multi.input_ids)

    raw = SFTDataset(rows({"t": "plain text"}), tok, SFTDataConfig(input_key="t", pretrain_mode=True))[0]
    starts_once(tok, raw.input_ids, "plain text")
    assert raw.loss_mask == [0] + [1] * (len(raw.input_ids) - 1)


def test_preference_and_kto_rows(tok):
    eos = tok.eos_token
    with_prompt = PreferenceDataset(rows({"p": "Q", "chosen": "a", "rejected": "b"}), tok,
                                    PreferenceDataConfig(prompt_key="p"))[0]
    starts_once(tok, with_prompt.chosen_ids, "Qa" + eos)
    starts_once(tok, with_prompt.rejected_ids, "Qb" + eos)
    whole = PreferenceDataset(rows({"chosen": "Qa", "rejected": "Qb"}), tok, PreferenceDataConfig())[0]
    starts_once(tok, whole.chosen_ids, "Qa" + eos)
    assert whole.chosen_loss_mask[0] == 0
    chat = PreferenceDataset(rows({"chosen": CHAT[:2], "rejected": CHAT[:1] + [{"role": "assistant", "content": "no"}]}),
                             tok, PreferenceDataConfig(apply_chat_template=True))[0]
    starts_once(tok, chat.chosen_ids, tok.decode(chat.chosen_ids).removeprefix("<bos>"))
    kto = UnpairedDataset(rows({"input": "Q", "output": "a", "label": True}), tok, UnpairedDataConfig())[0]
    starts_once(tok, kto.input_ids, "Qa" + eos)
    assert kto.prompt_len == len(lead(tok)) + 1


def test_prm_rows(tok):
    item = PRMDataset(rows({"input": "step1#step2#", "value": [1.0, 0.0]}), tok,
                      PRMDataConfig(placeholder_token="#"))[0]
    starts_once(tok, item.input_ids, "step1#step2#")
    hash_id = encode(tok, "#")[0]
    assert [v for t, v in zip(item.input_ids, item.labels) if t == hash_id] == [1.0, 0.0]


def test_batch_inference_prompts_keep_their_bos_when_cut(tok):
    from rlhfkit.inference.generate import encode_prompts

    body = encode(tok, "a longer prompt than the first one")
    ids, cut = encode_prompts(tok, ["2+2=", "a longer prompt than the first one"], max_tokens=len(lead(tok)) + len(body) - 1)
    starts_once(tok, ids[0], "2+2=")
    assert ids[1] == lead(tok) + body[1:] and cut == 1  # the start of the text is cut, not the BOS


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return save_tiny_model(gemma3_like(), str(tmp_path_factory.mktemp("gemma_like")))


def test_chat_command_gives_generate_one_bos(gemma_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from rlhfkit.inference.chat import ReplyConfig, generate_reply
    from rlhfkit.models.loader import load_tokenizer

    tok = load_tokenizer(gemma_dir)
    model = AutoModelForCausalLM.from_pretrained(gemma_dir).eval()
    seen = []

    def fake_generate(input_ids, **kw):
        seen.append(input_ids[0].tolist())
        return torch.cat([input_ids, torch.tensor([[tok.eos_token_id]])], dim=1)

    monkeypatch.setattr(model, "generate", fake_generate)
    for text in ("hi", tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                               add_generation_prompt=True)):
        generate_reply(model, tok, text, ReplyConfig(max_len=64, greedy_sampling=True))
        starts_once(tok, seen[-1], text.removeprefix("<bos>"))


def test_serve_rm_scores_a_query_with_or_without_its_bos_alike(gemma_dir, tmp_path):
    from rlhfkit.serving.scorer import RewardScorer, ServeConfig
    from rlhfkit.models.loader import load_tokenizer
    from rlhfkit.models.value import load_value_model, reward_at_last_token, save_value_model

    rm = str(tmp_path / "rm")
    save_value_model(load_value_model(gemma_dir, init_value_head=True), rm, load_tokenizer(gemma_dir))
    scorer = RewardScorer(ServeConfig(reward_pretrain=rm, param_dtype="fp32", device="cpu"))
    plain, with_bos = scorer.score_texts(["Qa<eos>", "<bos>Qa<eos>"])
    ids = torch.tensor([[2] + encode(scorer.tokenizer, "Qa<eos>")])
    want = reward_at_last_token(scorer.model(input_ids=ids, attention_mask=torch.ones_like(ids)),
                                torch.ones_like(ids)).item()
    assert plain == pytest.approx(want, abs=1e-6) and with_bos == pytest.approx(want, abs=1e-6)
    without = torch.tensor([encode(scorer.tokenizer, "Qa<eos>")])
    assert abs(reward_at_last_token(scorer.model(input_ids=without, attention_mask=torch.ones_like(without)),
                                    torch.ones_like(without)).item() - want) > 1e-4  # the BOS matters
