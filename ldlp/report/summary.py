"""Turn evaluation runs (``results.json`` files, e.g. Hydra multirun folders) into a table and a plot.

Rows are grouped by what was run (model, prompt set, generation settings, policy and its settings);
a row's timings are the medians over all its runs (repeated sweeps and in-process rounds), its counters
come from the first run (they are deterministic). Per model, the summary also reports the best static
γ, the best adaptive policy, the oracle, and the fraction of the oracle's headroom over the best static
γ that the best adaptive policy captures:

    headroom captured = (best adaptive - best static) / (oracle - best static)   in tokens/s.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from eagle_backbone.io import atomic_path, atomic_write_text
from ldlp.bench.comparisons.categories import merge_runs
from ldlp.report.categories import category_markdown
from ldlp.bench.harness.stats import headroom_captured, median, percent
from ldlp.report.figures import pyplot, save_figure

log = logging.getLogger(__name__)

STATIC, ORACLE = "static", "oracle"
POLICY_ORDER = ["static", "ldlp", "ldlp_ddd", "ddd", "confidence", "entropy", "heuristic", "hf_heuristic",
                "hf_confidence", "oracle"]
MEDIAN_KEYS = ("wall_s", "tokens_per_s", "ar_tokens_per_s", "speedup", "draft_s", "target_s", "policy_s")
COUNTER_KEYS = ("n_prompts", "new_tokens", "tau", "target_forwards", "drafted_tokens", "wasted_tokens",
                "acceptance_rate", "mean_drafted_per_step")
COLUMNS = [  # (key, header, format)
    ("policy", "Policy", "{}"), ("gamma", "γ", "{}"), ("tau", "τ", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"), ("draft_s", "draft s", "{:.2f}"), ("target_s", "target s", "{:.2f}"),
    ("policy_s", "policy s", "{:.3f}"), ("target_forwards", "target forwards", "{}"),
    ("wasted_tokens", "wasted tokens", "{}"), ("lossless", "lossless", "{}"), ("runs", "runs", "{}"),
]
MODEL_TITLES = {"eagle": "EAGLE drafter", "draft_lm": "standalone draft LM"}


def find_results(paths) -> list[dict]:
    """Every ``results.json`` under ``paths`` (folders searched recursively, or the files themselves)."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files.extend(sorted(p.rglob("results.json")))
        else:
            raise ValueError(f"summary: {p} does not exist")
    if not files:
        raise ValueError(f"summary: no results.json under {', '.join(map(str, paths))} (did the evaluation run?)")
    out = []
    for f in files:
        try:
            r = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not valid JSON ({e})") from None
        missing = [k for k in ("policy", "tokens_per_s", "model") if k not in r]
        if missing:
            raise ValueError(f"{f}: not an evaluation result (missing {missing})")
        r["_file"] = str(f)
        out.append(r)
    return out


# what identifies a run's prompt set: the data config's name, the file (path and content hash), the subset
# (limit, sample seed), the turns, and the prompts it kept; results.json carries them (ldlp.bench.comparisons.evaluate)
PROMPT_SET_KEYS = ("dataset", "data_path", "data_sha256", "limit", "sample_seed", "turns", "n_prompts")


def _set_key(r: dict) -> str:
    return json.dumps([r.get(k) for k in PROMPT_SET_KEYS], default=str)


def _set_label(r: dict) -> str:
    bits = [Path(str(r["data_path"])).name] if r.get("data_path") else []
    if r.get("data_sha256"):
        bits.append(f"sha256 {str(r['data_sha256'])[:12]}")
    if r.get("limit") is not None:
        bits.append(f"limit {r['limit']}")
    if r.get("sample_seed") is not None:
        bits.append(f"sample seed {r['sample_seed']}")
    if r.get("turns") not in (None, "first"):
        bits.append(f"turns {r['turns']}")
    return f"{r.get('dataset')} ({', '.join(bits)})" if bits else str(r.get("dataset"))


def _group_key(r: dict) -> str:
    settings = {k: v for k, v in (r.get("policy_config") or {}).items() if k != "_target_"}
    return json.dumps([r.get("model"), r.get("drafter_kind"), _set_key(r), r.get("temperature"),
                       r.get("max_new_tokens"), r["policy"], r.get("gamma"), settings], sort_keys=True, default=str)


def _warn_unidentified(results: list[dict]) -> None:
    """One warning for results.json files written before runs recorded their prompt file's hash."""
    old = [r for r in results if "data_sha256" not in r]
    if old:
        log.warning("summary: %d of %d results.json files predate the prompt-file hash (e.g. %s): runs of the same "
                    "data config on different prompt files, limits, sample seeds or turns cannot be told apart among "
                    "them and may share a row; rerun them (scripts/evaluate.py) to separate them", len(old),
                    len(results), old[0].get("_file", "?"))


