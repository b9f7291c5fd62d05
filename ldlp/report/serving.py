"""The serving benchmark's folder (``scripts/bench_batch.py serving=ramp``): ``serving.json`` (rows, runs, the
learners), ``serving.md`` and ``serving_learner.png`` (each goodput learner's choices over its last runs, with the
load it saw), written from :func:`ldlp.bench.comparisons.serving.serve`'s result. Nothing here measures."""

from __future__ import annotations

from pathlib import Path

from eagle_backbone.io import atomic_write_json, atomic_write_text
from ldlp.report.figures import pyplot, save_figure
from ldlp.report.memory import memory_line
from ldlp.policies.goodput import PLAN, load_bucket
from ldlp.report.vllm_schedule import ratio_text

OUTPUT_FILES = ("serving.json", "serving.md", "serving_learner.png")


def learner_table(learners: dict, schedule: bool) -> list[str]:
    """The goodput learners' table (``GoodputFeedback.summary`` per contender): the best arm per load bucket, with
    ``schedule`` its batch-size table, and the exploration's steps and cost."""
    lines = ["| contender | best arm per bucket | " + ("schedule | " if schedule else "")
             + "exploration steps | exploration cost |", "|---|---|" + ("---|" if schedule else "") + "---:|---:|"]
    for label, ln in learners.items():
        if ln is None:
            continue
        best = ", ".join(f"{b}: {v['best']}" for b, v in ln["buckets"].items())
        sched = ", ".join(f"≤{k}: {v}" for k, v in ln["schedule"].items()) + " | " if schedule else ""
        ex = ln["exploration"]
        lines.append(f"| {label} | {best} | {sched}{ex['explore_steps']}/{ex['steps']} | {100 * ex['cost']:.2f}% |")
    return lines


