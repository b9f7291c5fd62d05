"""The vLLM worker behind :mod:`ldlp.bench.peers.vllm_peer`: standard library and vLLM only, run as a script by the
Python that has vLLM (``python -I ldlp/bench/peers/vllm_worker.py``), one process per (contender, C).

JSON lines on stdin/stdout (vLLM's own logging goes to stderr). The first line is the settings:
``{"target", "drafter" (with "k": the converted EAGLE-1 folder, or the EAGLE-3 head's speculators folder as
it is), "method" ("eagle" or "eagle3", with "k"), "k", "max_num_seqs", "max_model_len", "dtype", "threads",
"seed", "enforce_eager" (default true: no torch.compile, no CUDA graphs), "gpu_memory_utilization" (optional:
the KV cache from vLLM's share of GPU memory instead of "kv_cache_bytes"), "schedule" (optional: Dynamic
SD's ``num_speculative_tokens_per_batch_size``, ranges ``[first, last, K]`` with "k" their largest K),
"trace_steps" (optional)}``; the answer is ``{"ready": true, "vllm": version,
"load_s", "dynamic_sd"}``, ``dynamic_sd`` the K the scheduler will draft at each batch size 1..max_num_seqs as
vLLM itself resolved it (None without a schedule). With a schedule, a vLLM without Dynamic SD, or one that
dropped the schedule after parsing it (vLLM falls back to static ``num_speculative_tokens`` under data
parallelism, with one warning), is an error: a run never measures static k while calling it a schedule.
Then:

* ``{"cmd": "generate", "prompts": [[ids]], "max_new_tokens", "stop_token_ids", "temperature", "top_k",
  "top_p", "seeds"}`` -> ``{"outputs": [[ids]], "wall_s", "cpu_s", "num_drafts", "num_draft_tokens",
  "num_accepted_tokens", "request_s", "first_token_s", "token_gap_sum_s"}``: one ``LLM.generate`` over all the
  prompts (vLLM keeps at most ``max_num_seqs`` in flight and admits the next as one finishes); wall and
  process CPU seconds around that call only; the speculative counters are the deltas of vLLM's own metrics,
  ``accepted_per_pos`` (accepted tokens at each draft position, vLLM's per-position counter) among them. With
  ``trace_steps``, ``steps``: one ``[wall_s, cpu_s, batch, new_requests, scheduled_tokens, verified_drafts,
  next_k]`` per engine step (the step's wall and process CPU seconds; ``batch`` the requests it scheduled,
  the count vLLM's Dynamic SD keys K on; ``next_k`` the K it drafts for the next step).
* ``{"cmd": "serve", "prompts", "arrivals", "max_new_tokens", "stop_token_ids", "temperature", "top_k", "top_p",
  "seeds"}`` -> ``{"outputs", "wall_s", "cpu_s", "idle_s", "steps", "first_s", "last_s", "timeline", counters}``:
  open loop (:mod:`ldlp.bench.comparisons.serving`): request i is added to vLLM's engine when ``arrivals[i]`` seconds
  have passed, the engine steps while anything is in flight (vLLM queues what ``max_num_seqs`` leaves waiting) and
  sleeps to the next arrival when nothing is; ``first_s`` / ``last_s`` the seconds from the start at which
  request i's first and last tokens came out of a step, ``timeline`` one ``[seconds, running, waiting]`` per step.
* ``{"cmd": "quit"}``.
"""

import json
import os
import sys
import time

# the protocol owns the real stdout; everything printed (vLLM's logs included) goes to stderr
_PROTO = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


def _send(obj) -> None:
    _PROTO.write(json.dumps(obj) + "\n")
    _PROTO.flush()


def _counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (0 without speculative decoding), with the accepted
    tokens per draft position (``accepted_per_pos``: position i counts the drafts whose first i + 1 tokens
    were accepted)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in out and hasattr(m, "value"):
            out[name] += int(m.value)
        elif name == "num_accepted_tokens_per_pos" and hasattr(m, "values"):
            pos = out["accepted_per_pos"]
            pos.extend([0] * (len(m.values) - len(pos)))
            for i, v in enumerate(m.values):
                pos[i] += int(v)
    return out