def aggregate(results: list[dict]) -> list[dict]:
    """One row per configuration: medians of timings over its runs, counters of its first run."""
    _warn_unidentified(results)
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(_group_key(r), []).append(r)
    rows = []
    for runs in groups.values():
        first = runs[0]
        row = {k: first.get(k) for k in ("policy", "gamma", "model", "drafter_kind", "dataset", "temperature",
                                          "max_new_tokens", "engine", "ar_impl")}
        row.update({k: first.get(k) for k in COUNTER_KEYS})
        row.update({k: median([r.get(k) for r in runs]) for k in MEDIAN_KEYS})
        flags = [r.get("lossless") for r in runs]
        row["lossless"] = False if False in flags else (True if flags and all(f is True for f in flags) else None)
        row["runs"] = len(runs)
        row["repeats"] = sum(int(r.get("repeats", 1)) for r in runs)
        row["settings"] = {k: v for k, v in (first.get("policy_config") or {}).items() if k != "_target_"}
        row["machine"] = first.get("machine")
        row["by_category"], row["all_categories"], row["by_task"] = merge_runs(runs)  # per category (Spec-Bench's figures too)
        row.update({k: first.get(k) for k in PROMPT_SET_KEYS + ("n_dropped", "dropped_reason", "n_skipped_records")})
        rows.append(row)
    rows.sort(key=_row_order)
    return rows


def _row_order(row: dict):
    p = row["policy"]
    rank = POLICY_ORDER.index(p) if p in POLICY_ORDER else len(POLICY_ORDER) - 1
    return (row.get("drafter_kind") != "eagle", str(row.get("model")), rank, row.get("gamma") or 0, p)


RANK_KEY = "speedup"  # rows are compared by speedup over the AR baseline timed interleaved in the same run


def headline(rows: list[dict]) -> dict:
    """Per model: best static γ, best adaptive policy, oracle, headroom captured, best speedup, lossless.

    Policies are compared by their speedup over the AR baseline that was timed interleaved with them,
    prompt by prompt, in the same run: on a machine whose speed drifts between runs (shared CPUs do),
    raw tokens/s of runs minutes apart compare the machine as much as the policies, while the ratio to
    a baseline timed alongside cancels the drift. Equivalently: tokens/s at the median AR speed.
    """
    out = {}
    n_sets = len({_set_key(r) for r in rows})
    for model, pset in dict.fromkeys((r["model"], _set_key(r)) for r in rows):  # runs of other prompt sets: apart
        mine = [r for r in rows if r["model"] == model and _set_key(r) == pset]
        static = [r for r in mine if r["policy"] == STATIC and r.get(RANK_KEY) is not None]
        oracle = [r for r in mine if r["policy"] == ORACLE and r.get(RANK_KEY) is not None]
        adaptive = [r for r in mine if r["policy"] not in (STATIC, ORACLE) and r.get(RANK_KEY) is not None]
        h = {"model": model, "drafter_kind": mine[0].get("drafter_kind"), "ranked_by": RANK_KEY}
        best_static = max(static, key=lambda r: r[RANK_KEY], default=None)
        best_adaptive = max(adaptive, key=lambda r: r[RANK_KEY], default=None)
        pick = lambda r, **kw: {**kw, "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"], "tau": r["tau"]}  # noqa: E731
        if best_static:
            h["best_static"] = pick(best_static, gamma=best_static["gamma"])
        if best_adaptive:
            h["best_adaptive"] = pick(best_adaptive, policy=best_adaptive["policy"])
        if oracle:
            h["oracle"] = pick(oracle[0])
        if best_static and best_adaptive:
            h["adaptive_gain"] = best_adaptive[RANK_KEY] / best_static[RANK_KEY] - 1
            h["adaptive_beats_static"] = best_adaptive[RANK_KEY] > best_static[RANK_KEY]
        if best_static and best_adaptive and oracle:
            h["headroom_captured"] = headroom_captured(best_adaptive[RANK_KEY], best_static[RANK_KEY],
                                                       oracle[0][RANK_KEY])
        speedups = [r["speedup"] for r in mine if r["speedup"] is not None and r["policy"] != ORACLE]
        h["best_speedup"] = max(speedups, default=None)
        greedy = [r for r in mine if r.get("temperature") == 0]
        h["all_greedy_lossless"] = all(r["lossless"] is True for r in greedy) if greedy else None
        h["prompt_set"], h["prompt_set_key"] = _set_label(mine[0]), pset
        name = model if n_sets == 1 else f"{model} on {h['prompt_set']}"
        out[name if name not in out else f"{name}, {len(mine)} rows, {mine[0].get('n_prompts')} prompts"] = h
    return out


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None:
        return "–"
    if key == "lossless":
        return "yes" if v else "**NO**"
    if key == "policy":
        return _policy_label(row)
    return fmt.format(v)