def markdown(result: dict, meta: dict) -> str:
    status = "complete" if result.get("complete") else "incomplete (a stopped run: the rows so far)"
    lines = ["# Serving: requests on arrival traces", "", f"Status: {status}.", "",
             ", ".join(f"{k}: {v}" for k, v in meta.items() if k not in ("command",)), "",
             f"Command: `{meta.get('command', '?')}`", "",
             "Each trace's requests arrive open-loop (ldlp/bench/comparisons/serving.py): gaps from a gamma distribution "
             "of mean 1/rate and shape `burstiness` (1: Poisson), the rate constant or ramping from low to peak and back. "
             "Every contender serves the same trace in turns (the order rotating); a contender's policy lives across "
             "its runs as a server keeps running, so the first rounds warm it and are left out of the rows. Throughput: "
             "output tokens over first arrival to last token; busy: over the seconds with a request in flight (open "
             "loop, a contender that keeps up serves what arrives, so its throughput is the trace's; the busy "
             "seconds are where it differs). TTFT: arrival to first token (queueing included); "
             "TPOT: (last − first token) / (tokens − 1); E2E: arrival to last token. Ratios: paired over rounds, "
             "95% bootstrap intervals. Drafts and tokens a row-step: over every running row of every step; vs "
             "chains: a policy's tokens a row-step over the line between the two static chains whose drafts a "
             "row-step bracket its own (what drafting either at random gives: below 1, its γ wanders between "
             "steps without information; above 1, its choices know something)."
             + (f" `vllm` rows: vLLM serves the same trace on its own scheduler, in {meta['peer_dtype']}, at most "
                "`slots` requests in flight, timed inside its worker process, in the same turns."
                if meta.get("peer_dtype") else ""), ""]
    lines += [m, ""] if (m := memory_line(result.get("memory"))) else []
    for name, spec in result.get("traces", {}).items():
        rate = "–".join(f"{r:g}" for r in spec["rate"])
        lines += [f"## Trace `{name}`: {spec['requests']} requests, {spec['shape']} rate {rate}/s, burstiness "
                  f"{spec['burstiness']:g}", ""]
        rows = [r for r in result["rows"] if r["trace"] == name]
        if not rows:
            lines += ["No measured round yet.", ""]
            continue
        best, best_busy = rows[0]["best_static"], rows[0].get("best_static_busy")
        lines += [f"Best static γ on this trace: {best or '–'} by tokens/s, {best_busy or '–'} by tokens per busy "
                  "second (each ratio column against the best by its own measure).", "",
                  "| contender | tokens/s | vs best static | tokens/busy s | vs best static, busy | vs AR, busy | "
                  "TTFT p50 / p99 ms | TPOT p50 / p99 ms | E2E p50 / p99 ms | τ | rows mean | drafts, tokens a row-step "
                  "| vs chains | policy time | greedy identical |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            ident = "–" if r["identical"] is None else f"{r['identical']}/{r['n_requests']}"
            own = "–" if r["policy"] == "vllm" else f"{100 * r['policy_share']:.1f}%"  # a peer's policy is its own
            lines.append(f"| {r['contender']} | {r['tokens_per_s']:.1f} | {ratio_text(r.get('vs_best_static'))} | "
                         f"{r['tokens_per_busy_s']:.1f} | {ratio_text(r.get('vs_best_static_busy'))} | "
                         f"{ratio_text(r.get('vs_ar_busy'))} | {r['ttft_ms_median']:.0f} / {r['ttft_ms_p99']:.0f} | "
                         f"{r['tpot_ms_median']:.1f} / {r['tpot_ms_p99']:.1f} | {r['e2e_ms_median']:.0f} / "
                         f"{r['e2e_ms_p99']:.0f} | {r['tau']:.2f} | {r['rows_mean']:.1f} | {_per_row(r)} | "
                         f"{_vs_chains(r)} | {own} | {ident} |")
        lines.append("")
    learners = result.get("learners") or {}
    if learners:
        lines += ["## What the goodput learners learned", "",
                  "Per load bucket (running rows), the arm of the best measured rate at the end of the run and the "
                  "share of measured time lost to steps off it (the exploration's price; "
                  "ldlp/policies/goodput.py). `plan`: the policy's own choice. As a vLLM Dynamic-SD style table "
                  "(batch size up to → γ): the schedule column.", ""]
        lines += learner_table(learners, schedule=True)
        lines += ["", "![the learners' choices over time](serving_learner.png)", ""]
    if result.get("skipped"):
        lines += ["Skipped: " + "; ".join(f"{s['contender']} ({s['why']})" for s in result["skipped"]), ""]
    return "\n".join(lines)


def _per_row(r: dict) -> str:
    return "–" if r.get("tokens_per_row_step") is None else \
        f"{r['drafts_per_row_step']:.2f}, {r['tokens_per_row_step']:.2f}"


def _vs_chains(r: dict) -> str:
    return "–" if r.get("vs_chains") is None else f"{r['vs_chains']:.3f}"


def plot_learners(result: dict, path: str | Path) -> Path | None:
    """Per goodput contender and trace (its last run): the arm chosen at each step (chains by γ, ``plan`` above
    them) over the step index, coloured by the load bucket, with the running rows on a second axis."""
    runs = {}
    for r in result["runs"]:
        if r.get("learner_span"):
            runs[(r["contender"], r["trace"])] = r  # the last run of each
    learners = result.get("learners") or {}
    if not runs or not learners:
        return None
    _, plt = pyplot()
    keys = sorted(runs)
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 2.6 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        run = runs[key]
        a, b = run["learner_span"]
        hist = learners[key[0]]["history"][a:b]
        if not hist:
            continue
        top = max((x for _, _, x in hist if x != PLAN), default=0) + 1
        steps = list(range(len(hist)))
        arms = [top if x == PLAN else x for _, _, x in hist]
        buckets = [load_bucket(rows) for _, rows, _ in hist]
        sc = ax.scatter(steps, arms, c=buckets, s=4, cmap="viridis")
        ax.set_yticks(list(range(top + 1)), [str(g) for g in range(top)] + ["plan"])
        ax.set_ylabel("arm (γ)")
        ax.set_title(f"{key[0]} on {key[1]} (last run)")
        ax2 = ax.twinx()
        ax2.plot(steps, [rows for _, rows, _ in hist], color="grey", alpha=0.5, lw=0.8)
        ax2.set_ylabel("running rows")
        fig.colorbar(sc, ax=ax, label="load bucket", pad=0.08)
    axes[-1, 0].set_xlabel("step of the run")
    return save_figure(fig, path, dpi=110)


def render(folder: str | Path) -> Path:
    """The page, plot and schedules again from ``folder/serving.json`` (its rows recomputed from its runs)."""
    import json

    from ldlp.bench.comparisons.serving import serving_rows

    path = Path(folder) / "serving.json"
    if not path.is_file():
        raise ValueError(f"render_only=true: {path} does not exist (a serving run's folder)")
    rec = json.loads(path.read_text())
    meta = rec.pop("meta", {})
    rec["rows"] = serving_rows(rec["runs"])
    return write(rec, folder, meta)


def write_learned_schedules(out: Path, made_for: dict | None) -> list[Path]:
    """Each goodput learner's schedule in ``out``'s serving.json as a vLLM ``speculative_config``
    (``learned_schedule_<contender>.json``), with the setup it was measured on (``made_for``, checked where
    ``engine=vllm spec.schedule=FILE`` runs it)."""
    from ldlp.bench.peers.vllm_schedule import learned_schedules

    files = []
    for label, sched in learned_schedules(out).items():
        slug = "".join(ch if ch.isalnum() else "_" for ch in label).strip("_")
        files.append(out / f"learned_schedule_{slug}.json")
        atomic_write_json(files[-1], {**sched["snippet"], **({"made_for": made_for} if made_for else {})})
    return files


def write(result: dict, out_dir: str | Path, meta: dict, with_plot: bool = True) -> Path:
    """serving.json, serving.md, the learners' plot and each learner's schedule as a vLLM ``speculative_config``
    (``learned_schedule_<contender>.json``: ``engine=vllm spec.schedule=FILE`` runs it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "serving.json", {"meta": meta, **result})
    atomic_write_text(out / "serving.md", markdown(result, meta))
    write_learned_schedules(out, meta.get("made_for"))
    if with_plot:
        plot_learners(result, out / "serving_learner.png")
    return out