def has_dynamic_sd() -> bool:
    """Whether this vLLM's speculative config takes Dynamic SD's batch-size schedule (vLLM PR 32374)."""
    from vllm.config import SpeculativeConfig

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {}) or getattr(SpeculativeConfig, "model_fields", {})
    return "num_speculative_tokens_per_batch_size" in fields


def _core(llm):
    """vLLM's in-process engine core (one process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core


def _resolved_schedule(llm) -> list[int] | None:
    """The K the scheduler drafts at batch sizes 1..max_num_seqs (its dense lookup), or None when it has
    none: no schedule given, or vLLM dropped it."""
    sched = _core(llm).scheduler
    lookup = getattr(sched, "dynamic_sd_lookup", None)
    cfg = llm.llm_engine.vllm_config.speculative_config
    if lookup is None or cfg is None or getattr(cfg, "num_speculative_tokens_per_batch_size", None) is None:
        return None
    return [int(k) for k in lookup[1:]]


class _StepTrace:
    """Times every engine step (``step_fn``) and records the shape its scheduler output had."""

    def __init__(self, llm):
        self.core = _core(llm)
        self.steps: list[list] = []
        self._last = None
        schedule, step = self.core.scheduler.schedule, self.core.step_fn

        def traced_schedule(*a, **kw):
            self._last = out = schedule(*a, **kw)
            return out

        def traced_step(*a, **kw):
            self._last = None
            t0, c0 = time.perf_counter(), time.process_time()
            result = step(*a, **kw)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            so = self._last
            if so is not None and so.total_num_scheduled_tokens > 0:
                self.steps.append([wall, cpu, len(so.num_scheduled_tokens), len(so.scheduled_new_reqs),
                                   int(so.total_num_scheduled_tokens),
                                   sum(len(v) for v in so.scheduled_spec_decode_tokens.values()),
                                   int(getattr(so, "num_spec_tokens_to_schedule", 0) or 0)])
            return result

        self.core.scheduler.schedule = traced_schedule
        self.core.step_fn = traced_step

    def take(self) -> list[list]:
        out, self.steps = self.steps, []
        return out


def _build(s: dict):
    import torch

    torch.set_num_threads(int(s.get("threads", 1)))
    from vllm import LLM

    kwargs = dict(model=s["target"], tokenizer=s["target"], skip_tokenizer_init=True, dtype=s.get("dtype", "float32"),
                  enforce_eager=bool(s.get("enforce_eager", True)), enable_prefix_caching=False,
                  max_num_seqs=int(s["max_num_seqs"]),
                  max_model_len=int(s["max_model_len"]), seed=int(s.get("seed", 0)), disable_log_stats=False,
                  # an explicit KV cache: vLLM's CPU default reserves a fraction of the machine's memory
                  kv_cache_memory_bytes=int(s.get("kv_cache_bytes", 512 << 20)))
    if s.get("gpu_memory_utilization"):  # a GPU: vLLM sizes the KV cache from this share of the device's memory
        kwargs.pop("kv_cache_memory_bytes")
        kwargs["gpu_memory_utilization"] = float(s["gpu_memory_utilization"])
    if s.get("k"):
        kwargs["speculative_config"] = {"method": s.get("method") or "eagle", "model": s["drafter"],
                                        "num_speculative_tokens": int(s["k"])}
        if s.get("schedule"):
            if not has_dynamic_sd():
                import vllm

                raise RuntimeError(f"vLLM {vllm.__version__} has no Dynamic SD (speculative_config."
                                   "num_speculative_tokens_per_batch_size, vLLM PR 32374): it cannot run a schedule")
            kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] = [
                [int(a), int(b), int(k)] for a, b, k in s["schedule"]]
    llm = LLM(**kwargs)
    if s.get("schedule") and _resolved_schedule(llm) is None:
        raise RuntimeError("vLLM dropped num_speculative_tokens_per_batch_size and fell back to static "
                           f"num_speculative_tokens={s['k']} (see the worker's log for vLLM's warning)")
    return llm


def _requests(msg: dict) -> tuple[list, list]:
    """vLLM's prompts and sampling parameters of a ``generate`` or ``serve`` message, one per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    T = float(msg.get("temperature") or 0.0)
    seeds = msg.get("seeds") or [None] * len(msg["prompts"])
    params = []
    for seed in seeds:
        kw = dict(max_tokens=int(msg["max_new_tokens"]), stop_token_ids=list(msg["stop_token_ids"]), detokenize=False,
                  temperature=T)
        if T > 0:
            kw.update(seed=seed, top_k=msg.get("top_k") or 0, top_p=msg.get("top_p") or 1.0)
        params.append(SamplingParams(**kw))
    return [TokensPrompt(prompt_token_ids=list(p)) for p in msg["prompts"]], params


