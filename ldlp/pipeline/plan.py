"""The main command's plan: its stages in order, each a :class:`~ldlp.pipeline.stage.Stage` record (script,
overrides, output folder, upstream stages, model folders and YAML files it reads), a DAG through ``after``.

    corpus        build_corpus.py        -> paths.embedded/corpus (gitignored)
    oracle        collect_oracle.py      -> paths.oracle          (data/oracle/<model>)
    ldlp          train_ldlp.py          -> paths.ldlp            (ldlp_survival: paths.ldlp_survival, if enabled)
    acceptance    train_acceptance.py    -> paths.acceptance      (data/acceptance/<model>)
    cost          profile_cost.py        -> paths.cost            (the step cost table, where a stage prices by it)
    tune          tune_policies.py       -> paths.results/tuning  (outputs/results/<model>/tuning)
    sweeps        evaluate.py -m ...     -> paths.runs/round-R/<sweep>
    bench_batch   bench_batch.py         -> paths.results/load_sweep (the load sweep's short version)
    contenders    choose_contenders.py   -> paths.runs/contenders (contenders.json: the head to head's choice)
    head_to_head  compare.py             -> paths.runs/head_to_head

Sweeps are repeated ``sweep.rounds`` times, one after the other, so every policy is measured in every phase
of a noisy machine; the summary reports medians over rounds. :func:`validate` checks the main command's
settings before any stage is planned.
"""

from __future__ import annotations

from pathlib import Path

from eagle_backbone.errors import ConfigError
from eagle_backbone.paths import CONF_DIR
from ldlp.pipeline.compose import (apply_overrides, checkpoint_args, compose, compose_model, list_arg, model_folders,
                                   thread_args)
from ldlp.pipeline.contenders import CONTENDERS
from ldlp.pipeline.stage import Stage, override_key

EVAL_CONFIGS = ("evaluate.yaml", "data/*.yaml", "generation/*.yaml", "policy/*.yaml", "peer/*.yaml")

def _setting(cfg, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None)


def _int_setting(cfg, key: str, low: int, default=None) -> int:
    """``key`` of the main command's config as an integer >= ``low``, or one line naming the key and the value."""
    from eagle_backbone.runtime import int_setting

    value = _setting(cfg, key)
    if value is None and default is not None:
        return default
    try:
        return int_setting(f"pipeline: {key}", value, low, "conf/pipeline.yaml")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _list_setting(cfg, key: str, check, what: str, empty_ok: bool = False) -> list:
    values = _setting(cfg, key)
    values = [] if values is None else list(values)
    if not values and not empty_ok:
        raise ConfigError(f"pipeline: {key} is empty; give at least one {what} (conf/pipeline.yaml)")
    for v in values:
        if not check(v):
            raise ConfigError(f"pipeline: {key} holds {v!r}, not {what} (conf/pipeline.yaml)")
    return values


def _known_policy(name) -> bool:
    return isinstance(name, str) and (CONF_DIR / "policy" / f"{name}.yaml").is_file()


