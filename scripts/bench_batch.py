"""Batched speculative decoding against concurrency: batched AR, static γ and adaptive policies.

    python scripts/bench_batch.py
    python scripts/bench_batch.py concurrency=[1,4,16] 'contenders=["policy=static policy.gamma=3"]' rounds=1
    python scripts/bench_batch.py 'temperatures=[0.0,0.7,1.0]' blocks=4 data.limit=128   (the load sweep, docs/batched.md)
    python scripts/bench_batch.py render_only=true out_dir=results/embedded/load_sweep   (its page again, from the JSON)
"""

import logging
import os
from pathlib import Path

import hydra
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("bench_batch")


@hydra.main(config_path="../conf", config_name="bench_batch", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    from eagle_backbone.drafter_kinds import make_candidates
    from eagle_backbone.errors import ConfigError, MissingCheckpoint, accepted_mismatches
    from ldlp.bench.harness.contender import (engine_defaults, engine_label, engine_settings, parse_contender,
                                              policy_label)
    from ldlp.bench.comparisons.conversation import prompt_categories
    from ldlp.bench.comparisons.load_sweep import (
        Contender,
        check_contenders,
        check_sweep_args,
        check_token_budgets,
        prompts_meta,
        skipped_records,
        sweep,
    )
    from ldlp.bench.harness.memory import RssSampler
    from ldlp.bench.harness.loaders import (
        build_policy,
        check_turns_kept,
        load_pair_cached,
        load_prompts,
        load_tokenizer_cached,
        machine_info,
        missing_checkpoint,
        policy_config,
        engine_cost_key,
        prepare_cost_tables,
        sampling_config,
    )
    from ldlp.bench.harness.peer import is_peer
    from ldlp.bench.peers.vllm_peer import make_contender
    from ldlp.pipeline.processes import out_dir_lock
    from ldlp.report.load_sweep import render, write, written

    if cfg.render_only:  # the page and plots again from out_dir's JSON: nothing loads, nothing runs
        if not cfg.out_dir:
            raise ConfigError("render_only=true needs out_dir=DIR (a load sweep's results folder)")
        with out_dir_lock(cfg.out_dir):  # no run is writing the folder meanwhile
            if cfg.get("serving"):
                from ldlp.report.serving import OUTPUT_FILES
                from ldlp.report.serving import render as render_serving

                out = render_serving(cfg.out_dir)
                print(f"wrote {out}/" + ", ".join(f for f in OUTPUT_FILES if Path(out, f).exists()))
                return
            out = render(cfg.out_dir)
        print(f"wrote {out}/" + ", ".join(written(out)))
        return
    threads = start(cfg)
    serving = cfg.get("serving")
    if serving:  # open loop: the traces checked now, before anything loads
        from ldlp.bench.comparisons.serving import check_trace

        traces = {name: check_trace(name, spec) for name, spec in serving.traces.items()}
    # the raw values, checked before anything loads (a 1.5 is refused, not truncated); None: the generation's T
    temperatures = check_sweep_args(list(cfg.concurrency), cfg.get("temperatures"), cfg.blocks, cfg.rounds,
                                    cfg.generation.max_new_tokens, cfg.bootstrap)
    if isinstance(cfg.rss_every_s, bool) or not isinstance(cfg.rss_every_s, (int, float)) or not cfg.rss_every_s > 0:
        raise ConfigError(f"rss_every_s must be a number of seconds > 0, got {cfg.rss_every_s!r} (conf/bench_batch.yaml)")
    # the prompts (tokenizer only) and the contenders before any weights load
    prompt_set = load_prompts(cfg.data, load_tokenizer_cached(cfg.model))
    check_turns_kept(cfg.data, prompt_set, "bench_batch")
    prompts = [ids for _, ids in prompt_set]
    categories = prompt_categories(cfg.data, [pid for pid, _ in prompt_set])  # None where the file has none
    # this engine's settings for every contender: the engine's own defaults under conf/bench_batch.yaml's engine;
    # a contender may give its own
    engine = engine_defaults(OmegaConf.to_container(cfg.engine, resolve=True) if cfg.get("engine") else {})
    # every contender read and checked before any policy is built (one line naming the contender and the key)
    specs = [parse_contender(node) for node in cfg.contenders]
    contenders = [Contender("ar", "ar", 0, None, engine=engine)]
    skipped = []  # contenders whose checkpoint this clone has not trained: in the JSON and on the page
    probes = {}
    for spec in specs:
        if spec.peer is not None:  # vLLM as a peer (ldlp/bench/peers/vllm_peer.py)
            contenders.append(make_contender(spec.peer, cfg.model, prompts, int(cfg.generation.max_new_tokens),
                                             cfg.get("vllm"), cfg.paths.outputs, threads=threads, seed=int(cfg.seed),
                                             log=log.info))
            continue
        settings = engine_settings(spec, engine)
        if spec.policy is None:  # engine settings alone: batched AR with them, paired with the default's
            contenders.append(Contender(engine_label("ar", spec.engine), "ar_engine", 0, None, engine=settings))
            continue
        name, pcfg = policy_config(cfg, spec)
        try:
            missing_checkpoint(name, pcfg)
        except MissingCheckpoint as e:  # only a missing checkpoint skips; any other error stops the run
            log.warning("skipping %s: %s", spec, e)
            skipped.append({"contender": str(spec), "temperature": None, "why": str(e)})
            continue
        probe = build_policy(pcfg, cfg.model)
        gamma = None if is_peer(probe) else probe.fixed_gamma
        label = policy_label(name, pcfg, gamma)  # the page's label: "static γ=3", "load_aware_step (no feedback)"...
        contenders.append(Contender(engine_label(label, spec.engine), name, gamma, lambda pcfg=pcfg: build_policy(pcfg),
                                    engine=settings))
        probes[label] = probe
    check_contenders(contenders, int(cfg.generation.max_new_tokens))
    check_token_budgets(contenders, [int(sv.slots)] if (sv := cfg.get("serving")) else list(cfg.concurrency),
                        int(cfg.generation.max_new_tokens))
    out = cfg.out_dir or HydraConfig.get().runtime.output_dir
    if serving:
        return serve_traces(cfg, contenders, skipped, probes, prompts, traces, out, threads, skipped_records(prompt_set))
    # one run at a time writes the folder (the page it prints is its own): taken once the settings and the
    # prompts are checked, before anything loads
    with out_dir_lock(out):
        pair = load_pair_cached(cfg.model)
        meta = {"model": cfg.model.name, "data": cfg.data.get("name"), "dtype": cfg.model.dtype, "attn": cfg.attn, "drafter": cfg.model.drafter_kind,
                "prompts": len(prompts), "max_new_tokens": int(cfg.generation.max_new_tokens), "rounds": int(cfg.rounds),
                **prompts_meta(prompt_set, cfg.concurrency, int(cfg.blocks)), "temperatures": temperatures or [float(cfg.generation.get("temperature", 0.0))],
                "threads": threads, "cpu": machine_info().get("cpu"), "profile_steps": bool(cfg.profile_steps),
                "engine": engine}
        # the pair's candidate generator, its drafter on the benchmark's attention math (as the target's in the engine)
        candidates = pair.candidates
        if getattr(candidates, "attn", str(cfg.attn)) != str(cfg.attn):
            candidates = make_candidates(candidates.kind, pair.drafter, pair.target, str(cfg.attn))
        prepare_cost_tables(probes.values(), pair.target, candidates, str(cfg.attn), max(cfg.concurrency))
        meta["load_average"] = round(os.getloadavg()[0], 2)  # the machine's state: one minute's load at the start
        # the resident memory over the run, sampled beside it: the page states its peak and growth (a long sweep
        # must stay flat)
        with RssSampler(every_s=float(cfg.rss_every_s)) as rss:
            def save(r: dict) -> None:  # after every (T, C): the rows so far; the memory by round
                at = int(r["rounds_done"]) + 1  # the round the next cell belongs to (rounds + 1: they are done)
                if len(rss.marks) < at:
                    rss.mark(f"round {at}" if at <= r["rounds"] else "after the rounds")
                write({**r, "skipped": skipped + r["skipped"], "memory": rss.summary()}, out, meta, with_plot=False)

            result = sweep(pair.target, candidates, prompts, contenders,
                           [int(c) for c in cfg.concurrency], int(cfg.generation.max_new_tokens),
                           sampling_config(cfg.generation), rounds=int(cfg.rounds), seed=int(cfg.seed),
                           attn=str(cfg.attn), checkpoint=save, log=log.info,
                           categories=categories, temperatures=temperatures, blocks=int(cfg.blocks),
                           bootstrap=int(cfg.bootstrap), profile_steps=bool(cfg.profile_steps),
                           cost_key=engine_cost_key(cfg.model.name, pair.target, candidates, str(cfg.attn)))
        result["skipped"] = skipped + result["skipped"]
        result["memory"] = rss.summary()
        meta["load_average"] = [meta["load_average"], round(os.getloadavg()[0], 2)]  # at the start and the end
        if accepted_mismatches():  # files made for another setup that accept_mismatch=true let drive it: on the page
            meta["accepted_mismatches"] = accepted_mismatches()
        write(result, out, meta)
        print(Path(out, "batch_bench.md").read_text())
        print(f"wrote {out}/" + ", ".join(written(out)))


def serve_traces(cfg, contenders, skipped, probes, prompts, traces, out, threads, records=None) -> None:
    """``serving=...``: every contender of this engine on the arrival traces (ldlp/bench/comparisons/serving.py);
    ``records``: the malformed records of the prompt file skipped
    (``ldlp.bench.comparisons.load_sweep.skipped_records``), on the page."""
    import sys

    from eagle_backbone.drafter_kinds import make_candidates
    from eagle_backbone.made_for import run_made_for
    from ldlp.bench.harness.loaders import load_pair_cached, machine_info, prepare_cost_tables, sampling_config
    from ldlp.bench.harness.memory import RssSampler
    from ldlp.bench.comparisons.serving import serve
    from ldlp.pipeline.processes import out_dir_lock
    from ldlp.report.serving import OUTPUT_FILES, write

    sv = cfg.serving
    with out_dir_lock(out):
        pair = load_pair_cached(cfg.model)
        candidates = pair.candidates
        if getattr(candidates, "attn", str(cfg.attn)) != str(cfg.attn):
            candidates = make_candidates(candidates.kind, pair.drafter, pair.target, str(cfg.attn))
        prepare_cost_tables(probes.values(), pair.target, candidates, str(cfg.attn), int(sv.slots))
        meta = {"model": cfg.model.name, "data": cfg.data.get("name"), "dtype": str(pair.target.dtype).split(".")[-1],
                "prompts": len(prompts), **(records or {}), "max_new_tokens": int(cfg.generation.max_new_tokens),
                "temperature": float(cfg.generation.get("temperature", 0.0)), "slots": int(sv.slots),
                "rounds": int(sv.rounds), "warmup_rounds": int(sv.warmup_rounds), "threads": threads,
                "cpu": machine_info().get("cpu"), "load_average": round(os.getloadavg()[0], 2),
                "command": "python scripts/bench_batch.py " + " ".join(sys.argv[1:]),
                # what the learners' schedules were measured on (their files carry it: eagle_backbone/made_for.py)
                "made_for": run_made_for(cfg.model, costs=True)}
        if any(c.runner is not None for c in contenders):  # vLLM serves the same traces in its own dtype
            meta["peer_dtype"] = str((cfg.get("vllm") or {}).get("dtype") or "float32")

        def save(result, with_plot=False):
            write({**result, "skipped": skipped + result.get("skipped", [])}, out, meta, with_plot)

        with RssSampler(every_s=float(cfg.rss_every_s)) as rss:
            result = serve(pair.target, candidates, prompts, contenders, traces, int(cfg.generation.max_new_tokens),
                           sampling_config(cfg.generation), rounds=int(sv.rounds), warmup_rounds=int(sv.warmup_rounds),
                           slots=int(sv.slots), seed=int(cfg.seed), attn=str(cfg.attn), log=log.info,
                           checkpoint=lambda r, with_plot=False: save({**r, "memory": rss.summary()}, with_plot),
                           bootstrap=int(cfg.bootstrap))
        result["memory"] = rss.summary()
        meta["load_average"] = [meta["load_average"], round(os.getloadavg()[0], 2)]
        save(result, with_plot=True)
    print(Path(out, "serving.md").read_text())
    print(f"wrote {out}/" + ", ".join(f for f in OUTPUT_FILES if Path(out, f).exists()))


if __name__ == "__main__":
    main()