def _policy_label(row: dict) -> str:
    p = row["policy"]
    if p == STATIC:
        return "static"
    settings = row.get("settings") or {}
    if "threshold" in settings and settings.get("threshold") is not None:
        return f"{p} (threshold {settings['threshold']:g})"
    if p == "hf_confidence" and settings.get("confidence_threshold") is not None:
        return f"{p} (threshold {settings['confidence_threshold']:g}, self-tuning)"
    return p


def sweep_markdown(rows: list[dict], heads: dict, title: str = "Static vs adaptive draft length") -> str:
    lines = [f"## {title}", ""]
    first = rows[0]
    several = len({_set_key(r) for r in rows}) > 1
    lines.append(_prompt_set_line(first) if not several else
                 f"Rows of {len({_set_key(r) for r in rows})} prompt sets, each under its own heading: runs on "
                 "different prompt files, limits, sample seeds or turns are never merged nor compared.")
    for name, h in heads.items():
        model = h.get("model", name)
        kind = MODEL_TITLES.get(h.get("drafter_kind"), h.get("drafter_kind"))
        mine = [r for r in rows if r["model"] == model and (not several or _set_key(r) == h.get("prompt_set_key"))]
        lines += ["", f"### {name} ({kind})", ""]
        if several:
            lines += [_prompt_set_line(mine[0]), ""]
        lines.append("| " + " | ".join(c[1] for c in COLUMNS) + " |")
        lines.append("|" + "|".join("---" if c[0] == "policy" else "---:" for c in COLUMNS) + "|")
        for r in mine:
            lines.append("| " + " | ".join(_cell(r, k, f) for k, _, f in COLUMNS) + " |")
        ar = median([r.get("ar_tokens_per_s") for r in mine])
        lines.append("")
        facts = []
        if ar:
            facts.append(f"AR baseline {ar:.1f} tokens/s ({mine[0].get('ar_impl')} implementation, the faster of "
                         "this project's and transformers' generate)")
        at = lambda x: f"{x['speedup']:.2f}x ({x['tokens_per_s']:.1f} tokens/s)"  # noqa: E731
        if "best_static" in h:
            facts.append(f"best static in the sweep: γ = {h['best_static']['gamma']} at {at(h['best_static'])}")
        if "best_adaptive" in h:
            gain = h.get("adaptive_gain")
            facts.append(f"best adaptive in the sweep: {h['best_adaptive']['policy']} at {at(h['best_adaptive'])}"
                         + (f", {100 * gain:+.1f}% vs best static" if gain is not None else ""))
        if "oracle" in h:
            facts.append(f"oracle (upper bound): {at(h['oracle'])}")
        if "headroom_captured" in h:
            facts.append(f"headroom captured in the sweep: {percent(h['headroom_captured'])} of (oracle − best static); "
                         "rows a few percent apart are within the noise of runs timed minutes apart (the head to "
                         "head below, if run, times the leaders in turns)")
        if h.get("best_speedup") is not None:
            facts.append(f"best speedup over AR (oracle excluded): {h['best_speedup']:.2f}x")
        if h.get("all_greedy_lossless") is not None:
            facts.append("every greedy output equals the target's own greedy decoding" if h["all_greedy_lossless"]
                         else "**some greedy outputs differ from the target's own greedy decoding**")
        lines += [f"- {f}" for f in facts]
        cats = category_markdown([(_policy_label(r) + ("" if r.get("gamma") is None else f" γ={r['gamma']}"),
                                   r["by_category"], r["all_categories"], r.get("by_task"))
                                  for r in mine if r.get("by_category")])
        if cats:
            lines += ["", cats.rstrip("\n")]
    runs = sorted({r["runs"] for r in rows})
    reps = sorted({r["repeats"] for r in rows})
    m = first.get("machine") or {}
    lines += ["", f"Timings are medians over {_span(reps)} rounds per row ({_span(runs)} evaluation runs): in "
              "every round the AR baseline and the speculative run alternate prompt by prompt in the same "
              "process, and the sweeps are repeated one after the other so that rounds interleave the policies. "
              "Best/headroom compare speedups over that interleaved AR baseline (raw tokens/s of runs minutes "
              "apart also measure the machine's drift). τ = tokens per target forward (prefill included); "
              "wasted = drafted tokens the target rejected; seconds are totals over the prompt set. Counters are "
              "deterministic; timings are not.",
              "",
              f"Machine: {m.get('cpu', '?')}, {m.get('cpu_count', '?')} CPUs, torch {m.get('torch', '?')} "
              f"with {m.get('torch_threads', '?')} threads" + (f", GPU {m['gpu']}" if m.get("gpu") else "")
              + f", {m.get('platform', '?')}."]
    return "\n".join(lines) + "\n"