def validate(cfg) -> None:
    """Every setting of the main command that a stage would otherwise refuse (or coerce) minutes later, checked once,
    before any stage runs or model loads, and in the dry run's plan too: one ConfigError line naming the key."""
    _int_setting(cfg, "oracle.parallel", 1, default=1)
    if _setting(cfg, "threads") is not None:
        _int_setting(cfg, "threads", 1)
    _int_setting(cfg, "sweep.rounds", 1)
    gamma = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
    _list_setting(cfg, "sweep.static_gammas", gamma, "an integer γ >= 1", empty_ok=True)
    _list_setting(cfg, "sweep.adaptive", _known_policy, "a policy of conf/policy/", empty_ok=True)
    if _setting(cfg, "peer.enabled"):
        _int_setting(cfg, "peer.rounds", 1, default=1)
        _list_setting(cfg, "peer.static_gammas", gamma, "an integer γ >= 1", empty_ok=True)
        for v in _setting(cfg, "peer.policies") or []:
            if isinstance(v, str) and not _known_policy(v) and (CONF_DIR / "peer" / f"{v}.yaml").is_file():
                raise ConfigError(f"pipeline: peer.policies holds {v!r}: a peer (conf/peer/{v}.yaml), not a policy of "
                                  "this engine; list it in peer.peers (conf/pipeline.yaml)")
        _list_setting(cfg, "peer.policies", _known_policy, "a policy of conf/policy/", empty_ok=True)
        _list_setting(cfg, "peer.peers", lambda v: isinstance(v, str) and (CONF_DIR / "peer" / f"{v}.yaml").is_file(),
                      "a peer of conf/peer/", empty_ok=True)
    if _setting(cfg, "head_to_head.enabled"):
        _int_setting(cfg, "head_to_head.rounds", 1)
        _int_setting(cfg, "head_to_head.adaptive", 0)
        if _setting(cfg, "head_to_head.choose_by") not in ("tuning", "sweep", None):
            raise ConfigError(f"pipeline: head_to_head.choose_by must be tuning or sweep, got "
                              f"{_setting(cfg, 'head_to_head.choose_by')!r}")
    if _setting(cfg, "bench_batch.enabled"):
        _int_setting(cfg, "bench_batch.rounds", 1)
        _int_setting(cfg, "bench_batch.blocks", 1)
        _list_setting(cfg, "bench_batch.concurrency", gamma, "a concurrency (integer >= 1)")
        _list_setting(cfg, "bench_batch.temperatures",
                      lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                      "a temperature >= 0")
        for spec in _bench_contenders(cfg):
            _check_contender(cfg, spec)
    if not (_setting(cfg, "sweep.static_gammas") or _setting(cfg, "sweep.adaptive")):
        raise ConfigError("pipeline: sweep.static_gammas and sweep.adaptive are both empty: nothing to sweep")
    # a run that decodes nothing makes a page of NaN: refused here, for the main command and every stage's own value
    _int_setting(cfg, "generation.max_new_tokens", 1, default=1)
    for group in ("sweep", "head_to_head", "bench_batch", "peer"):
        for o in _setting(cfg, f"{group}.overrides") or []:
            key = override_key(str(o))
            if key == "policy" or key.startswith("policy."):  # it would replace the stage's own choice of policies:
                # `policy.gamma=3` made the static sweep one γ (Hydra keeps the last value), -1 failed minutes later
                raise ConfigError(f"pipeline: {group}.overrides holds {o!r}: the stages choose their policies "
                                  "(sweep.static_gammas, sweep.adaptive, peer.policies, bench_batch.contenders, the "
                                  "contenders stage); give a policy's keys in a bench_batch.contenders entry or its "
                                  "conf/policy/NAME.yaml (conf/pipeline.yaml)")
            if key == "generation.max_new_tokens":
                value = str(o).split("=", 1)[1]
                if not value.isdigit() or int(value) < 1:
                    raise ConfigError(f"pipeline: {group}.overrides holds {o!r}: generation.max_new_tokens must "
                                      "be an integer >= 1 (conf/pipeline.yaml)")


def _bench_contenders(cfg) -> list:
    """The load sweep's contenders (``bench_batch.contenders``: strings or nodes), each read by the one contender
    parser (ldlp/bench/harness/contender.py) and a policy of conf/policy/ (the main command runs no peer engine), or one
    ConfigError line naming the contender."""
    from ldlp.bench.harness.contender import parse_contender

    where = "pipeline: bench_batch.contenders holds"
    specs = [parse_contender(c, where) for c in _list_setting(cfg, "bench_batch.contenders", lambda v: True, "")]
    for spec in specs:
        if spec.policy is None:
            raise ConfigError(f"{where} {str(spec)!r}: a contender is one 'policy=NAME [policy.key=value ...]' of "
                              "conf/policy/NAME.yaml")
    return specs


def _check_contender(cfg, spec) -> None:
    """A load-sweep contender that sets policy keys, built as scripts/bench_batch.py builds it, so that the dry run
    refuses what the real run would (a policy whose checkpoint is not trained yet is left to the run)."""
    from hydra.errors import HydraException

    from eagle_backbone.errors import MissingCheckpoint
    from ldlp.bench.harness.contender import ENGINE_DEFAULTS, engine_settings
    from ldlp.bench.harness.loaders import build_policy, missing_checkpoint

    engine_settings(spec, ENGINE_DEFAULTS)
    if not spec.policy.settings:  # the policy's own file as it is
        return
    try:
        pcfg = compose("evaluate", spec.policy_overrides() + checkpoint_args(cfg)).policy
        missing_checkpoint(spec.policy.name, pcfg)
        build_policy(pcfg)
    except MissingCheckpoint:
        return
    except (HydraException, ValueError) as e:  # a bad override or the policy's own error, in one line
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"pipeline: bench_batch.contenders holds {str(spec)!r}: {why}") from None


