"""Tune vLLM's Dynamic SD schedule for the pair, a prompt set and this machine (issue 36; docs/vllm_schedule.md).

    python scripts/tune_vllm_schedule.py out_dir=results/embedded/vllm_schedule
    python scripts/tune_vllm_schedule.py ks=[1,2,3] 'concurrency=[1,4,16,32]' margin=0
    python scripts/tune_vllm_schedule.py render_only=true out_dir=DIR heldout=DIR/heldout   (the page again)
    python scripts/tune_vllm_schedule.py refit=true out_dir=DIR margin=0.03   (the choice again from DIR's trace)
"""

import json
import logging
import time
from pathlib import Path

import hydra
from _setup import one_line_errors, start  # scripts/_setup.py: threads, quiet notices, clear model errors
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("tune_vllm_schedule")


def _ints(name, xs, low=1) -> list[int]:
    from eagle_backbone.errors import ConfigError

    xs = list(xs) if xs is not None else []
    if not xs or any(isinstance(x, bool) or not isinstance(x, int) or x < low for x in xs) or len(set(xs)) != len(xs):
        raise ConfigError(f"{name} must be distinct integers >= {low}, got {xs}")
    return sorted(xs)


def _heldout(cfg: DictConfig) -> list[dict]:
    """The held-out comparison of each load sweep folder in ``heldout`` (one folder or a list)."""
    from ldlp.bench.peers.vllm_tune import heldout_comparison

    folders = cfg.heldout if not isinstance(cfg.heldout, str) else [cfg.heldout]
    out = [heldout_comparison(f) for f in (folders or [])]
    for h in out:  # a sweep made before bench_batch recorded its prompt set: heldout_data names it
        h["meta"].setdefault("data", cfg.get("heldout_data"))
        h["meta"]["data"] = h["meta"]["data"] or cfg.get("heldout_data")
    return out


def _learned(cfg: DictConfig) -> dict:
    """The goodput learners' schedules of a serving run (``learned``: its folder), for the page."""
    from ldlp.bench.peers.vllm_schedule import learned_schedules

    return learned_schedules(cfg.learned) if cfg.get("learned") else {}


def _stop_ids(target: Path) -> set[int]:
    """The target's stop tokens as TargetModel reads them: generation_config.json's eos_token_id, else
    config.json's."""
    for name in ("generation_config.json", "config.json"):
        f = target / name
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        if eos is not None:
            return set(eos if isinstance(eos, list) else [eos])
    return set()


def _check(cfg: DictConfig) -> dict:
    """The settings as given, checked before anything loads or starts."""
    from eagle_backbone.errors import ConfigError
    from ldlp.bench.peers.vllm_schedule import MAX_K

    ks = _ints("ks", cfg.ks)
    if ks[-1] > MAX_K or ks[-1] >= int(cfg.generation.max_new_tokens):
        raise ConfigError(f"ks: K={ks[-1]} is above the maximum {min(MAX_K, int(cfg.generation.max_new_tokens) - 1)}")
    Cs = _ints("concurrency", cfg.concurrency)
    max_batch = Cs[-1] if cfg.max_batch is None else int(cfg.max_batch)
    if max_batch < Cs[-1]:
        raise ConfigError(f"max_batch={max_batch} is below the largest C measured ({Cs[-1]})")
    if int(cfg.rounds) < 1 or int(cfg.prompts_per_cell) < 1:
        raise ConfigError("rounds and prompts_per_cell must be >= 1")
    if not 0 <= float(cfg.margin) < 1:
        raise ConfigError(f"margin must be in [0, 1), got {cfg.margin}")
    if cfg.step_time not in ("cpu", "wall"):
        raise ConfigError(f"step_time must be cpu or wall, got {cfg.step_time!r}")
    if float(cfg.generation.get("temperature", 0.0) or 0.0) != 0.0:
        raise ConfigError("the tuner decodes greedily (acceptance under greedy verification); drop generation.temperature")
    return {"ks": ks, "concurrency": Cs, "max_batch": max_batch}


