"""Head to head: a few policies timed in one process, prompt by prompt, with a paired comparison.

A sweep times every policy in its own run, minutes apart; on a shared machine the speed drifts by
more than the few percent that separate good draft-length policies, and the best of eight noisy
static rows is itself biased upwards. Here the contenders (say the static γ around the sweep's best
and the best adaptive policies) and the AR baseline take turns on every prompt, in a rotating order,
for several rounds. Under greedy decoding they all emit the same tokens, so the ratio of two
contenders' seconds on the same prompt in the same round is a paired measurement; the report gives
each contender's tokens/s, its ratio to the best static contender with a bootstrap 95% interval, and
in how many rounds it was faster. The bootstrap resamples prompts, each with all its rounds: a policy
gains on some prompts and loses on others, and repeating a prompt does not average that away.

:func:`pool` combines several such runs of the same contenders (``scripts/pool_head_to_head.py``): the
machine's speed, and with it the price of a target pass against a drafted token, drifts between runs
by more than one run's interval shows, so its interval resamples runs as well as prompts.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from eagle_backbone.engine import SpeculativeDecoder
from ldlp.evaluation import (_ar_runner, _engine_runner, _progress, _sampling, apply_tuned, build_policy,
                             load_pair_cached, load_prompts, machine_info)

log = logging.getLogger(__name__)


def _label(name: str, policy) -> str:
    return f"static γ={policy.fixed_gamma}" if not getattr(policy, "adaptive", True) else name


def head_to_head(cfg, contenders: list[tuple[str, object]], rounds: int = 5, bootstrap: int = 2000) -> dict:
    """``contenders``: (policy name, policy config) pairs; ``cfg`` as for :func:`ldlp.evaluation.evaluate`
    (model, data, generation, evaluation, seed, tuned_from). Greedy decoding only."""
    sampling = _sampling(cfg.generation)
    if not sampling.greedy:
        raise ValueError("head to head compares greedy runs (their outputs coincide): set generation.temperature=0")
    if rounds < 1 or len(contenders) < 2:
        raise ValueError(f"head to head needs at least 2 contenders and 1 round, got {len(contenders)} and {rounds}")
    pair = load_pair_cached(cfg.model)
    prompts = [ids for _, ids in load_prompts(cfg.data, pair.tokenizer)]
    n, seed = int(cfg.generation.max_new_tokens), int(cfg.seed)
    runners, labels, settings, adaptive = [], [], [], []
    for name, pcfg in contenders:
        pcfg, _ = apply_tuned(pcfg, cfg.get("tuned_from"), name)
        policy = build_policy(pcfg)
        if hasattr(policy, "bind"):
            policy.bind(pair.target, pair.candidates, n, sampling)
        label = _label(name, policy)
        if label in labels:
            raise ValueError(f"contender {label!r} is listed twice")
        runners.append(_engine_runner(label, SpeculativeDecoder(pair.target, pair.candidates, policy), sampling))
        labels.append(label)
        settings.append({k: v for k, v in dict(pcfg).items() if k != "_target_"})
        adaptive.append(bool(getattr(policy, "adaptive", True)))
    runners.append(_ar_runner("ours", pair.target, sampling))
    labels.append("AR")
    for r in runners:  # warm-up
        r.run(prompts[0], min(16, n), seed)

    secs = np.zeros((len(runners), rounds, len(prompts)))
    tokens = np.zeros((len(runners), len(prompts)), dtype=int)
    counts = np.zeros((len(runners), 2), dtype=int)  # target forwards, drafted tokens (deterministic: round 0)
    timed = []  # every speculative generation's stats: what a target pass and a drafted token cost here
    outputs: list[list] = [[None] * len(prompts) for _ in runners]
    progress = _progress(rounds * len(prompts), "head to head", bool(cfg.evaluation.get("progress", True)))
    for r in range(rounds):
        for k, prompt in enumerate(prompts):
            shift = (r * len(prompts) + k) % len(runners)  # every runner takes every place in the order
            for i in list(range(len(runners)))[shift:] + list(range(len(runners)))[:shift]:
                out, stats = runners[i].run(prompt, n, seed + k)
                secs[i, r, k] = stats.wall_s
                if r == 0:
                    outputs[i][k], tokens[i, k] = out, stats.new_tokens
                    counts[i] += (stats.target_forwards, stats.drafted_tokens)
                if i < len(contenders):
                    timed.append(stats)
            progress.update(1)
    progress.close()
    lossless = all(outputs[i] == outputs[-1] for i in range(len(runners) - 1))
    if not lossless:
        log.warning("head to head: some greedy outputs differ from the AR output")

    per_round = tokens.sum(1)[:, None] / secs.sum(2)  # tokens/s of each runner in each round
    overall = rounds * tokens.sum(1) / secs.sum((1, 2))  # every round emits the same tokens
    names = [name for name, _ in contenders]
    static = [i for i in range(len(contenders)) if not adaptive[i]]
    ref = max(static, key=lambda i: overall[i]) if static else None  # the fastest static γ over all pairs
    rng = np.random.default_rng(seed)
    boot_k = rng.integers(0, len(prompts), size=(bootstrap, len(prompts)))  # prompts drawn with replacement
    rows = []
    for i, label in enumerate(labels):
        row = {"contender": label, "policy": names[i] if i < len(contenders) else "ar",
               "adaptive": adaptive[i] if i < len(contenders) else None,
               "setting": settings[i] if i < len(contenders) else None,
               "tokens_per_s": float(overall[i]), "speedup": float(overall[i] / overall[-1]),
               "tokens_per_s_rounds": per_round[i].tolist(), "tau": float(tokens[i].sum() / counts[i, 0]),
               "drafted_tokens": int(counts[i, 1]),
               "wasted_tokens": int(counts[i, 1] - (tokens[i].sum() - counts[i, 0]))}
        if ref is not None and i != ref and i < len(contenders):
            # seconds of the reference over seconds of this contender on the same pairs: > 1 means faster
            boot = secs[ref][:, boot_k].sum((0, 2)) / secs[i][:, boot_k].sum((0, 2))
            row.update(vs_best_static=float(secs[ref].sum() / secs[i].sum()),
                       ci95=[float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))],
                       rounds_faster=int((secs[i].sum(1) < secs[ref].sum(1)).sum()))
        rows.append(row)
    result = {"rows": rows, "reference": labels[ref] if ref is not None else None, "rounds": rounds,
              "n_prompts": len(prompts), "max_new_tokens": n, "new_tokens": int(tokens[-1].sum()),
              "lossless": lossless, "tuned_from": str(cfg.get("tuned_from")) if cfg.get("tuned_from") else None,
              "dataset": str(cfg.data.get("name", Path(str(cfg.data.path)).stem)), "machine": machine_info(),
              "model": str(cfg.model.get("name", "")), "labels": labels, "seconds": secs.tolist(),
              "tokens": tokens.tolist(), "costs": _costs(timed)}
    result.update(verdict(result))
    return result


def _costs(stats) -> dict | None:
    """Seconds per target pass, drafted token and accepted token, fitted to the timed generations (the
    replay tuner's cost model, measured in the comparison's own setting); None when they cannot separate."""
    from ldlp.replay import fit_costs

    try:
        return fit_costs(stats).as_dict()
    except ValueError:
        return None


def _best_adaptive(rows: list[dict], ratio: str) -> tuple[dict | None, dict]:
    """The adaptive row (the oracle is not one) with the highest ``ratio`` to the best static contender,
    and the verdict's keys: its name, gain, the gain's 95% interval and whether it excludes zero."""
    adaptive = [r for r in rows if r.get("adaptive") and r.get("policy") != "oracle" and "ci95" in r]
    if not adaptive:
        return None, {}
    best = max(adaptive, key=lambda r: r[ratio])
    return best, {"best_adaptive": best["contender"], "adaptive_gain": best[ratio] - 1,
                  "adaptive_gain_ci95": [best["ci95"][0] - 1, best["ci95"][1] - 1],
                  "adaptive_beats_static": best["ci95"][0] > 1}


def _verdict_line(result: dict, ref: str, what: str) -> str:
    lo, hi = result["adaptive_gain_ci95"]
    word = "faster than" if lo > 0 else "slower than" if hi < 0 else "not distinguishable from"
    return (f"- {what}: **{result['best_adaptive']}**, {100 * result['adaptive_gain']:+.1f}% vs {ref} "
            f"(95% interval {100 * lo:+.1f}% to {100 * hi:+.1f}%): {word} the best static γ")


def verdict(result: dict) -> dict:
    """The best adaptive contender (the oracle is not one) against the best static one, and the share of
    the oracle's headroom over the best static contender that it captures (when the oracle ran)."""
    rows = result["rows"]
    best, out = _best_adaptive(rows, "vs_best_static")
    if best is None:
        return {}
    ref = next(r for r in rows if r["contender"] == result["reference"])
    oracle = next((r for r in rows if r["policy"] == "oracle"), None)
    if oracle is not None and oracle["tokens_per_s"] > ref["tokens_per_s"]:
        out["headroom_captured"] = ((best["tokens_per_s"] - ref["tokens_per_s"])
                                    / (oracle["tokens_per_s"] - ref["tokens_per_s"]))
    return out