def plan(cfg, model: str = "embedded", overrides=()) -> list[Stage]:
    """Every stage, in order; ``model`` is the conf/model option they run on and ``overrides`` the main
    command's (those a stage's config contains reach it: :func:`~ldlp.pipeline.compose.apply_overrides`)."""
    validate(cfg)
    p = cfg.paths
    threads = thread_args(cfg)
    pair = model_folders(cfg, model, overrides)
    attn = _target_attn(cfg, model, overrides)
    costs: dict[str, tuple[str, list[int]]] = {}  # stage -> (attention, slot counts) of the cost table it prices by
    oracle, ldlp, acceptance = Path(p.oracle), Path(p.ldlp), Path(p.acceptance)
    corpus = Path(p.embedded) / "corpus"
    shards = _int_setting(cfg, "oracle.parallel", 1, default=1)
    label_configs = ("collect_oracle.yaml", "data/*.yaml", "generation/*.yaml", "recipe/collect_oracle/*.yaml")
    ldlp_configs = ("train_ldlp.yaml", "ldlp/*.yaml", "trainer/*.yaml", "logger/*.yaml", "experiment/*.yaml",
                    "recipe/train_ldlp/*.yaml")
    stages = [
        Stage("corpus", "build the embedded conversation corpus", "build_corpus.py",
              [f"out_dir={corpus}"] + threads, corpus, configs=("build_corpus.yaml",), product="test.json"),
        Stage("oracle", "collect oracle draft-length labels (greedy)" + (f", {shards} collectors side by side"
                                                                         if shards > 1 else ""), "collect_oracle.py",
              [f"model={model}", f"out_dir={oracle}"] + threads + ([f"num_shards={shards}"] if shards > 1 else [])
              + list(cfg.oracle.overrides), oracle,
              after=("corpus",), reads=pair, configs=label_configs, product="report.md", resumes=True,
              parallel=shards),
        Stage("ldlp", "train the LDLP on the oracle labels", "train_ldlp.py",
              list(cfg.ldlp.overrides) + [f"model={model}", f"ldlp_training.oracle_dir={oracle}",
                                          f"ldlp_training.out_dir={ldlp}"] + threads,
              ldlp, after=("oracle",), reads=pair, configs=ldlp_configs, product="model.safetensors"),
        Stage("acceptance", "train the acceptance head on the drafter states of the oracle rows", "train_acceptance.py",
              [f"model={model}", f"oracle_dir={oracle}", f"out_dir={acceptance}"] + threads
              + list(cfg.acceptance.overrides), acceptance, after=("oracle",), configs=("train_acceptance.yaml",),
              product="model.safetensors"),
    ]
    if cfg.ldlp.get("survival"):
        stages.append(Stage("ldlp_survival", "train the LDLP with the survival (distribution) head", "train_ldlp.py",
                            list(cfg.ldlp.survival_overrides)
                            + [f"model={model}", f"ldlp_training.oracle_dir={oracle}",
                               f"ldlp_training.out_dir={p.ldlp_survival}", "ldlp_training.evaluation.benchmark=false"]
                            + threads, Path(p.ldlp_survival), after=("oracle",), reads=pair, configs=ldlp_configs,
                            product="model.safetensors"))
    checkpoints = tuple(s.name for s in stages if s.name in ("ldlp", "ldlp_survival", "acceptance"))
    tuned = _tuning_file(cfg)
    if tuned is not None:
        stages.append(Stage("tune", "tune the adaptive policies by replay on the validation labels (measured cost "
                            "table)", "tune_policies.py",
                            [f"model={model}", f"oracle_dir={oracle}", f"out_dir={tuned.parent}"] + checkpoint_args(cfg)
                            + threads + list(cfg.tune.overrides),
                            tuned.parent, after=("corpus", "oracle") + checkpoints, reads=pair,
                            configs=("tune_policies.yaml", "data/*.yaml", "policy/*.yaml"), product="tuning.json"))
        if _tuner_prices_by_table(cfg):
            costs["tune"] = (attn, [1])  # replay prices its steps at one slot
    stages += _sweeps(cfg, stages, model, pair, overrides, checkpoints, tuned, costs, attn)
    bench = bench_batch_stage(cfg, stages, model, pair, costs)
    if bench is not None:
        stages.append(bench)
    stages += head_to_head_stages(cfg, stages, model, pair, costs, attn)
    return apply_overrides(cfg, with_cost_stage(cfg, stages, costs, model, pair), overrides, model)