def _delta(before: dict, after: dict) -> dict:
    """The speculative counters' change between two :func:`_counters` reads."""
    pos_before, pos_after = before.pop("accepted_per_pos"), after.pop("accepted_per_pos")
    pos_before += [0] * (len(pos_after) - len(pos_before))
    return {**{k: after[k] - before[k] for k in after},
            "accepted_per_pos": [a - b for a, b in zip(pos_after, pos_before)]}


def _serve(llm, msg: dict) -> dict:
    """Open loop on vLLM's own engine: each request added when its arrival time has come (vLLM's scheduler queues
    it while ``max_num_seqs`` are running), one ``step()`` at a time while anything is in flight, a sleep to the
    next arrival when nothing is (as :func:`ldlp.bench.comparisons.serving.run_serving` serves this engine)."""
    prompts, params = _requests(msg)
    arrivals = [float(a) for a in msg["arrivals"]]
    engine, sched = llm.llm_engine, _core(llm).scheduler
    n, nxt = len(prompts), 0
    outputs, first, last = [None] * n, [None] * n, [None] * n
    seen = [0] * n
    timeline, idle, steps = [], 0.0, 0
    before = _counters(llm)
    t0, c0 = time.perf_counter(), time.process_time()
    while nxt < n or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            engine.add_request(str(nxt), prompts[nxt], params[nxt])
            nxt += 1
        if not engine.has_unfinished_requests():
            wait = arrivals[nxt] - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
                idle += wait
            continue
        outs = engine.step()
        t = time.perf_counter() - t0
        steps += 1
        for o in outs:
            i, toks = int(o.request_id), o.outputs[0].token_ids  # cumulative: every token so far
            if len(toks) > seen[i]:
                first[i] = t if first[i] is None else first[i]
                last[i], seen[i] = t, len(toks)
            if o.finished:
                outputs[i] = list(toks)
        timeline.append([round(t, 4), len(getattr(sched, "running", ())), len(getattr(sched, "waiting", ()))])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"outputs": outputs, "wall_s": wall, "cpu_s": cpu, "idle_s": idle, "steps": steps, "first_s": first,
            "last_s": last, "timeline": timeline, **_delta(before, _counters(llm))}


def _generate(llm, msg: dict, trace: _StepTrace | None = None) -> dict:
    prompts, params = _requests(msg)
    before = _counters(llm)
    if trace is not None:
        trace.take()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    reply = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "wall_s": wall, "cpu_s": cpu,
             **_delta(before, _counters(llm)), "request_s": [], "first_token_s": [], "token_gap_sum_s": 0.0}
    if trace is not None:
        reply["steps"] = trace.take()
    for o in outs:
        m = getattr(o, "metrics", None)
        if m is None or not getattr(m, "last_token_ts", 0):
            continue
        start = m.scheduled_ts or m.queued_ts
        reply["request_s"].append(m.last_token_ts - start)
        reply["first_token_s"].append(m.first_token_ts - start)
        reply["token_gap_sum_s"] += m.last_token_ts - m.first_token_ts
    return reply


def main() -> None:
    settings = json.loads(sys.stdin.readline())
    try:
        t0 = time.perf_counter()
        llm = _build(settings)
        import torch
        import vllm

        trace = _StepTrace(llm) if settings.get("trace_steps") else None
        _send({"ready": True, "vllm": vllm.__version__, "load_s": time.perf_counter() - t0,
               "torch_threads": torch.get_num_threads(),
               "dynamic_sd": _resolved_schedule(llm) if settings.get("schedule") else None})
    except Exception as e:  # noqa: BLE001  (reported to the benchmark, which stops with it)
        _send({"error": f"building vLLM's LLM failed: {type(e).__name__}: {e}"})
        raise
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("cmd") == "quit":
            break
        try:
            _send(_serve(llm, msg) if msg.get("cmd") == "serve" else _generate(llm, msg, trace))
        except Exception as e:  # noqa: BLE001
            _send({"error": f"{type(e).__name__}: {e}"})
            raise


if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    main()
