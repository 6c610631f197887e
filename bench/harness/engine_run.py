"""The builtin engine timed on a batch of random prompts (bench/rollout.py, bench/families.py): `prompts_for`,
`run_builtin` (warm-up, the median of `--repeat` generate() calls, the engine's settings and counters), and on a
GPU its profile (`profile_engine`: decode step times, kernel tables, prefill) and trace (`trace_generate`: host and
GPU phase by phase, idle gaps)."""

from __future__ import annotations

import time

import torch

from bench.harness.timing import median_ms, sync
from rlhfkit.rollout.builtin import BuiltinEngine, BuiltinEngineConfig
from rlhfkit.rollout.builtin.loop.scheduler import batch_bucket, length_bucket
from rlhfkit.types import GenerationRequest, SamplingParams


def prompts_for(batch: int, plen: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(plen * 7919 + batch)
    return torch.randint(10, vocab, (batch, plen), generator=g)


def run_builtin(model, device, dtype, ids: torch.Tensor, new: int, args) -> dict:
    batch, plen = ids.shape
    cfg = BuiltinEngineConfig(max_num_seqs=batch, max_model_len=plen + new, sync_every=args.sync_every, sync_every_batch=args.sync_every_batch,
                              max_prefill_tokens=args.max_prefill_tokens, compile=bool(args.compile) and device.type == "cuda",
                              cuda_graphs=None if args.cuda_graphs else False,
                              compile_prefill=None if args.compile_prefill else False,
                              fast_sampling=args.fast_sampling, decode_attention=args.decode_attention,
                              compile_mode=args.compile_mode, decode_gemm=args.decode_gemm,
                              gemm_min_rows=args.gemm_min_rows, lookahead_steps=args.lookahead_steps)
    engine = BuiltinEngine(model, None, device=device, dtype=dtype, config=cfg, eos_token_ids=[])
    t0 = time.perf_counter()
    engine.warmup(batch)
    sp = SamplingParams(temperature=1.0, max_new_tokens=new, seed=None)
    reqs = [GenerationRequest(row.tolist(), sp, i) for i, row in enumerate(ids)]
    # like HF's warm-up: the whole batch, a few tokens (prefill kernels, allocator, cuBLAS heuristics)
    warm_sp = SamplingParams(temperature=1.0, max_new_tokens=min(new, 16), seed=None)
    engine.generate([GenerationRequest(r.prompt_token_ids, warm_sp, r.request_id) for r in reqs])
    sync(device)
    warm = time.perf_counter() - t0
    times = []
    for _ in range(max(1, args.repeat)):
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        sync(device)
        times.append(time.perf_counter() - t0)
        assert all(len(o[0].token_ids) == new for o in outs), "builtin: a sequence stopped early"
    dt = sorted(times)[len(times) // 2]
    res = {"builtin_tok_s": batch * new / dt, "builtin_s": dt, "builtin_runs_s": times, "builtin_warmup_s": warm,
           "builtin_ms_per_step": 1000 * dt / new, "builtin_graphs": engine.runner.captures,
           "builtin_compiled": engine.runner.compiled, "builtin_prefill_calls": engine.stats.prefill_calls,
           "builtin_attention": engine.model.attn, "builtin_gemm": engine.model.gemm, "builtin_fast_sampling": engine.runner.fast_sampling}
    if engine.runner.compile_error:
        res["builtin_compile_error"] = engine.runner.compile_error
    if getattr(args, "trace", False) and device.type == "cuda":
        try:
            res["builtin_trace"] = trace_generate(engine, reqs)
        except Exception as exc:  # noqa: BLE001
            res["builtin_trace_error"] = f"{type(exc).__name__}: {exc}"[:1000]
    if args.profile and device.type == "cuda":
        try:
            res["builtin_profile"] = profile_engine(engine, ids, new)
        except Exception as exc:  # noqa: BLE001 - the timing above stands without the profile
            res["builtin_profile_error"] = f"{type(exc).__name__}: {exc}"[:1000]
    res.update(decode_split(res, plen, new))
    engine.sleep(2)
    del engine
    return res


def decode_split(res: dict, plen: int, new: int) -> dict:
    """From a profile's decode-step times at the first, middle and last context: the mean decode
    step over the run (Simpson's rule), the prefill + decode GPU time that implies, and the rest of
    the measured wall time (host work, syncs, first-token sampling): where the time goes."""
    prof = res.get("builtin_profile") or {}
    by_ctx, last = prof.get("decode_step_ms_by_ctx") or {}, prof.get("decode_step_ms_final_ctx")
    first, mid = by_ctx.get(str(plen)), by_ctx.get(str(plen + new // 2))
    if None in (first, mid, last, prof.get("prefill_ms")):
        return {}
    mean = (first + 4 * mid + last) / 6
    gpu = prof["prefill_ms"] + (new - 1) * mean
    return {"builtin_decode_step_ms_mean": mean, "builtin_prefill_plus_decode_ms": gpu,
            "builtin_other_ms": 1000 * res["builtin_s"] - gpu}


def _kernel_table(prof, steps: int, top: int) -> dict:
    rows = []
    for evt in prof.key_averages():
        dev_us = getattr(evt, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "cuda_time_total", 0)
        if dev_us > 0 and evt.count > 0 and getattr(evt, "device_type", None) is not None \
                and "CUDA" in str(evt.device_type):
            rows.append((dev_us / steps, evt.count / steps, evt.key[:100]))
    rows.sort(reverse=True)
    return {"kernels_per_step": round(sum(r[1] for r in rows), 1),
            "kernel_us_per_step": round(sum(r[0] for r in rows), 1),
            "top": [{"us": round(us, 1), "per_step": round(n, 2), "name": name} for us, n, name in rows[:top]]}


def profile_engine(engine: BuiltinEngine, ids: torch.Tensor, new: int, steps: int = 10) -> dict:
    """Decode step time (graph replays with every row at the final context; a done row costs the
    same), the kernels of those steps, and one prefill of the whole batch."""
    from torch.profiler import ProfilerActivity, profile

    batch, plen = ids.shape
    runner = engine.runner
    rows = batch_bucket(batch, engine.config.max_num_seqs)
    kv_len = length_bucket(plen + new, engine.max_model_len)
    out: dict = {}
    with torch.inference_mode():
        runner.run(rows, kv_len, False, 2)
        out["decode_step_ms_final_ctx"] = median_ms(lambda: runner.run(rows, kv_len, False, 20)) / 20
        snap = runner.state.snapshot()
        by_ctx = {}
        for ctx in (plen, plen + new // 2):  # finished rows keep their position: every step sees `ctx`
            runner.state.pos[:rows] = ctx
            by_ctx[str(ctx)] = round(median_ms(lambda: runner.run(rows, kv_len, False, 20)) / 20, 4)
        runner.state.restore(snap)
        out["decode_step_ms_by_ctx"] = by_ctx
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.run(rows, kv_len, False, steps)
            torch.cuda.synchronize()
        out["graph_replay"] = _kernel_table(prof, steps, 25)
        if out["graph_replay"]["kernels_per_step"] == 0:  # kernels inside graphs not reported: profile eagerly
            snap = runner.state.snapshot()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner._call(rows, kv_len, False)
                torch.cuda.synchronize()
            runner.state.restore(snap)
            out["eager_step"] = _kernel_table(prof, 1, 25)
        dev = engine.device
        tok, lengths, slots = ids.to(dev), torch.full((batch,), plen, device=dev), torch.arange(batch, device=dev)
        runner.prefill(engine.cache, tok, lengths, slots)
        out["prefill_ms"] = median_ms(lambda: runner.prefill(engine.cache, tok, lengths, slots), 3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.prefill(engine.cache, tok, lengths, slots)
            torch.cuda.synchronize()
        out["prefill_kernels"] = _kernel_table(prof, 1, 15)
    return out


def trace_generate(engine: BuiltinEngine, reqs: list) -> dict:
    """Where the wall time of one `generate()` goes: host and GPU time of each engine phase
    (prefill, first-token sampling, decode replays, sync) from perf_counter and CUDA events around
    the phase methods, and the GPU's busy time (union of kernel intervals, from the profiler) against
    the wall time, with the longest idle gaps and what the host was doing during each."""
    from torch.profiler import ProfilerActivity, profile, record_function

    phases: dict[str, dict] = {}
    events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    originals = {}

    def wrap(obj, name: str, label: str):
        fn = getattr(obj, name)
        originals[(obj, name)] = fn

        def timed(*a, **k):
            t0 = time.perf_counter()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            try:
                with record_function(f"phase:{label}"):
                    return fn(*a, **k)
            finally:
                e1.record()
                ph = phases.setdefault(label, {"calls": 0, "host_ms": 0.0})
                ph["calls"] += 1
                ph["host_ms"] += 1000 * (time.perf_counter() - t0)
                events.append((label, e0, e1))
        setattr(obj, name, timed)

    for obj, name, label in ((engine.loop, "prefill", "prefill"), (engine.runner, "sample", "first_token_sample"),
                             (engine.loop, "decode", "decode"), (engine.loop, "sync", "sync"),
                             (engine, "_prepare", "prepare"), (engine.sched, "plan_admissions", "plan_admissions"),
                             (engine.loop, "finish", "finish")):
        wrap(obj, name, label)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):  # the profiler's own start-up
        engine.generate(reqs)
        torch.cuda.synchronize()
    phases.clear()
    events.clear()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            with record_function("phase:generate"):
                engine.generate(reqs)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        for (obj, name), fn in originals.items():
            setattr(obj, name, fn)
    for label, e0, e1 in events:
        phases[label]["gpu_span_ms"] = phases[label].get("gpu_span_ms", 0.0) + e0.elapsed_time(e1)
    evts = list(prof.events())
    spans = sorted((e.time_range.start, e.time_range.end) for e in evts
                   if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)
                   and e.time_range.end > e.time_range.start)
    cpu = [e for e in evts if "CPU" in str(getattr(e, "device_type", ""))]
    gen = next((e for e in cpu if e.name == "phase:generate"), None)
    origin = gen.time_range.start if gen is not None else (spans[0][0] if spans else 0)
    busy, gaps, cur_s, cur_e = 0.0, [], None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                gaps.append((s - cur_e, cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    gaps.sort(reverse=True)

    def host_during(a: float, b: float) -> list[str]:
        inside = [e for e in cpu if e.time_range.start < b and e.time_range.end > a and e.name != "phase:generate"]
        inside.sort(key=lambda e: -(min(e.time_range.end, b) - max(e.time_range.start, a)))
        names: list[str] = []
        for e in inside:
            label = f"{e.name[:60]} {min(e.time_range.end, b) - max(e.time_range.start, a):.0f}us"
            if e.name[:60] not in {n.rsplit(' ', 1)[0] for n in names}:
                names.append(label)
            if len(names) == 6:
                break
        return names

    first_last = (spans[-1][1] - spans[0][0]) / 1000 if spans else 0.0
    return {"wall_ms": 1000 * wall, "gpu_busy_ms": busy / 1000, "gpu_first_to_last_ms": first_last,
            "before_first_kernel_ms": (spans[0][0] - origin) / 1000 if spans else None,
            "after_last_kernel_ms": (gen.time_range.end - spans[-1][1]) / 1000 if spans and gen else None,
            "idle_gaps_over_20us_ms": sum(g[0] for g in gaps if g[0] > 20) / 1000,
            "gaps_over_20us": sum(g[0] > 20 for g in gaps),
            "longest_gaps": [{"us": round(g, 1), "at_ms": round((a - origin) / 1000, 2), "host": host_during(a, b)}
                             for g, a, b in gaps[:10]],
            "phases": {k: {kk: round(vv, 3) if isinstance(vv, float) else vv for kk, vv in v.items()}
                       for k, v in phases.items()}}