def _sweeps(cfg, stages, model, pair, overrides, checkpoints, tuned, costs, attn) -> list[Stage]:
    """``sweep.rounds`` rounds of the static and the adaptive sweep (and, in the first ``peer.rounds`` of them, the
    peer sweeps on the draft LM), each a Hydra multirun of scripts/evaluate.py."""
    common = list(cfg.sweep.overrides) + thread_args(cfg)
    runs, out_stages = Path(cfg.paths.runs), []
    for r in range(1, int(cfg.sweep.rounds) + 1):
        sweeps = [("static", model, ["policy=static", f"policy.gamma={list_arg(cfg.sweep.static_gammas)}"], ()),
                  ("adaptive", model, [f"policy={list_arg(cfg.sweep.adaptive)}"] + checkpoint_args(cfg)
                   + ([f"tuned_from={tuned}"] if tuned else []), checkpoints + (("tune",) if tuned else ()))]
        if cfg.peer.enabled and r <= int(cfg.peer.get("rounds") or 1):
            if cfg.peer.static_gammas:
                sweeps.append(("peer_static", cfg.peer.model,
                               ["policy=static", f"policy.gamma={list_arg(cfg.peer.static_gammas)}"], ()))
            if cfg.peer.policies:
                sweeps.append(("peer", cfg.peer.model, [f"policy={list_arg(cfg.peer.policies)}"], ()))
            if cfg.peer.get("peers"):  # transformers' assisted generation: conf/peer/, selected by peer=NAME
                sweeps.append(("peer_hf", cfg.peer.model, [f"peer={list_arg(cfg.peer.peers)}"], ()))
        for name, sweep_model, args, after in sweeps:
            if args[0].endswith("="):  # an empty policy list
                continue
            out = runs / f"round-{r}" / name
            reads = pair if sweep_model == model else model_folders(cfg, sweep_model, overrides, peer=True)
            extra, prices = _policy_reads(cfg, args[0].split("=", 1)[1].split(","), stages)
            stage = Stage(f"sweep:{name}:{r}", f"round {r}/{cfg.sweep.rounds}: {name} ({sweep_model})",
                          "evaluate.py", ["-m", f"model={sweep_model}"] + args + common
                          + [f"hydra.sweep.dir={out}"], out, after=("corpus",) + after, reads=reads + extra,
                          configs=EVAL_CONFIGS, group="sweeps", clear=True)
            if prices and sweep_model == model:  # batch 1: one slot's costs
                costs[stage.name] = (attn, [1])
            out_stages.append(stage)
    return out_stages


_policy_cache: dict = {}


def _policy_reads(cfg, policies, stages: list[Stage]) -> tuple[tuple[str, ...], bool]:
    """(reads, prices): the folders of ``cfg.paths`` that the policies read and no stage of the plan writes (the
    per-temperature draft acceptance heads in paths.draft_acceptance), which the fingerprint hashes by content, so
    a retrained head reruns the stages that use them; and whether a policy prices steps by the cost table of
    paths.cost, which the cost stage profiles (:func:`with_cost_stage`)."""
    from ldlp.policies.pricing import flat_pricing

    written = {str(s.out) for s in stages} | {str(Path(cfg.paths.embedded) / "corpus")}
    roots = {str(cfg.paths.get(k)) for k in ("root", "data_dir", "outputs")}
    folders = {str(v) for k, v in cfg.paths.items() if isinstance(v, str)} - roots
    # the policies' paths as the stages resolve them: every leaf of the main command's paths
    paths_overrides = [f"paths.{k}={v}" for k, v in cfg.paths.items() if isinstance(v, str)]
    reads = []
    for name in dict.fromkeys(str(x) for x in policies):
        if not (CONF_DIR / "policy" / f"{name}.yaml").is_file():
            continue
        key = (name, tuple(paths_overrides), str(CONF_DIR))
        if key not in _policy_cache:
            try:
                from omegaconf import OmegaConf

                _policy_cache[key] = OmegaConf.to_container(
                    compose("evaluate", [f"policy={name}"] + paths_overrides).policy, resolve=True)
            except Exception:  # a policy config that needs more than the defaults: the sweep itself will say so
                _policy_cache[key] = {}
        policy = flat_pricing(_policy_cache[key])  # the pricing node's cost_dir among the policy's folders
        reads += [str(v) for v in policy.values() if isinstance(v, str) and v in folders and v not in written]
    cost = str(cfg.paths.get("cost"))
    return tuple(r for r in dict.fromkeys(reads) if r != cost), cost in reads


