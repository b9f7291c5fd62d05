"""Peer engines in the batched benchmark: rows of another engine (vLLM, ``ldlp.bench.peers.vllm_peer``) measured on the
same prompts, budgets, stops and rounds, in turns with this engine's contenders, and the rows of the page's
section that sets them side by side (issue 22; ``ldlp.report.load_sweep`` writes it): per C, vLLM's AR and its
best EAGLE (or EAGLE-3) k against this engine's batched AR and best static γ, as paired ratios of tokens/s (this engine / the
peer) over the (round, block) workloads both ran.

A peer contender carries a ``runner`` (:class:`~ldlp.bench.comparisons.load_sweep.Contender`) whose
``run(prompts, C, max_new_tokens, seeds, sampling, stop_ids)`` returns the token ids per prompt and a summary
with :meth:`~ldlp.bench.harness.workload.WorkloadResult.summary`'s keys; the sweep checks its greedy outputs
against the target's like every other contender's. Its rows' ``policy`` is in :data:`PEER_POLICIES`: they are
neither static γ nor adaptive policies, so they take no part in choosing the baselines or in the
adaptive contenders' ratios.
"""

from __future__ import annotations

import math

PEER_POLICIES = ("vllm",)


def _pairs(runs: list[dict], label: str, C: int, T: float, clock: str = "wall") -> dict:
    sec = "cpu_s" if clock == "cpu" else "wall_s"
    return {(x["round"], x.get("block", 0)): (x["new_tokens"], x[sec]) for x in runs
            if x["contender"] == label and x["concurrency"] == C and x.get("temperature", T) == T and x.get(sec)}


def _ratio(runs, mine: str, theirs: str, C: int, T: float, clock: str = "wall") -> dict | None:
    from ldlp.bench.harness.stats import paired_ratio

    a, b = _pairs(runs, mine, C, T, clock), _pairs(runs, theirs, C, T, clock)
    common = sorted(set(a) & set(b))
    if not common:
        return None
    return paired_ratio([a[k][0] for k in common], [a[k][1] for k in common], [b[k][0] for k in common],
                        [b[k][1] for k in common], bootstrap=2000, seed=0)


def peer_table(result: dict, rows: list[dict]) -> list[dict]:
    """Per C with peer rows (``rows``: one temperature's; [] without peer rows): the peer's AR row (``peer_ar``)
    and its fastest speculative row (``peer_best``), this engine's batched AR (``ar``) and best static γ
    (``best_static``) rows, the paired ratios of tokens/s, this engine's over the peer's, for AR (``ratio_ar``)
    and speculative decoding (``ratio_speculative``), and whether every peer row was lossless (None: not checked)."""
    peers = [r for r in rows if r["policy"] in PEER_POLICIES and r.get("tokens_per_s") is not None]
    runs = result.get("runs", [])
    out = []
    for C in sorted({r["concurrency"] for r in peers}):
        here = [r for r in rows if r["concurrency"] == C and r.get("tokens_per_s") is not None]
        T = here[0]["temperature"]
        v_ar = next((r for r in here if r["policy"] in PEER_POLICIES and r["gamma"] == 0), None)
        v_spec = [r for r in here if r["policy"] in PEER_POLICIES and r["gamma"]]
        v_best = max(v_spec, key=lambda r: r["tokens_per_s"]) if v_spec else None
        o_ar = next((r for r in here if r["policy"] == "ar"), None)
        st = [r for r in here if r["policy"] == "static"]
        o_best = max(st, key=lambda r: r["tokens_per_s"]) if st else None
        lossless = [r["lossless"] for r in here if r["policy"] in PEER_POLICIES]
        out.append({"concurrency": C, "peer_ar": v_ar, "peer_best": v_best, "ar": o_ar, "best_static": o_best,
                    "ratio_ar": _ratio(runs, o_ar["contender"], v_ar["contender"], C, T) if o_ar and v_ar else None,
                    "ratio_speculative": (_ratio(runs, o_best["contender"], v_best["contender"], C, T)
                                          if o_best and v_best else None),
                    "lossless": None if None in lossless else all(lossless),
                    "differences": peer_differences(result.get("differences", []), v_ar, v_spec, C)})
    return out


def peer_differences(differences: list[dict], peer_ar: dict | None, peer_spec: list[dict], C: int) -> dict | None:
    """Where the peer's greedy outputs leave the target's at C (``differences``: the sweep's first difference per
    (contender, C, prompt), with its near-tie check; None when none does): the differing sequences, how many are
    near-ties, and whether every speculative row leaves at the same prompts, positions and tokens as the peer's
    own AR (``as_ar``; None without an AR row). In bfloat16 two engines' kernels round differently, so the peer's
    AR may take the other side of a near-tie; its speculative decoding is lossless when it follows its own AR."""
    labels = {r["contender"] for r in ([peer_ar] if peer_ar else []) + peer_spec}
    here = [d for d in differences if d["concurrency"] == C and d["contender"] in labels]
    if not here:
        return None

    def firsts(label):
        return {(d["prompt"], d.get("position"), d.get("got_token")) for d in here if d["contender"] == label}

    as_ar = None if peer_ar is None else all(firsts(r["contender"]) == firsts(peer_ar["contender"]) for r in peer_spec)
    return {"differing": len(here), "near_ties": sum(bool(d.get("near_tie")) for d in here), "as_ar": as_ar}


def versus_static(result: dict, rows: list[dict], label: str, statics: list[str]) -> dict | None:
    """``label`` (an adaptive contender: vLLM with a Dynamic SD schedule, or this engine's load_aware_step)
    against the static contenders ``statics`` (labels: vLLM's static k, or this engine's static γ), per C of
    ``rows`` (one temperature's): the best static at that C in hindsight (most tokens/s) and the single static
    best over the whole sweep (the highest geometric mean over C of its tokens/s relative to each C's best,
    among those run at every C), with paired ratios of tokens/s (``label`` / the static) by wall clock and by
    CPU seconds over the (round, block) workloads both ran. None without ``label``'s rows."""
    mine = {r["concurrency"]: r for r in rows if r["contender"] == label and r.get("tokens_per_s")}
    if not mine:
        return None
    runs = result.get("runs", [])
    st = {C: {r["contender"]: r for r in rows if r["contender"] in statics and r["concurrency"] == C
              and r.get("tokens_per_s")} for C in mine}
    everywhere = [s for s in statics if all(s in st[C] for C in mine)]
    best = {C: max(st[C].values(), key=lambda r: r["tokens_per_s"]) for C in mine if st[C]}

    def score(s):
        return sum(math.log(st[C][s]["tokens_per_s"] / best[C]["tokens_per_s"]) for C in best) / max(len(best), 1)

    single = max(everywhere, key=score) if everywhere else None
    out = []
    for C, row in sorted(mine.items()):
        b = best.get(C)
        T = row["temperature"]
        one = st[C].get(single) if single else None
        out.append({"concurrency": C, "mine": row, "best": b, "single": one,
                    "single_is_best": bool(b and one and b["contender"] == one["contender"]),
                    "ratio_best": _ratio(runs, label, b["contender"], C, T) if b else None,
                    "ratio_best_cpu": _ratio(runs, label, b["contender"], C, T, "cpu") if b else None,
                    "ratio_single": _ratio(runs, label, single, C, T) if one else None,
                    "ratio_single_cpu": _ratio(runs, label, single, C, T, "cpu") if one else None})
    return {"label": label, "statics": list(statics), "single": single, "rows": out}
