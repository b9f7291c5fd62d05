"""The vLLM worker behind :mod:`ldlp.bench.vllm_peer`: standard library and vLLM only, run as a script by the
Python that has vLLM (``python -I ldlp/bench/vllm_worker.py``), one process per (contender, C).

JSON lines on stdin/stdout (vLLM's own logging goes to stderr). The first line is the settings:
``{"target", "drafter" (with "k": the converted EAGLE-1 folder, or the EAGLE-3 head's speculators folder as
it is), "method" ("eagle" or "eagle3", with "k"), "k", "max_num_seqs", "max_model_len", "dtype", "threads",
"seed"}``; the answer is ``{"ready": true, "vllm": version, "load_s"}``. Then:

* ``{"cmd": "generate", "prompts": [[ids]], "max_new_tokens", "stop_token_ids", "temperature", "top_k",
  "top_p", "seeds"}`` -> ``{"outputs": [[ids]], "wall_s", "cpu_s", "num_drafts", "num_draft_tokens",
  "num_accepted_tokens", "request_s", "first_token_s", "token_gap_sum_s"}``: one ``LLM.generate`` over all the
  prompts (vLLM keeps at most ``max_num_seqs`` in flight and admits the next as one finishes); wall and
  process CPU seconds around that call only; the speculative counters are the deltas of vLLM's own metrics.
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
    """vLLM's cumulative speculative-decoding counters (0 without speculative decoding)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in out and hasattr(m, "value"):
            out[name] += int(m.value)
    return out


def _build(s: dict):
    import torch

    torch.set_num_threads(int(s.get("threads", 1)))
    from vllm import LLM

    kwargs = dict(model=s["target"], tokenizer=s["target"], skip_tokenizer_init=True, dtype=s.get("dtype", "float32"),
                  enforce_eager=True, enable_prefix_caching=False, max_num_seqs=int(s["max_num_seqs"]),
                  max_model_len=int(s["max_model_len"]), seed=int(s.get("seed", 0)), disable_log_stats=False,
                  # an explicit KV cache: vLLM's CPU default reserves a fraction of the machine's memory
                  kv_cache_memory_bytes=int(s.get("kv_cache_bytes", 512 << 20)))
    if s.get("k"):
        kwargs["speculative_config"] = {"method": s.get("method") or "eagle", "model": s["drafter"],
                                        "num_speculative_tokens": int(s["k"])}
    return LLM(**kwargs)


def _generate(llm, msg: dict) -> dict:
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
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in msg["prompts"]]
    before = _counters(llm)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = _counters(llm)
    reply = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "wall_s": wall, "cpu_s": cpu,
             **{k: after[k] - before[k] for k in after}, "request_s": [], "first_token_s": [], "token_gap_sum_s": 0.0}
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

        _send({"ready": True, "vllm": vllm.__version__, "load_s": time.perf_counter() - t0,
               "torch_threads": torch.get_num_threads()})
    except Exception as e:  # noqa: BLE001  (reported to the benchmark, which stops with it)
        _send({"error": f"building vLLM's LLM failed: {type(e).__name__}: {e}"})
        raise
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("cmd") == "quit":
            break
        try:
            _send(_generate(llm, msg))
        except Exception as e:  # noqa: BLE001
            _send({"error": f"{type(e).__name__}: {e}"})
            raise


if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    main()