def _target_attn(cfg, model: str, overrides=()) -> str:
    """The attention math of the batch-1 engines (evaluate.py, compare.py, the tuner): the target's, as loaded."""
    impl = compose_model(cfg, model, overrides).get("attn_implementation") or "sdpa"
    return impl if impl in ("eager", "sdpa") else "sdpa"


def _tuner_prices_by_table(cfg) -> bool:
    """Whether tune_policies.py prices replayed steps by the measured table of paths.cost (its default), not by a
    fitted model, a given table file or a synthetic linear price (conf/tune_policies.yaml costs.*)."""
    c = compose("tune_policies", [o for o in cfg.tune.overrides if override_key(o).startswith("costs.")]).costs
    linear = c.get("linear") or {}
    return not c.get("model") and not c.get("table") and linear.get("step_ms") is None \
        and linear.get("draft_ms") is None


def with_cost_stage(cfg, stages: list[Stage], costs: dict, model: str, pair: tuple[str, ...]) -> list[Stage]:
    """``stages`` with the ``cost`` stage before the first that prices steps by the cost table (``costs``: stage ->
    (attention, slot counts)), and it upstream of each of them: scripts/profile_cost.py ``missing_only=true``
    profiles, into paths.cost, what is missing of the table for every attention and the union of the slot counts
    they need, with the engines their first use would profile with; a table there already is kept. A table
    profiled again (by hand) changes the stage's output, so the stages after it run again."""
    if not costs:
        return stages
    attns = sorted({a for a, _ in costs.values()})
    slots = sorted({s for _, ss in costs.values() for s in ss})
    out = Path(cfg.paths.cost)
    multi = len(attns) > 1  # one table per attention: a multirun over them
    args = ((["-m"] if multi else []) + [f"model={model}", "missing_only=true", f"attn={list_arg(attns)}",
                                         f"slots=[{list_arg(slots)}]"] + thread_args(cfg)
            + [f"hydra.{'sweep' if multi else 'run'}.dir={out / 'logs'}"])
    cost = Stage("cost", f"profile the step cost table where missing (attention {', '.join(attns)}, slot counts "
                 f"{list_arg(slots)}): {', '.join(costs)} price steps by it", "profile_cost.py", args, out, reads=pair,
                 configs=("profile_cost.yaml",))
    for s in stages:
        if s.name in costs:
            s.after = s.after + ("cost",)
    first = next(k for k, s in enumerate(stages) if s.name in costs)
    return stages[:first] + [cost] + stages[first:]


def bench_batch_stage(cfg, stages: list[Stage], model: str, pair: tuple[str, ...], costs: dict) -> Stage | None:
    """The load sweep's short version (scripts/bench_batch.py): tokens/s against concurrency and temperature for
    batched AR, static γ and the adaptive policies, with paired ratios to the baselines. A contender whose
    conf/policy/<name>.yaml does not exist is refused by :func:`validate`. Its load-aware contenders price steps
    by the cost table for slot counts up to its largest concurrency (``costs``)."""
    from eagle_backbone.cost import slots_for

    b = cfg.get("bench_batch")
    if not b or not b.get("enabled"):
        return None
    specs = _bench_contenders(cfg)
    contenders = [str(spec) for spec in specs]  # the string form: what the command line takes
    out = Path(cfg.paths.results) / "load_sweep"
    args = ([f"model={model}", "concurrency=[" + list_arg(b.concurrency) + "]",
             "temperatures=[" + list_arg(b.temperatures) + "]",
             "contenders=[" + ",".join(f'"{c}"' for c in contenders) + "]",
             f"rounds={int(b.rounds)}", f"blocks={int(b.blocks)}", f"out_dir={out}", f"hydra.run.dir={out}"]
            + checkpoint_args(cfg) + thread_args(cfg) + list(b.overrides))
    names = {s.name for s in stages}
    used = {spec.policy.name for spec in specs}
    after = ("corpus",) + tuple(n for n in ("ldlp", "ldlp_survival", "acceptance")
                                if n in names and (n in used or (n == "ldlp" and "ldlp_ddd" in used)))
    # what the policies read besides the checkpoints, like the weights: the draft acceptance heads
    extra, prices = _policy_reads(cfg, used, stages)
    if prices:
        attn = str(compose("bench_batch", [o for o in b.overrides if override_key(o) == "attn"]).attn)
        costs["bench_batch"] = (attn, slots_for(max(int(c) for c in b.concurrency)))
    return Stage("bench_batch", f"load sweep (short): C={list_arg(b.concurrency)} x T={list_arg(b.temperatures)}, "
                 f"{len(contenders)} contenders and batched AR", "bench_batch.py", args, out, after=after,
                 reads=pair + extra,
                 configs=("bench_batch.yaml",) + EVAL_CONFIGS, group="bench", product="batch_bench.json")


