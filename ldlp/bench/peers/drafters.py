"""Drafters head to head: two (or more) drafters of one target, static chains in turns on every prompt.

The head to head (:mod:`ldlp.bench.comparisons.headtohead`) compares policies of one drafter; this compares drafters
(EAGLE-1 against EAGLE-3, docs/eagle3.md#goals). One target is loaded once; every drafter gets its candidate
generator on it. At T = 0 every (drafter, static γ) and the AR baseline take turns on every prompt in a
rotating order for ``rounds`` rounds (the order moves every prompt, so a slow phase of a shared machine hits
all alike); at T > 0 every drafter runs ``tau_gamma`` for ``sampled_rounds`` rounds (τ, the counters, is what
is measured there; sampled sequences are seeded per prompt, seed + prompt index). ``sampled_timed=true`` times
T > 0 as T = 0 is timed: every (drafter, static γ) and AR in turns, each drafter's best static γ and its paired
tokens/s against the reference's (a sampled sequence draws the same tokens in every round: one seed per prompt).

Paired against the first drafter (the reference), with a bootstrap 95% interval that resamples prompts (each
with all its rounds):

* τ at ``tau_gamma`` (new tokens over target forwards, summed over the prompts), per T;
* tokens/s of each drafter's best static γ at T = 0 (and at T > 0 with ``sampled_timed``; chosen in hindsight on
  these runs), its ratio to the reference's best;
* the draft-cost ratio c as the timed generations give it: milliseconds per drafted token over milliseconds
  per target pass, fitted to each drafter's static-γ generations (:func:`ldlp.bench.harness.replay.fit_costs`).

**Prompt sets side by side.** ``sets`` names entries of ``prompt_sets`` (each a ``conf/data`` node: the
embedded test split, in domain, and the shared MT-bench and ShareGPT prompts, out of domain); every set is
measured in turn on the one loaded target, and the page opens with one table of τ per set and temperature. A
set whose file is missing on this machine is skipped with one line (and listed under ``skipped``), never an
error unless every set is; ``sets=[]`` measures the ``data`` node alone.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from eagle_backbone.drafter_kinds import make_candidates
from eagle_backbone.loading import check_drafter_fits, load_drafter, load_target, tie_drafter_embedding
from eagle_backbone.metrics import GenerationStats
from eagle_backbone.policy import StaticPolicy
from eagle_backbone.runtime import int_setting, resolve_dtype
from eagle_backbone.sampling import SamplingConfig
from eagle_backbone.timing import interleaved
from ldlp.bench.harness.stats import paired_ratio
from ldlp.bench.harness.engines import EngineFactory
from ldlp.bench.harness.identity import GreedyReference
from ldlp.bench.harness.loaders import load_prompts, load_tokenizer_cached, machine_info
from ldlp.bench.harness.runners import ar_runner, engine_runner, progress_bar

log = logging.getLogger(__name__)


def _vs(num, den, ref_num, ref_den, bootstrap: int, seed: int) -> dict:
    """{"ratio", "ci95"}: (Σ num / Σ den) / (Σ ref_num / Σ ref_den) over prompts and its paired bootstrap 95%
    interval (:func:`~ldlp.bench.harness.stats.paired_ratio`: the same resampled prompts for every comparison of a
    run)."""
    r = paired_ratio(num, den, ref_num, ref_den, bootstrap=bootstrap, seed=seed)
    return {"ratio": r["ratio"], "ci95": r["ci95"]}


def prompt_sets(cfg) -> tuple[dict, dict]:
    """({name: data node} to measure, {name: why skipped}): the ``sets`` entries of ``prompt_sets`` (or the
    ``data`` node alone for ``sets=[]``), those whose file is missing on this machine skipped, each with one
    warning line. Refuses an unknown name, and a run with every set skipped."""
    names = list(cfg.get("sets") or [])
    if not names:
        return {str(cfg.data.get("name") or "data"): cfg.data}, {}
    known = cfg.get("prompt_sets") or {}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"sets: {unknown} not in prompt_sets (known: {sorted(known)})")
    use, skipped = {}, {}
    for name in names:
        node = known[name]
        path = node.get("path")
        if path and not Path(str(path)).is_file() and not node.get("build_if_missing"):
            skipped[name] = f"{path} does not exist (prompt_sets.{name}.path)"
            log.warning("prompt set %s skipped: %s", name, skipped[name])
        else:
            use[name] = node
    if not use:
        raise ValueError(f"no prompt set to measure: every one of {names} is missing ({'; '.join(skipped.values())})")
    return use, skipped


def bench_drafters(cfg) -> dict:
    names = list(cfg.drafters)
    if len(names) < 2:
        raise ValueError(f"drafters: give at least two (the first is the reference), got {names}")
    int_setting("generation.max_new_tokens", cfg.generation.max_new_tokens, 1)  # no page of NaN from no tokens
    sets, skipped = prompt_sets(cfg)
    tokenizer = load_tokenizer_cached(cfg.model)
    prompts_of = {name: load_prompts(node, tokenizer) for name, node in sets.items()}  # bad input: before loading
    for name in names:  # each EAGLE drafter's sizes against the target's, before anything loads
        check_drafter_fits(cfg.drafters[name].drafter_kind, cfg.drafters[name].drafter, cfg.model.target)
    target = load_target(cfg.model)
    device = str(cfg.model.get("device") or "cpu")
    attn = "eager" if (cfg.model.get("attn_implementation") or "sdpa") == "eager" else "sdpa"
    gens = {}
    for name in names:
        d = cfg.drafters[name]
        drafter = load_drafter(d.drafter_kind, d.drafter, cfg.model.dtype, device)
        tie_drafter_embedding(drafter, target)
        gens[name] = make_candidates(d.drafter_kind, drafter, target, attn)
    result = {"drafters": {k: dict(cfg.drafters[k]) for k in names}, "reference": names[0],
              "gammas": [int(g) for g in cfg.gammas], "tau_gamma": int(cfg.tau_gamma),
              "max_new_tokens": int(cfg.generation.max_new_tokens), "model": str(cfg.model.name),
              "dtype": resolve_dtype(cfg.model.get("dtype"), device), "machine": machine_info(),
              "sets": {}, "skipped": skipped}
    for set_name, node in sets.items():
        prompt_set = prompts_of[set_name]
        cell = {"dataset": str(node.get("name", Path(str(node.path)).stem)), "n_prompts": len(prompt_set),
                "prompt_set": dict(getattr(prompt_set, "info", {}) or {})}
        cell["by_temperature"] = bench_one_set(cfg, [ids for _, ids in prompt_set], target, gens, set_name)
        result["sets"][set_name] = cell
    result["summary"] = summary_rows(result)
    result["speed_summary"] = speed_rows(result)
    result["pairs"] = pair_rows(result, list(cfg.get("pairs") or []), int(cfg.bootstrap), int(cfg.seed))
    result["depth_summary"] = [{"set": s, "temperature": float(T), "drafter": name, "rates": [x["rate"] for x in rows]}
                               for s, cell in result["sets"].items() for T, t_cell in cell["by_temperature"].items()
                               for name, rows in t_cell["acceptance_by_depth"].items()]
    return result


def pair_rows(result: dict, pairs: list, bootstrap: int, seed: int) -> list[dict]:
    """τ at tau_gamma of drafter a over drafter b (``pairs``: ``[[a, b], ...]``, neither need be the reference), per
    set and T, paired over prompts with a bootstrap 95% interval: e.g. a new head against the shipped one."""
    import numpy as np

    g = result["tau_gamma"]
    rows = []
    for pair in pairs:
        a, b = (str(x) for x in pair)
        for name in (a, b):
            if name not in result["drafters"]:
                raise ValueError(f"pairs: {name!r} is not one of the drafters {list(result['drafters'])}")
        for set_name, cell in result["sets"].items():
            for T, t_cell in cell["by_temperature"].items():
                i, j = t_cell["labels"].index(f"{a} γ={g}"), t_cell["labels"].index(f"{b} γ={g}")
                tok, fwd = np.asarray(t_cell["tokens"])[:, 0], np.asarray(t_cell["target_forwards"])[:, 0]
                rows.append({"set": set_name, "temperature": float(T), "drafter": a, "over": b, "gamma": g,
                             "tau": float(tok[i].sum() / fwd[i].sum()), "over_tau": float(tok[j].sum() / fwd[j].sum()),
                             **_vs(tok[i], fwd[i], tok[j], fwd[j], bootstrap, seed)})
    return rows


def summary_rows(result: dict) -> list[dict]:
    """One row per (prompt set, T, drafter other than the reference): τ at tau_gamma of both, the paired ratio."""
    rows = []
    for set_name, cell in result["sets"].items():
        for T, t_cell in cell["by_temperature"].items():
            for name, x in t_cell["tau_vs_reference"].items():
                rows.append({"set": set_name, "temperature": float(T), "n_prompts": cell["n_prompts"], "drafter": name,
                             "gamma": x["gamma"], "tau": x["tau"], "reference_tau": x["reference_tau"],
                             "ratio": x["ratio"], "ci95": x["ci95"], "lossless": t_cell["lossless"]})
    return rows


def speed_rows(result: dict) -> list[dict]:
    """One row per (prompt set, timed T, drafter other than the reference): tokens/s of its best static γ and of
    the reference's, each over AR, and the paired ratio of the two with its interval."""
    rows = []
    ref = result["reference"]
    for set_name, cell in result["sets"].items():
        for T, t_cell in cell["by_temperature"].items():
            best = t_cell.get("best_static")
            if not best:
                continue
            for name, x in t_cell["best_static_vs_reference"].items():
                rows.append({"set": set_name, "temperature": float(T), "n_prompts": cell["n_prompts"],
                             "rounds": t_cell["rounds"], "drafter": name, "gamma": x["gamma"],
                             "tokens_per_s": best[name]["tokens_per_s"], "speedup_vs_ar": best[name]["speedup_vs_ar"],
                             "reference_gamma": x["reference_gamma"], "reference_tokens_per_s": best[ref]["tokens_per_s"],
                             "reference_speedup_vs_ar": best[ref]["speedup_vs_ar"], "ratio": x["ratio"], "ci95": x["ci95"],
                             "rounds_faster": x["rounds_faster"]})
    return rows