def _refit(cfg: DictConfig, out: Path) -> None:
    """The choice again from out_dir's tuning.json and trace.json.gz with this run's margin, step_time, max_batch
    and anchor_grid (after a change to the model or the choice; nothing is measured again)."""
    import datetime
    import gzip

    from eagle_backbone.errors import ConfigError
    from ldlp.bench.peers.vllm_schedule import snippet
    from ldlp.bench.peers.vllm_tune import analyse, write_schedule
    from ldlp.report.vllm_schedule import write

    if not (out / "tuning.json").is_file() or not (out / "trace.json.gz").is_file():
        raise ConfigError(f"refit=true: {out} needs tuning.json and trace.json.gz (run the tuner first)")
    rec = json.loads((out / "tuning.json").read_text())
    with gzip.open(out / "trace.json.gz", "rt") as f:
        trace = json.load(f)
    grid = _check(OmegaConf.merge(cfg, {"ks": rec["ks"], "concurrency": rec["concurrency"]}))
    rec.update(analyse(rec["calls"], trace, rec["ks"], rec["concurrency"], grid["max_batch"], float(cfg.margin),
                       str(cfg.step_time), rec["output_lengths"], bool(cfg.anchor_grid), bool(cfg.calibrate)))
    rec["refit"] = (f"{datetime.date.today().isoformat()}, margin {float(cfg.margin):g}, step_time {cfg.step_time}, "
                    f"calibrate {bool(cfg.calibrate)}")
    rec["snippet"] = snippet(rec["schedule"], rec["k_max"], rec["meta"].get("drafter", "eagle"))
    files = write_schedule(rec, out, rec["meta"].get("drafter", "eagle"))
    (out / "tuning.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    page = write(rec, out, _heldout(cfg), _learned(cfg))
    print(f"schedule: {rec['schedule']} (num_speculative_tokens {rec['k_max']}), chosen again from {out}")
    print("wrote " + ", ".join(str(p) for p in [*files, out / "tuning.json", page]))


@hydra.main(config_path="../conf", config_name="tune_vllm_schedule", version_base="1.3")
@one_line_errors
def main(cfg: DictConfig) -> None:
    t_start = time.perf_counter()
    from eagle_backbone.errors import ConfigError
    from ldlp.report.vllm_schedule import write

    out = Path(cfg.out_dir)
    if cfg.render_only:  # the page again from the folder's tuning.json: nothing loads, nothing runs
        if not (out / "tuning.json").is_file():
            raise ConfigError(f"render_only=true: {out / 'tuning.json'} does not exist (run the tuner first)")
        rec = json.loads((out / "tuning.json").read_text())
        page = write(rec, out, _heldout(cfg), _learned(cfg))
        print(f"wrote {page}")
        return
    if cfg.refit:  # the schedule again from the folder's traced steps and counters: nothing runs
        _refit(cfg, out)
        return
    threads = start(cfg)
    grid = _check(cfg)
    from eagle_backbone.drafter_kinds import get_kind
    from eagle_backbone.loading import load_pair
    from ldlp.bench.harness.identity import GreedyReference
    from ldlp.bench.harness.loaders import load_prompts, load_tokenizer_cached, machine_info
    from ldlp.bench.peers.vllm_peer import (
        METHODS,
        VllmRunner,
        check_dynamic_sd,
        check_eagle3_head,
        convert_drafter,
        vllm_available,
        vllm_build,
    )
    from eagle_backbone.made_for import run_made_for
    from ldlp.bench.peers.vllm_schedule import snippet
    from ldlp.bench.peers.vllm_tune import tune, write_schedule

    python = cfg.vllm.python or __import__("sys").executable
    if not vllm_available(python):
        raise ConfigError(f"{python} cannot import vllm; point vllm.python (or ADAEAGLE_VLLM_PYTHON) at a Python that "
                          "has it (scripts/install_vllm.sh, docs/batched.md)")
    build = vllm_build(python)
    check_dynamic_sd(build, python)  # a vLLM without Dynamic SD: one line, before any vLLM starts
    kind = str(cfg.model.get("drafter_kind", "eagle"))
    method = get_kind(kind).vllm_method  # the vLLM method that serves the pair's drafter kind
    if method not in METHODS:
        raise ConfigError(f"model.drafter_kind={kind}: vLLM's Dynamic SD here runs the pair's EAGLE or EAGLE-3 drafter")
    prompt_set = load_prompts(cfg.data, load_tokenizer_cached(cfg.model))
    prompts = [ids for _, ids in prompt_set]
    if len(prompts) < grid["concurrency"][-1]:
        raise ConfigError(f"{len(prompts)} prompts cannot fill C={grid['concurrency'][-1]}; raise data.limit")
    used = prompts[:max(grid["concurrency"][-1], int(cfg.prompts_per_cell))]
    max_new = int(cfg.generation.max_new_tokens)
    reference = None
    stops = _stop_ids(Path(cfg.model.target))  # as the target's generation config gives them (no weights load)
    if cfg.check_greedy:  # the target itself, for its greedy decoding (on a GPU it shares the device with vLLM)
        pair = load_pair(cfg.model)
        stops = pair.target.eos_token_ids
        t0 = time.perf_counter()
        reference = GreedyReference.of_target(pair.target, used, max_new).tokens
        log.info("the target's greedy decoding of %d prompts: %.0f s", len(used), time.perf_counter() - t0)
    root = Path(cfg.paths.outputs) / "vllm_peer"
    if method == "eagle3":  # vLLM reads the head as it is; an EAGLE-1 drafter is converted to its layout
        check_eagle3_head(cfg.model.drafter, cfg.model.target)
        drafter = Path(cfg.model.drafter)
    else:
        drafter = convert_drafter(cfg.model.drafter, cfg.model.target, root / "drafters")
    target_max = json.loads((Path(cfg.model.target) / "config.json").read_text()).get("max_position_embeddings", 2048)
    max_len = min(int(target_max), max(len(p) for p in used) + max_new + grid["ks"][-1] + 8)
    C_max = grid["concurrency"][-1]

    def make_runner(K):
        # the converted drafter is passed as it is: VllmRunner converts EAGLE-1 again only when it must (cached)
        return VllmRunner(K, cfg.model.target, cfg.model.drafter, root / "drafters", python=python, threads=threads,
                          dtype=str(cfg.vllm.dtype), seed=int(cfg.seed), max_model_len=max_len,
                          log_dir=root / "logs" / "tune", log=log.info, method=method,
                          schedule=[[1, C_max, K]], trace_steps=True,
                          enforce_eager=bool(cfg.vllm.get("enforce_eager", True)),
                          gpu_memory_utilization=cfg.vllm.get("gpu_memory_utilization"))

    rec = tune(make_runner, used, grid["ks"], grid["concurrency"], int(cfg.rounds), max_new, stops,
               int(cfg.prompts_per_cell), grid["max_batch"], float(cfg.margin), str(cfg.step_time), reference,
               log=log.info, anchor=bool(cfg.anchor_grid), calibrate=bool(cfg.calibrate))
    rec["tuning_s"] = time.perf_counter() - t_start
    rec["meta"] = {"model": cfg.model.name, "drafter": kind, "vllm": build.get("version"), "dtype": str(cfg.vllm.dtype),
                   "threads": threads, "cpu": machine_info().get("cpu"),
                   "data": f"{cfg.data.name} (split {cfg.data.get('split', '?')}, {len(used)} prompts)",
                   "max_new_tokens": max_new}
    rec["made_for"] = {**run_made_for(cfg.model, costs=True), "dtype": str(cfg.vllm.dtype)}  # vLLM's dtype
    rec["drafter_folder"] = str(drafter)
    rec["snippet"] = snippet(rec["schedule"], rec["k_max"], method)
    rec["settings"] = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    files = write_schedule(rec, out, method)
    import gzip

    with gzip.open(out / "trace.json.gz", "wt") as f:  # vLLM's traced steps (STEP_FIELDS), per grid call
        json.dump(rec.pop("trace"), f)
    (out / "tuning.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")
    page = write(rec, out, _heldout(cfg), _learned(cfg))
    print(f"schedule: {rec['schedule']} (num_speculative_tokens {rec['k_max']}); tuning took {rec['tuning_s']:.0f} s")
    print("wrote " + ", ".join(str(p) for p in [*files, out / "tuning.json", out / "trace.json.gz", page]))


if __name__ == "__main__":
    main()