def markdown(result: dict) -> str:
    ref = result["reference"]
    lines = [f"### Head to head ({result['model']})", "",
             f"{len(result['rows']) - 1} contenders and the AR baseline take turns on every prompt (rotating order) "
             f"for {result['rounds']} rounds in one process: {result['n_prompts']} prompts of {result['dataset']}, "
             f"{result['max_new_tokens']} new tokens at most, greedy. `vs {ref}` is the ratio of seconds on the same "
             "(round, prompt) pairs (> 1: faster than the best static contender), with a bootstrap 95% interval "
             "that resamples prompts (each with all its rounds); tokens/s are totals over all pairs.", "",
             f"| contender | setting | τ | wasted | tokens/s | speedup vs AR | vs {ref} | 95% interval | rounds faster |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        setting = ", ".join(f"{k}={v}" for k, v in (r.get("setting") or {}).items() if k != "path") or "–"
        vs = f"{r['vs_best_static']:.3f}" if "vs_best_static" in r else ("1 (reference)" if r["contender"] == ref
                                                                          else "–")
        ci = f"{r['ci95'][0]:.3f} – {r['ci95'][1]:.3f}" if "ci95" in r else "–"
        faster = f"{r['rounds_faster']}/{result['rounds']}" if "rounds_faster" in r else "–"
        wasted = r["wasted_tokens"] if r["contender"] != "AR" else "–"
        lines.append(f"| {r['contender']} | {setting} | {r['tau']:.2f} | {wasted} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {vs} | {ci} | {faster} |")
    lines.append("")
    if "best_adaptive" in result:
        lines.append(_verdict_line(result, ref, "best adaptive"))
    if "headroom_captured" in result:
        lines.append(f"- headroom captured: **{100 * result['headroom_captured']:.0f}%** of (oracle − best static) "
                     "in tokens/s, all timed in turns")
    c = result.get("costs")
    if c:
        lines.append(f"- time fitted to these generations: {c['step_ms']:.2f} ms per target pass + {c['draft_ms']:.2f} ms "
                     f"per drafted token + {c['accepted_ms']:.2f} ms per accepted token")
    lines.append("- every greedy output equals the AR output" if result["lossless"]
                 else "- **some greedy outputs differ from the AR output**")
    return "\n".join(lines) + "\n"


# -- several head-to-head runs, pooled ---------------------------------------------------------------------


def _key(row: dict) -> str:
    """A contender's identity across runs: its label and its setting (checkpoint paths aside)."""
    setting = ", ".join(f"{k}={v}" for k, v in sorted((row.get("setting") or {}).items()) if k != "path")
    return f"{row['contender']} ({setting})" if row.get("adaptive") else row["contender"]


def pool(results: list[dict], names: list[str] | None = None, bootstrap: int = 2000, seed: int = 0) -> dict:
    """Pool head-to-head runs (``head_to_head.json`` contents).

    A run measures every contender on the same (round, prompt) pairs, so ratios are paired within a
    run; across runs the machine's speed, and with it the price of a target pass against a drafted
    token, moves. The reference is the static contender fastest over all runs among those in every run.
    Reported per contender (pooled over the runs it is in): its ratio to the reference in each run,
    their median, the pooled ratio over all its pairs, and that ratio's bootstrap 95% interval, which
    resamples runs (so the drift between runs widens it) and then prompts within each run (each prompt
    with all its rounds). Ratios > 1 mean faster than the reference. With an oracle contender, the share
    of its headroom that the best adaptive contender captures."""
    if not results:
        raise ValueError("pool: no head-to-head runs given")
    where = names or [f"run {i + 1}" for i in range(len(results))]
    keyed = []  # per run: contender key -> row index
    for name, res in zip(where, results):
        if not res.get("lossless", False):
            raise ValueError(f"{name}: its greedy outputs differ from the AR output; a lossy run is not pooled")
        keyed.append({_key(r): i for i, r in enumerate(res["rows"]) if r["contender"] != "AR"})
    keys = list(dict.fromkeys(k for rows in keyed for k in rows))  # in order of first appearance
    present = {k: [j for j, rows in enumerate(keyed) if k in rows] for k in keys}
    first = {k: results[present[k][0]]["rows"][keyed[present[k][0]][k]] for k in keys}
    secs = [{k: np.asarray(res["seconds"][i]) for k, i in rows.items()} for res, rows in zip(results, keyed)]
    static = [k for k in keys if not first[k].get("adaptive") and len(present[k]) == len(results)]
    if not static:
        raise ValueError(f"pool: no static contender is in every run (contenders: {keys})")
    ref = min(static, key=lambda k: sum(s[k].sum() for s in secs))  # the same tokens in every run
    rng = np.random.default_rng(seed)
    # two-level bootstrap: runs with replacement (the machine's drift between runs), then prompts within each
    draws = [rng.integers(0, s[ref].shape[1], size=(bootstrap, s[ref].shape[1])) for s in secs]
    # per run and contender: its seconds summed over each resample of that run's prompts, (bootstrap,)
    resampled = [{k: v[:, d].sum((0, 2)) for k, v in s.items()} for s, d in zip(secs, draws)]
    cols = np.arange(bootstrap)[:, None]

    def boot_ratio(k):  # (bootstrap,) pooled ratios of contender k over the runs it is in
        runs = present[k]
        pick = np.random.default_rng([seed, *runs]).integers(0, len(runs), size=(bootstrap, len(runs)))
        seconds = lambda c: np.stack([resampled[j][c] for j in runs])[pick, cols].sum(1)  # noqa: E731
        return seconds(ref) / seconds(k)

    out_rows = []
    for k in keys:
        per_run = [float(s[ref].sum() / s[k].sum()) if k in s else None for s in secs]
        mine = [r for r in per_run if r is not None]
        row = {"contender": k, "policy": first[k].get("policy"), "adaptive": bool(first[k].get("adaptive")),
               "per_run": per_run, "median": float(np.median(mine)),
               "pooled": float(sum(secs[j][ref].sum() for j in present[k]) / sum(secs[j][k].sum() for j in present[k])),
               "tokens_per_s": [res["rows"][rows[k]]["tokens_per_s"] if k in rows else None
                                for res, rows in zip(results, keyed)]}
        if k != ref:
            b = boot_ratio(k)
            row["ci95"] = [float(np.quantile(b, 0.025)), float(np.quantile(b, 0.975))]
            row["runs_faster"] = sum(r > 1 for r in mine)
        out_rows.append(row)
    out = {"runs": where, "reference": ref, "rows": out_rows,
           "pairs": int(sum(s[ref].size for s in secs)), "bootstrap": bootstrap,
           "ar_speedup_of_reference": [res["rows"][rows[ref]]["speedup"] for res, rows in zip(results, keyed)],
           "costs": [res.get("costs") for res in results]}
    best, verdict_keys = _best_adaptive(out_rows, "pooled")
    out.update(verdict_keys)
    oracle = next((r for r in out_rows if r["policy"] == "oracle"), None)
    if best is not None and oracle is not None and oracle["pooled"] > 1:
        out["headroom_captured"] = (best["pooled"] - 1) / (oracle["pooled"] - 1)
    return out


def pooled_markdown(p: dict, links: list[str] | None = None) -> str:
    ref, n = p["reference"], len(p["runs"])
    runs = [f"[{r}]({link})" for r, link in zip(p["runs"], links)] if links else p["runs"]
    lines = [f"{n} head-to-head runs ({', '.join(runs)}), {p['pairs']} timed (round, prompt) pairs of the reference "
             f"in all. Ratios are seconds of **{ref}** (the static contender fastest over all runs) over the "
             "contender's, on the same pairs: > 1 is faster. A contender is pooled over the runs it is in (– where "
             "it did not run); the 95% interval of its pooled ratio resamples those runs, then prompts within each.",
             "",
             "| contender | " + " | ".join(f"{r}" for r in p["runs"]) + " | median | pooled | 95% interval | runs faster |",
             "|---|" + "---:|" * (n + 4)]
    for r in p["rows"]:
        cells = " | ".join("–" if v is None else f"{v:.3f}" for v in r["per_run"])
        ci = f"{r['ci95'][0]:.3f} – {r['ci95'][1]:.3f}" if "ci95" in r else "–"
        n_in = sum(v is not None for v in r["per_run"])
        faster = f"{r['runs_faster']}/{n_in}" if "runs_faster" in r else "reference"
        lines.append(f"| {r['contender']} | {cells} | {r['median']:.3f} | {r['pooled']:.3f} | {ci} | {faster} |")
    lines.append("")
    lines.append(f"- {ref} over AR, per run: " + ", ".join(f"{s:.2f}x" for s in p["ar_speedup_of_reference"]))
    if "best_adaptive" in p:
        lines.append(_verdict_line(p, ref, "best adaptive, pooled"))
    if "headroom_captured" in p:
        lines.append(f"- headroom captured: **{100 * p['headroom_captured']:.0f}%** of (oracle − {ref}), both pooled "
                     "(over the runs each is in)")
    if any(p["costs"]):
        lines.append("- fitted per target pass / per drafted token, per run: " + ", ".join(
            f"{c['step_ms']:.1f} / {c['draft_ms']:.2f} ms" if c else "–" for c in p["costs"]))
    return "\n".join(lines) + "\n"


def pool_folders(patterns: list[str], out_dir: str | Path, bootstrap: int = 2000, seed: int = 0,
                 readme: str | Path | None = None, command: str = "") -> dict:
    """:func:`pool` over the ``head_to_head.json`` of every folder matching ``patterns`` (globs, in sorted
    order); writes pooled.json and pooled.md to ``out_dir`` and, with ``readme``, puts the table into its
    ``<!-- head_to_head_long:start -->`` block."""
    import glob
    import json

    from ldlp.summary import _atomic_write, replace_readme_block

    folders = sorted({Path(f) for pat in patterns for f in glob.glob(str(pat))})
    files = [f / "head_to_head.json" for f in folders if (f / "head_to_head.json").is_file()]
    if not files:
        raise ValueError(f"no head_to_head.json in folders matching {list(patterns)} "
                         "(write them with python scripts/compare.py out_dir=...)")
    results = []
    for f in files:
        try:
            results.append(json.loads(f.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not valid JSON ({e})") from None
        missing = [k for k in ("rows", "seconds", "lossless") if k not in results[-1]]
        if missing:
            raise ValueError(f"{f}: lacks {missing}; is it a head_to_head.json of scripts/compare.py?")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pooled = pool(results, [f.parent.name for f in files], bootstrap, seed)
    links = [os.path.relpath(f.parent / "head_to_head.md", out) for f in files]
    md = pooled_markdown(pooled, links)
    _atomic_write(out / "pooled.json", json.dumps(pooled, indent=2) + "\n")
    _atomic_write(out / "pooled.md", md)
    if readme is not None:
        rel = lambda f: os.path.relpath(f, Path(readme).parent)  # noqa: E731
        body = (f"Regenerate with `{command}` (table: [{rel(out / 'pooled.md')}]({rel(out / 'pooled.md')})).\n\n"
                + pooled_markdown(pooled, [rel(f.parent / "head_to_head.md") for f in files]))
        pooled["readme_updated"] = replace_readme_block(readme, "head_to_head_long", body)
    return pooled
