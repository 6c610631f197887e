"""A stand-in for OpenRLHF's examples/python/reward_func.py: a 0/1 reward that does not depend on
the model being any good (the tiny models never answer right), so dynamic filtering keeps the
groups whose samples differ. Deterministic: the parity of a checksum of the response."""

import zlib

import torch


def reward_func(queries, prompts, labels, **kwargs):
    responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    reward = torch.tensor([float(zlib.crc32(r.encode()) % 2) for r in responses])
    return {"rewards": reward, "scores": reward, "extra_logs": {"dummy_scores": reward}}