def _tuning_file(cfg) -> Path | None:
    return Path(cfg.paths.results) / "tuning" / "tuning.json" if cfg.tune.get("enabled") else None


def head_to_head_stages(cfg, stages: list[Stage], model: str, pair: tuple[str, ...], costs: dict,
                        attn: str) -> list[Stage]:
    """The ``contenders`` stage (scripts/choose_contenders.py: static γ around the best of the sweeps and of the
    tuning, the best adaptive policies, the oracle; :mod:`ldlp.pipeline.contenders`) and the ``head_to_head`` stage
    that times them in turns (scripts/compare.py ``contenders_from=``). contenders.json holds the choice alone, so
    the head to head runs again when the choice or its own inputs change, not whenever a sweep does. None without
    both a static γ and an adaptive policy to choose."""
    h = cfg.get("head_to_head")
    if not h or not h.get("enabled") or not cfg.sweep.static_gammas \
            or not [x for x in cfg.sweep.adaptive if x != "oracle"]:
        return []
    tuned = _tuning_file(cfg)
    sweeps = [s for s in stages if s.name.startswith("sweep:")]
    runs = Path(cfg.paths.runs)
    chosen, out = runs / "contenders", runs / "head_to_head"
    choose_by = h.get("choose_by")
    choose_by = "null" if choose_by is None else choose_by
    contenders = Stage(
        "contenders", "choose the head to head's contenders from the sweeps and the tuning", "choose_contenders.py",
        [f"model={model}", f"sweep.dirs=[{list_arg(s.out for s in sweeps)}]",
         f"sweep.static_gammas=[{list_arg(cfg.sweep.static_gammas)}]",
         f"sweep.adaptive=[{list_arg(cfg.sweep.adaptive)}]", f"head_to_head.adaptive={int(h.adaptive)}",
         f"head_to_head.choose_by={choose_by}", f"head_to_head.shipped=[{list_arg(h.get('shipped') or [])}]",
         f"out_dir={chosen}"] + ([f"tuned_from={tuned}"] if tuned else []) + thread_args(cfg)
        + [o for o in cfg.sweep.overrides if o.startswith("model.")],  # the model as the sweeps named their rows
        chosen, after=tuple(s.name for s in sweeps) + (("tune",) if tuned else ()), configs=("choose_contenders.yaml",),
        group="sweeps", product=CONTENDERS)
    args = ([f"model={model}", f"contenders_from={chosen / CONTENDERS}", f"rounds={h.rounds}", f"out_dir={out}",
             f"hydra.run.dir={out}"] + checkpoint_args(cfg) + ([f"tuned_from={tuned}"] if tuned else [])
            + thread_args(cfg) + [o for o in cfg.sweep.overrides if not o.startswith("evaluation.repeats")]
            + list(h.overrides))
    names = {s.name for s in stages}
    after = tuple(n for n in ("corpus", "ldlp", "ldlp_survival", "acceptance", "tune") if n in names)
    extra, prices = _policy_reads(cfg, cfg.sweep.adaptive, stages)  # any of them may be chosen
    if prices:
        costs["head_to_head"] = (attn, [1])
    head = Stage("head_to_head", "head to head: the chosen contenders and AR, timed in turns", "compare.py", args, out,
                 after=after + ("contenders",), reads=pair + extra,
                 configs=("compare.yaml",) + EVAL_CONFIGS, group="sweeps", product="head_to_head.json",
                 scale=int(h.rounds) / 2)  # EXPECTED_S's head to head has 2 rounds
    return [contenders, head]