def _prompt_set_line(first: dict) -> str:
    """The table's header line: the prompt set, its prompts and those dropped (stated when over 5%)."""
    from ldlp.report.notes import dropped_note, skipped_note

    line = (f"Prompt set **{_set_label(first)}**, {first.get('n_prompts')} prompts{dropped_note(first)}"
            f"{skipped_note(first)}")
    return (line + f", {first['max_new_tokens']} new tokens at most, "
            + ("greedy decoding." if first.get("temperature") == 0 else f"temperature {first.get('temperature')}."))


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}–{values[-1]}"


def plot_figure(rows: list[dict]):
    """tokens/s against γ for static, adaptive policies as horizontal lines, oracle on top; a panel per model.

    Each row is drawn at its speedup times the model's median AR tokens/s: tokens/s with the drift of
    the machine between runs taken out by the AR baseline timed alongside each run."""
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(8.4 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model and r.get("speedup") is not None]
        ar = median([r.get("ar_tokens_per_s") for r in mine]) or 1.0
        value = lambda r: r["speedup"] * ar  # noqa: E731
        static = sorted((r for r in mine if r["policy"] == STATIC), key=lambda r: r["gamma"])
        gammas = [r["gamma"] for r in static] or [1, 8]
        if static:
            ax.plot(gammas, [value(r) for r in static], "o-", color="black", lw=2, label="static γ", zorder=3)
        others = [r for r in mine if r["policy"] != STATIC]
        cmap = plt.get_cmap("tab10")
        for i, r in enumerate(sorted(others, key=value)):
            is_oracle = r["policy"] == ORACLE
            ax.axhline(value(r), color="crimson" if is_oracle else cmap(i % 10), ls="--" if is_oracle else "-",
                       lw=2.5 if is_oracle else 1.4, label=_policy_label(r), zorder=4 if is_oracle else 2)
        ax.axhline(ar, color="gray", ls=":", lw=1.5, label="autoregressive")
        ax.set_xlabel("static draft length γ")
        ax.set_ylabel("tokens/s (speedup × median AR tokens/s)")
        ax.set_xticks(gammas)
        kind = MODEL_TITLES.get(mine[0].get("drafter_kind"), "") if mine else ""
        ax.set_title(f"{model} ({kind})" if kind else model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def plot(rows: list[dict], path: str | Path) -> Path:
    """:func:`plot_figure` saved as a PNG (matplotlib's Agg backend: no display needed)."""
    pyplot()
    return save_figure(plot_figure(rows), path, dpi=120)


def write_csv(rows: list[dict], path: Path) -> None:
    import pandas as pd

    cols = ["model", "drafter_kind", "dataset", "policy", "gamma", "settings", "tau", "tokens_per_s",
            "ar_tokens_per_s", "speedup", "wall_s", "draft_s", "target_s", "policy_s", "target_forwards",
            "drafted_tokens", "wasted_tokens", "new_tokens", "n_prompts", "n_dropped", "dropped_reason", "max_new_tokens",
            "temperature", "acceptance_rate", "mean_drafted_per_step", "lossless", "runs", "repeats", "engine", "ar_impl",
            "data_path", "data_sha256", "limit", "sample_seed", "turns"]
    df = pd.DataFrame([{c: (json.dumps(r.get(c)) if c == "settings" else r.get(c)) for c in cols} for r in rows])
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def summarize(paths, out_dir: str | Path, title: str = "Static vs adaptive draft length",
              head_to_head: dict | None = None) -> dict:
    """Read every results.json under ``paths``; write results.md, results.csv, tokens_per_s.png,
    summary.json into ``out_dir``; return the rows, the headline numbers and the Markdown.
    ``head_to_head`` (from :func:`ldlp.bench.comparisons.headtohead.head_to_head`) adds its section to the Markdown."""
    rows = aggregate(find_results(paths))
    heads = headline(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = sweep_markdown(rows, heads, title)
    if head_to_head is not None:
        from ldlp.report.headtohead import head_to_head_markdown
        md += "\n" + head_to_head_markdown(head_to_head)
        heads.setdefault(head_to_head.get("model"), {})["head_to_head"] = head_to_head
    atomic_write_text(out / "results.md", md)
    write_csv(rows, out / "results.csv")
    png = plot(rows, out / "tokens_per_s.png")
    atomic_write_text(out / "summary.json", json.dumps({"headline": heads, "rows": rows}, indent=2, default=str) + "\n")
    return {"rows": rows, "headline": heads, "markdown": md, "md": out / "results.md", "csv": out / "results.csv",
            "png": png}


