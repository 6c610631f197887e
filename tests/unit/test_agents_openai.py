"""OpenAIAgentExecutor with a fake engine and the character tokenizer: agent code on the real
``openai`` client, over real HTTP, and the trajectories it leaves (token layouts worked out by hand).

Char tokenizer: 0 <pad>, 1 <s>, 2 </s>, 4 <|im_start|>, 5 <|im_end|>, '0'..'9' = 6..15, 'a' = 16,
'\\n' = 102; the chat template is ChatML.
"""

from __future__ import annotations

import asyncio
import json
import logging
import textwrap
import urllib.error
import urllib.request

import pytest

from rlhfkit.agents import AgentConfig, OpenAIAgentExecutor, RewardFailure, build_agent_executor
from rlhfkit.models.tiny import build_tokenizer
from rlhfkit.types import Completion, PromptSample, SamplingParams

openai = pytest.importorskip("openai")


class ScriptEngine:
    """Replies the next text of `replies` (tokenized), cut at max_new_tokens; logprob of the i-th
    generated token -(i + 1) / 10. Keeps every request and Completion."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.requests, self.completions = tok, list(replies), [], []

    async def agenerate(self, req):
        self.requests.append(req)
        ids = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        limit = req.params.max_new_tokens
        finish = "length" if len(ids) > limit else "stop"
        ids = ids[:limit]
        c = Completion(list(req.prompt_token_ids), ids, [-(i + 1) / 10 for i in range(len(ids))], finish,
                       req.request_id)
        self.completions.append(c)
        return [c]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def setup(agent, engine, tok, **kw):
    cfg = {"max_length": 200, "sampling_params": SamplingParams(max_new_tokens=8, seed=11), "step_timeout_s": 30.0}
    cfg.update(kw)
    ex = agent if isinstance(agent, OpenAIAgentExecutor) else OpenAIAgentExecutor(run_agent=agent)
    return ex.setup(engine, tok, AgentConfig(**cfg))


def run(ex, prompts=("ab",), labels=("7",), n=1):
    samples = [PromptSample(prompt=p, label=lab) for p, lab in zip(prompts, labels)]
    return asyncio.run(ex.run_episodes(samples, n))


def spans(mask):
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


async def chat_twice(prompt, label, session):
    """Asks, tells the reply was wrong, asks again (the reference multi-turn shape)."""
    async with session.client() as client:
        messages = [{"role": "user", "content": prompt}]
        r1 = await client.chat.completions.create(model=session.model, messages=messages, logprobs=True)
        messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "no"}]
        r2 = await client.chat.completions.create(model=session.model, messages=messages, max_tokens=3)
    assert (r1.choices[0].message.content, r2.choices[0].message.content) == ("12", "345")
    return {"reward": 0.5, "scores": 1.0, "extra_logs": {"seen": len(r1.choices[0].logprobs.content)}}


def test_chat_turns_continue_each_other_by_hand(tok):
    engine = ScriptEngine(tok, ["12</s>", "3456"])
    ex = setup(chat_twice, engine, tok)
    (t,) = run(ex).trajectories
    p1 = enc(tok, "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n")
    gen1 = [7, 8, 2]  # "12</s>": the eos stays in the transcript; the client got "12"
    delta = enc(tok, "<|im_end|>\n<|im_start|>user\nno<|im_end|>\n<|im_start|>assistant\n")
    gen2 = [9, 10, 11]  # "3456" cut by max_tokens=3 -> finish "length"
    assert engine.requests[0].prompt_token_ids == p1
    assert engine.requests[1].prompt_token_ids == p1 + gen1 + delta  # prefix-consistent, never re-tokenized
    assert engine.requests[1].params.max_new_tokens == 3 and engine.requests[0].params.max_new_tokens == 8
    assert t.token_ids == p1 + gen1 + delta + gen2 and t.prompt_len == len(p1)
    assert spans(t.action_mask) == [(len(p1), len(p1) + 3), (len(p1 + gen1 + delta), len(t.token_ids))]
    assert t.rollout_logprobs[len(p1):len(p1) + 3] == [-0.1, -0.2, -0.3]
    assert t.rollout_logprobs[-3:] == [-0.1, -0.2, -0.3] and sum(t.rollout_logprobs) == pytest.approx(-1.2)
    assert t.reward == 0.5 and t.score == 1.0 and t.truncated  # the last turn ended by length
    assert t.extra_logs == {"openai_turns": 2.0, "openai_segments": 1.0, "seen": 3.0}
    assert t.prompt == "ab" and t.label == "7"


def test_completions_api_text_then_token_ids(tok):
    async def agent(prompt, label, session):
        async with session.client() as client:
            r1 = await client.completions.create(model=session.model, prompt=prompt, logprobs=1, stop=["X"])
            ids = r1.model_extra["prompt_token_ids"] + r1.choices[0].model_extra["token_ids"] + enc(tok, "b")
            r2 = await client.completions.create(model=session.model, prompt=ids)
        assert r1.choices[0].text == "1" and r1.choices[0].logprobs.token_logprobs == [-0.1, -0.2]
        assert r2.choices[0].text == "2" and r2.model_extra["prompt_token_ids"] == ids
        return 1.0

    engine = ScriptEngine(tok, ["1X", "2"])
    (t,) = run(setup(agent, engine, tok), prompts=["a="]).trajectories
    a = enc(tok, "a=")
    assert engine.requests[0].params.stop == ["X"]
    assert engine.requests[1].prompt_token_ids == a + enc(tok, "1X") + enc(tok, "b")
    assert t.token_ids == a + enc(tok, "1Xb2") and spans(t.action_mask) == [(2, 4), (5, 6)]
    assert t.reward == t.score == 1.0 and t.extra_logs["openai_segments"] == 1.0


def rewrite_history(prompt, label, session):  # a sync run_agent: the second turn drops the first reply
    client = openai.OpenAI(base_url=session.base_url, api_key="x")
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}])
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
    client.close()
    return 0.0


def test_rewritten_history_starts_a_new_segment(tok, caplog):
    engine = ScriptEngine(tok, ["1", "2"])
    with caplog.at_level(logging.WARNING):
        (t,) = run(setup(rewrite_history, engine, tok)).trajectories
    p2 = enc(tok, "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    assert engine.requests[1].prompt_token_ids == p2  # a fresh prompt, not the first turn's continuation
    assert t.token_ids == p2 + [8] and t.prompt_len == len(p2) and spans(t.action_mask) == [(len(p2), len(p2) + 1)]
    assert t.extra_logs["openai_segments"] == 2.0 and "trains on its last segment" in caplog.text

    with pytest.raises(RewardFailure, match="did not continue the turn before"):
        run(setup(OpenAIAgentExecutor(rewrite_history, multi_segment="error"), ScriptEngine(tok, ["1", "2"]), tok))


def post(url, body, headers=None):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_endpoints_and_refused_requests(tok):
    seen = {}

    def agent(prompt, label, session):
        root, msgs = session.server_url, [{"role": "user", "content": "a"}]
        base = root.rsplit("/s/", 1)[0]
        chat = f"{base}/v1/chat/completions"
        seen["nosession"] = post(chat, {"messages": msgs})
        seen["unknown"] = post(f"{base}/s/nope/v1/chat/completions", {"messages": msgs})
        seen["n2"] = post(root + "/v1/chat/completions", {"messages": msgs, "n": 2})
        seen["stream"] = post(root + "/v1/chat/completions", {"messages": msgs, "stream": True})
        seen["badmax"] = post(root + "/v1/chat/completions", {"messages": msgs, "max_tokens": 0})
        seen["badids"] = post(root + "/v1/completions", {"prompt": [1, 999]})
        seen["long"] = post(root + "/v1/completions", {"prompt": "x" * 60})
        seen["tok"] = post(root + "/tokenize", {"prompt": "ab"})
        seen["tokchat"] = post(base + "/tokenize", {"messages": msgs})
        seen["detok"] = post(root + "/detokenize", {"tokens": [16, 17]})
        with urllib.request.urlopen(session.base_url + "/models", timeout=10) as r:
            seen["models"] = json.loads(r.read())
        seen["header"] = post(chat, {"messages": msgs}, {"X-Session-Id": session.session_id})  # the one turn
        seen["body"] = post(chat, {"messages": msgs, "session_id": session.session_id})  # OpenRLHF's extra_body
        return 1.0

    engine = ScriptEngine(tok, ["1", "2"])
    (t,) = run(setup(agent, engine, tok, max_length=40)).trajectories
    for key, status, needle in [("nosession", 400, "no session"), ("unknown", 404, "unknown session"),
                                ("n2", 400, "n=2"), ("stream", 400, "stream"), ("badmax", 400, "max_tokens"),
                                ("badids", 400, "outside the vocabulary"), ("long", 400, "no room")]:
        code, body = seen[key]
        assert code == status and needle in body["error"]["message"], (key, code, body)
    assert seen["tok"][1]["tokens"] == [16, 17] and seen["tok"][1]["max_model_len"] == 40
    assert seen["tokchat"][1]["tokens"] == enc(tok, "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n")
    assert seen["detok"][1] == {"prompt": "ab"}
    assert [m["id"] for m in seen["models"]["data"]] == [ex_model(tok)]
    assert seen["header"][0] == 200 and seen["header"][1]["choices"][0]["message"]["content"] == "1"
    assert seen["body"][0] == 200 and len(engine.requests) == 2  # refused requests never reached the engine
    assert t.extra_logs["openai_turns"] == 2.0


def ex_model(tok):
    return tok.name_or_path or "policy"


def test_trainer_sampling_wins_with_one_warning(tok, caplog):
    async def agent(prompt, label, session):
        async with session.client() as client:
            for _ in range(2):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                     temperature=0.1, seed=5, top_p=1.0)
        return 0.0

    engine = ScriptEngine(tok, ["1", "2", "3", "4"])
    with caplog.at_level(logging.WARNING):
        run(setup(agent, engine, tok), prompts=["a", "b"], labels=[0, 0])
    params = [r.params for r in engine.requests]
    assert {p.temperature for p in params} == {1.0}
    assert sorted(p.seed for p in params) == sorted([11, 11 + 7919, 12, 12 + 7919])  # episode seed + turn
    assert caplog.text.count("temperature=0.1") == 1 and caplog.text.count("seed=5") == 1
    assert "top_p" not in caplog.text  # equal to the trainer's: nothing to say


def test_user_failures_follow_reward_failure(tok):
    def none_reward(prompt, label, session):
        with session.client() as _:
            pass
        return None

    async def no_request(prompt, label, session):
        return 1.0

    async def boom(prompt, label, session):
        async with session.client() as client:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        raise KeyError("env broke")

    for agent, needle in [(no_request, "made no completion request"), (boom, "KeyError: 'env broke'")]:
        with pytest.raises(RewardFailure, match=needle):
            run(setup(agent, ScriptEngine(tok, ["1"]), tok))
    batch = run(setup(boom, ScriptEngine(tok, ["1"]), tok, reward_failure="drop"))
    assert batch.trajectories == [] and batch.num_dropped == 1

    async def silent(prompt, label, session):
        async with session.client() as client:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        return None

    with pytest.raises(RewardFailure, match="returned None"):
        run(setup(silent, ScriptEngine(tok, ["1"]), tok))


def test_engine_errors_end_the_run_even_when_the_agent_catches_them(tok):
    class Broken(ScriptEngine):
        async def agenerate(self, req):
            raise RuntimeError("CUDA exploded")

    async def careless(prompt, label, session):
        async with session.client(max_retries=0) as client:
            try:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
            except openai.InternalServerError:
                pass
        return 1.0

    with pytest.raises(RuntimeError, match="CUDA exploded"):
        run(setup(careless, Broken(tok, []), tok))


def test_module_level_run_agent_file_and_server_lifetime(tmp_path, tok):
    path = tmp_path / "agent_openai_fn.py"
    path.write_text(textwrap.dedent('''
        from openai import AsyncOpenAI

        async def run_agent(prompt, label, session):
            async with AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as client:
                r = await client.chat.completions.create(model=session.model,
                                                         messages=[{"role": "user", "content": prompt}])
            return {"reward": float(r.choices[0].message.content == label)}
    '''))
    engine = ScriptEngine(tok, ["7", "8", "7"])
    ex = build_agent_executor(str(path), engine, tok, AgentConfig(max_length=100,
                                                                  sampling_params=SamplingParams(max_new_tokens=4)))
    assert isinstance(ex, OpenAIAgentExecutor)
    urls = []
    real = ex.execute

    async def spy(*a, **k):
        urls.append(f"http://127.0.0.1:{await_port(ex)}/health")
        return await real(*a, **k)

    ex.execute = spy
    # two samples run concurrently: which one gets the scripted "7" depends on scheduling
    assert sorted(t.reward for t in run(ex, n=2).trajectories) == [0.0, 1.0]
    assert [t.reward for t in run(ex).trajectories] == [1.0]  # a second batch, on a new event loop
    with pytest.raises(urllib.error.URLError):  # the server is down between batches
        urllib.request.urlopen(urls[0], timeout=5)


def await_port(ex):
    return ex._serving.ready.result()
