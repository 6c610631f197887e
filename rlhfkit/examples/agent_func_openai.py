"""A multi-turn agent written against the OpenAI API:
`--agent_func_path examples/agent_func_openai.py --label_key answer` (needs `pip install openai`).

The agent asks the policy the prompt as a chat message; when the first line of the reply is not
the label it answers, as the user, what was wrong and asks again, up to MAX_ATTEMPTS times. The
reward is 1.0 for a right answer at the first attempt, 0.5 at the second, ...; 0.0 when every
attempt was wrong. The code only sees the OpenAI API: rlhfkit serves the policy behind
`session.base_url` during rollouts and trains on the token ids the engine produced for each reply
(the feedback messages are in the trajectory but not trained on).
"""

from openai import AsyncOpenAI

from rlhfkit.agents import OpenAIAgentExecutor

MAX_ATTEMPTS = 2


def first_line(text: str) -> str:
    return text.strip().split("\n")[0].strip()


def feedback(answer: str, label: str) -> str:
    try:
        hint = "too low" if float(answer) < float(label) else "too high"
    except ValueError:
        hint = "not a number"
    return f"{answer!r} is {hint}. Try again."


class AgentExecutor(OpenAIAgentExecutor):
    async def run_agent(self, prompt, label, session):
        label = str(label).strip()
        messages = [{"role": "user", "content": prompt}]
        async with AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as client:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                reply = await client.chat.completions.create(model=session.model, messages=messages,
                                                             max_tokens=session.max_tokens)
                content = reply.choices[0].message.content or ""
                answer = first_line(content)
                if answer == label:
                    return {"reward": 1.0 / attempt, "scores": 1.0, "extra_logs": {"attempts": attempt}}
                messages += [{"role": "assistant", "content": content},
                             {"role": "user", "content": feedback(answer, label)}]
        return {"reward": 0.0, "scores": 0.0, "extra_logs": {"attempts": MAX_ATTEMPTS}}