def bench_one_set(cfg, prompts: list[list[int]], target, gens: dict, set_name: str = "") -> dict:
    """Every temperature's cell (module docstring) on one prompt set: {str(T): cell}."""
    from ldlp.bench.harness.replay import fit_costs

    names = list(gens)
    gammas = [int(g) for g in cfg.gammas]
    tau_gamma = int(cfg.tau_gamma)
    n, seed, B = int(cfg.generation.max_new_tokens), int(cfg.seed), int(cfg.bootstrap)
    sampled_timed = bool(cfg.get("sampled_timed", False))
    if tau_gamma not in gammas and sampled_timed:
        raise ValueError(f"sampled_timed: tau_gamma={tau_gamma} must be one of gammas={gammas}")
    by_temperature = {}
    for T in [float(t) for t in cfg.temperatures]:
        sampling = SamplingConfig(temperature=T)
        greedy = sampling.greedy
        timed = greedy or sampled_timed  # every γ and AR in turns, the best static γ of each drafter
        contenders = [(name, g) for name in names for g in (gammas if timed else [tau_gamma])]
        runners = [engine_runner(f"{name} γ={g}", EngineFactory(target, gens[name]).decoder(StaticPolicy(g)), sampling)
                   for name, g in contenders]
        if timed:
            runners.append(ar_runner("ours", target, sampling))
        labels = [r.name for r in runners]
        rounds = int(cfg.rounds if greedy else cfg.sampled_rounds)
        for r in runners:  # warm-up
            r.run(prompts[0], min(16, n), seed)
        secs = np.zeros((len(runners), rounds, len(prompts)))
        tokens = np.zeros((len(runners), rounds, len(prompts)))
        fwds = np.zeros((len(runners), rounds, len(prompts)))
        outputs = [[None] * len(prompts) for _ in runners]
        stats_of = {name: [] for name in names}
        first_at_tau = {name: GenerationStats() for name in names}  # each drafter's steps at tau_gamma, first round
        bar = progress_bar(rounds * len(prompts), f"drafters {set_name} T={T}", bool(cfg.evaluation.get("progress", True)))

        def turn(i, prompt, k, r):
            out, st = runners[i].run(prompt, n, seed + k)
            secs[i, r, k], tokens[i, r, k], fwds[i, r, k] = st.wall_s, st.new_tokens, max(1, st.target_forwards)
            if r == 0:
                outputs[i][k] = out
            if i < len(contenders):
                stats_of[contenders[i][0]].append(st)
                if r == 0 and contenders[i][1] == tau_gamma:
                    first_at_tau[contenders[i][0]] += st

        interleaved(range(len(runners)), prompts, rounds, turn, order="rotate", after_item=lambda: bar.update(1))
        bar.close()
        lossless = None
        if greedy:
            lossless = GreedyReference.of_target(target, prompts, n).lossless(outputs)
        tok_p, sec_p = tokens.sum(1), secs.sum(1)  # per runner, per prompt (rounds summed)
        tau_p = tokens[:, 0], fwds[:, 0]  # τ from the first round (the counters repeat at T = 0)
        rows = []
        for i, label in enumerate(labels):
            rows.append({"contender": label, "drafter": contenders[i][0] if i < len(contenders) else "ar",
                         "gamma": contenders[i][1] if i < len(contenders) else 0,
                         "tokens_per_s": float(tok_p[i].sum() / sec_p[i].sum()),
                         "tau": float(tau_p[0][i].sum() / tau_p[1][i].sum()),
                         "tokens_per_s_rounds": (tokens[i].sum(1) / secs[i].sum(1)).tolist()})
        if timed:
            ar = rows[-1]["tokens_per_s"]
            for row in rows:
                row["speedup_vs_ar"] = row["tokens_per_s"] / ar
        cell = {"rounds": rounds, "lossless": lossless, "rows": rows, "labels": labels, "seconds": secs.tolist(),
                "tokens": tokens.tolist(), "target_forwards": fwds.tolist()}
        # where each drafter's τ goes: its chain's acceptance at every depth (first round, every prompt)
        cell["acceptance_by_depth"] = {name: [{"depth": k + 1, "reached": a, "kept": b, "rate": b / a if a else None}
                                              for k, (a, b) in enumerate(zip(*first_at_tau[name].reached_and_kept(tau_gamma)))]
                                       for name in names}
        ref_tau = labels.index(f"{names[0]} γ={tau_gamma}")
        cell["tau_vs_reference"] = {}
        for name in names[1:]:
            i = labels.index(f"{name} γ={tau_gamma}")
            cell["tau_vs_reference"][name] = {"gamma": tau_gamma, "tau": rows[i]["tau"], "reference_tau": rows[ref_tau]["tau"],
                                              **_vs(tau_p[0][i], tau_p[1][i], tau_p[0][ref_tau], tau_p[1][ref_tau], B, seed)}
        if timed:
            best = {}
            for name in names:
                idx = [i for i, (nm, _) in enumerate(contenders) if nm == name]
                b = max(idx, key=lambda i: rows[i]["tokens_per_s"])
                best[name] = b
                try:
                    lin = dict(fit_costs(stats_of[name]).meta["linear"])
                    lin["c"] = lin["draft_ms"] / lin["step_ms"] if lin["step_ms"] else None
                except ValueError:
                    lin = None
                cell.setdefault("costs", {})[name] = lin
            cell["best_static"] = {name: {"gamma": contenders[b][1], "tokens_per_s": rows[b]["tokens_per_s"],
                                          "speedup_vs_ar": rows[b]["speedup_vs_ar"], "tau": rows[b]["tau"]}
                                   for name, b in best.items()}
            cell["best_static_vs_reference"] = {}
            r0 = best[names[0]]
            for name in names[1:]:
                b = best[name]
                faster = int((tokens[b].sum(1) / secs[b].sum(1) > tokens[r0].sum(1) / secs[r0].sum(1)).sum())
                cell["best_static_vs_reference"][name] = {"gamma": contenders[b][1], "reference_gamma": contenders[r0][1],
                                                          **_vs(tok_p[b], sec_p[b], tok_p[r0], sec_p[r0], B, seed),
                                                          "rounds_faster": faster}
                # and at every γ: the same γ for both drafters
                cell.setdefault("same_gamma_vs_reference", {})[name] = {
                    g: _vs(tok_p[labels.index(f"{name} γ={g}")], sec_p[labels.index(f"{name} γ={g}")],
                           tok_p[labels.index(f"{names[0]} γ={g}")], sec_p[labels.index(f"{names[0]} γ={g}")], B, seed)
                    for g in gammas}
        by_temperature[str(T)] = cell
    return by_temperature
