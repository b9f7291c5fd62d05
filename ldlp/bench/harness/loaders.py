"""What every benchmark loads: the model pair, the prompts and the policies, cached per process.

A Hydra multirun evaluates many policies in one process, so each pair and prompt set is loaded once.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from eagle_backbone.io import file_sha256
from eagle_backbone.policy import DraftPolicy
from eagle_backbone.sampling import SamplingConfig
from ldlp.bench.harness.peer import is_peer

log = logging.getLogger(__name__)


_PAIRS: dict[str, object] = {}


_PROMPTS: dict[str, list] = {}


def config_key(node) -> str:
    return json.dumps(OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node,
                      sort_keys=True, default=str)


def load_pair_cached(model_cfg):
    from eagle_backbone.loading import load_pair

    key = config_key(model_cfg)
    if key not in _PAIRS:
        _PAIRS[key] = load_pair(model_cfg)
    return _PAIRS[key]


_TOKENIZERS: dict[str, object] = {}


def load_tokenizer_cached(model_cfg):
    """The pair's tokenizer alone (``model.tokenizer``, else the target's folder): what the prompts need,
    read before any weights so that a bad prompt file fails in a second, not after the models load."""
    from eagle_backbone.loading import load_tokenizer

    path = model_cfg.get("tokenizer") or model_cfg.get("target")
    remote = bool(model_cfg.get("trust_remote_code", False))
    key = f"{path}|{remote}"
    if key not in _TOKENIZERS:
        if not path or (not Path(str(path)).is_dir() and Path(str(path)).is_absolute()):
            raise ValueError(f"model.tokenizer={path}: no such folder (train or download the models first; "
                             "nothing is fetched at run time)")
        _TOKENIZERS[key] = load_tokenizer(path, remote)
    return _TOKENIZERS[key]


class PromptSet(list):
    """``[(conversation id, prompt ids), ...]`` plus ``info``: what identifies the set (the prompt file's
    path and SHA-256, ``limit``, ``sample_seed``, ``turns``) and how many prompts were dropped and why
    (``n_dropped``, ``dropped_reason``; ``dropped``: their ids). Results carry ``info`` so that runs on
    different sets never merge."""

    info: dict = {}
    dropped: list = []


def prompt_set_info(data_cfg, n_dropped: int = 0, n_skipped: int = 0) -> dict:
    """The identity of the prompt set ``data_cfg`` names (file path and content hash, limit, sample seed,
    turns) and its dropped prompts; what :class:`PromptSet` carries as ``info``."""
    path = data_cfg.get("path")
    limit, seed, max_tokens = data_cfg.get("limit"), data_cfg.get("sample_seed"), data_cfg.get("max_prompt_tokens")
    return {"data_path": str(path), "data_sha256": file_sha256(path) if path and Path(path).is_file() else None,
            "limit": None if limit is None else int(limit), "sample_seed": None if seed is None else int(seed),
            "turns": str(data_cfg.get("turns", "first")), "n_dropped": int(n_dropped),
            "dropped_reason": f"longer than max_prompt_tokens={max_tokens}" if n_dropped else None,
            "n_skipped_records": int(n_skipped)}


def load_prompts(data_cfg, tokenizer) -> PromptSet:
    """(conversation id, prompt token ids) for the prompt set ``data_cfg`` (its first ``limit`` items), as a
    :class:`PromptSet` whose ``info`` identifies the set and counts the prompts dropped for length."""
    from eagle_backbone.data.conversations import build_prompts, conversations_of

    key = config_key(data_cfg) + str(getattr(tokenizer, "name_or_path", id(tokenizer)))
    if key not in _PROMPTS:
        path = data_cfg.get("path")
        if not path:
            raise ValueError(f"data.path is empty (data={data_cfg.get('name')}); give a prompt file with data.path=FILE")
        conversations = conversations_of(data_cfg, path)
        prompts = build_prompts(tokenizer, conversations, data_cfg.get("max_prompt_tokens"),
                                min_prompt_tokens=data_cfg.get("min_prompt_tokens"),
                                turns=data_cfg.get("turns", "first"), chat_template=data_cfg.get("chat_template"))
        if not prompts:
            raise ValueError(f"data.path={path}: no prompts (empty file, every conversation skipped, or every prompt "
                             f"outside data.min_prompt_tokens={data_cfg.get('min_prompt_tokens')} .. "
                             f"data.max_prompt_tokens={data_cfg.get('max_prompt_tokens')})")
        out = PromptSet((str(cid), list(ids)) for cid, ids in prompts)
        out.info = prompt_set_info(data_cfg, getattr(prompts, "too_long", 0), getattr(conversations, "skipped", 0))
        out.info.update(min_prompt_tokens=data_cfg.get("min_prompt_tokens"), n_too_short=getattr(prompts, "too_short", 0),
                        mean_prompt_tokens=sum(len(ids) for _, ids in out) / len(out))
        out.dropped = list(getattr(prompts, "dropped", []))  # the dropped prompts' ids (per-category counts)
        _PROMPTS[key] = out
    return _PROMPTS[key]


# the checkpoint folders that conf/policy/*.yaml interpolate (${ldlp_path}, ...)
CHECKPOINT_KEYS = ("ldlp_path", "ldlp_survival_path", "acceptance_path", "learned_path")


def policy_config(cfg, contender) -> tuple[str, DictConfig]:
    """(name, policy node) that ``scripts/evaluate.py`` would build for ``contender`` (a
    :class:`~ldlp.bench.harness.contender.ContenderSpec`, or what :func:`~ldlp.bench.harness.contender.parse_contender`
    reads: a string ``policy=NAME [policy.KEY=VALUE ...]``, a node ``{policy: {name: NAME, KEY: VALUE}}``, or a list of
    such words), with ``cfg``'s checkpoint folders. For scripts that run several policies; call it inside a Hydra
    app (its search path holds conf/)."""
    from hydra import compose

    from eagle_backbone.errors import ConfigError
    from ldlp.bench.harness.contender import parse_contender

    spec = parse_contender(" ".join(map(str, contender)) if isinstance(contender, (list, tuple)) else contender)
    if spec.policy is None:
        raise ConfigError(f"contender {str(spec)!r}: give exactly one policy=NAME (a file under conf/policy/)")
    paths = [f"{k}={cfg[k]}" for k in CHECKPOINT_KEYS if k in cfg]
    composed = compose(config_name="evaluate", overrides=spec.policy_overrides() + paths)
    return spec.policy.name, resolve_in(cfg, composed.policy, defaults=composed)


def resolve_in(cfg, node, defaults=None):
    """``node`` (a policy config composed elsewhere, as :func:`policy_config` composes it, whose
    interpolations point at that composition's defaults) with its interpolations (``${model.name}``,
    ``${paths.*}``, ``${generation.*}``...) bound to ``cfg``, the running script's config: a policy keyed
    by model or path reads this run's model, not the default one. Keys ``cfg`` lacks come from ``defaults``
    (the composition itself)."""
    from omegaconf import OmegaConf

    root = {} if defaults is None else OmegaConf.to_container(defaults, resolve=False)
    root.update(OmegaConf.to_container(cfg, resolve=False))
    root["policy"] = OmegaConf.to_container(node, resolve=False)
    return OmegaConf.create(root).policy


def missing_checkpoint(name: str, policy_cfg) -> None:
    """Raise :class:`~eagle_backbone.errors.MissingCheckpoint` when the checkpoint folder that policy ``name``
    reads (``path``: an LDLP or acceptance head; ``estimator`` when not ``confidence``: draft acceptance
    heads) does not exist or holds no checkpoint yet: the one error a benchmark may skip a contender for."""
    from eagle_backbone.errors import MissingCheckpoint

    for key, marker in (("path", "config.json"), ("estimator", None)):
        value = policy_cfg.get(key) if key in policy_cfg else None
        if value is None or (key == "estimator" and str(value) == "confidence"):
            continue
        folder = Path(str(value))
        if not folder.is_dir() or (marker and not (folder / marker).is_file()) or (not marker and not any(folder.iterdir())):
            raise MissingCheckpoint(f"policy={name}: policy.{key}={folder} holds no trained checkpoint yet "
                                    "(train it first: docs/pipeline.md lists the stage that writes it)")


def check_turns_kept(data_cfg, prompt_set, what: str) -> None:
    """With ``data.turns=all``, refuse a prompt set that leaves user turns out (MT-bench second turns need the
    model's own earlier answer, which ``what`` does not generate); the error says how many and what to use."""
    from eagle_backbone.data.conversations import ROLE_OF, conversations_of
    from eagle_backbone.errors import ConfigError

    if str(data_cfg.get("turns", "first")) != "all":
        return
    conversations = conversations_of(data_cfg)
    users = sum(1 for c in conversations for t in c["conversations"] if ROLE_OF.get(t["from"]) == "user")
    kept = len(prompt_set) + int(getattr(prompt_set, "info", {}).get("n_dropped", 0) or 0)
    if kept < users:
        raise ConfigError(f"data.turns=all: {users - kept} of {users} user turns in {data_cfg.get('path')} would be "
                          f"left out (they need the model's own earlier answers, which {what} does not generate, or "
                          "follow a turn dropped for length); use data.turns=first, or scripts/evaluate.py "
                          "data.turns=all for every turn")


def cost_engine_factory(target, candidates, attn: str | None = None, capacity: int | None = 256):
    """``factory(R, policy=None)``: a batched engine of R slots over this pair, as the load-aware policies build them
    to profile their cost table (ldlp/policies/load_aware.py); ``attn`` None: the target's default, as
    ``SpeculativeDecoder`` uses it."""
    from ldlp.bench.harness.engines import EngineFactory

    return EngineFactory(target, candidates, capacity, attn)


def engine_cost_key(model_name: str, target, candidates, attn: str | None = None) -> dict | None:
    """This setup's cost key (:func:`~eagle_backbone.cost.cost_key` completed by an engine's drafter kind and weights
    and attention: the key a cost table profiled for it carries), what a step-cost model fitted on its steps records
    so that a policy on another setup refuses it; None without a candidate generator (nothing is priced)."""
    from eagle_backbone.cost import cost_key, full_key

    if candidates is None:
        return None
    key = cost_key(model_name, target.dtype, target.device, torch.get_num_threads())
    return full_key(key, cost_engine_factory(target, candidates, attn))


def load_cost_table(cost_dir, model_name: str, target, candidates, attn: str | None = None, slots=(1,),
                    path=None, profile_if_missing: bool = True):
    """The :class:`~eagle_backbone.cost.CostTable` of this setup, found as the load-aware policies find theirs:
    ``path`` (a table given) checked against this setup, else the table for its key under ``cost_dir``,
    profiled for ``slots`` when missing (``profile_if_missing``)."""
    from eagle_backbone.cost import CostTable, cost_key, full_key, load_or_profile

    factory = cost_engine_factory(target, candidates, attn)
    key = cost_key(model_name, target.dtype, target.device, torch.get_num_threads())
    if path is not None:
        return CostTable.load(path, full_key(key, factory))
    return load_or_profile(cost_dir, key, factory, profile_if_missing, log=log.info, slots=list(slots))


def replay_costs(c, model_name: str, pair, who: str):
    """What prices replayed steps (config ``c``, a script's ``costs`` group): a step-cost model fitted in hindsight
    (``c.model``), a synthetic linear table (``c.linear``), else the step-cost model as an engine starts it,
    warm-started from this setup's measured table (``c.table``, or the one under ``c.cost_dir``, profiled at one
    slot when missing). ``who`` names the script in errors."""
    from eagle_backbone.cost import CostTable
    from eagle_backbone.errors import ConfigError
    from eagle_backbone.step_cost import OnlineCostModel

    if c.get("model"):
        return OnlineCostModel.load(c.model)
    lin = c.get("linear") or {}
    if lin.get("step_ms") is not None or lin.get("draft_ms") is not None:
        if lin.get("step_ms") is None or lin.get("draft_ms") is None:
            raise ConfigError(f"{who}: a linear price needs both costs.linear.step_ms and costs.linear.draft_ms")
        return CostTable.linear(lin.step_ms, lin.draft_ms, lin.get("accepted_ms") or 0.0)
    if pair.candidates is None:
        raise ConfigError(f"{who}: the model has no drafter, so there is no cost table to price drafts by; "
                          "give a linear price (costs.linear.step_ms=... costs.linear.draft_ms=...)")
    return OnlineCostModel(load_cost_table(c.cost_dir, model_name, pair.target, pair.candidates,
                                           path=c.get("table"), profile_if_missing=bool(c.profile_if_missing)))


def prepare_cost_tables(policies, target, candidates, attn: str | None, concurrency: int) -> None:
    """The cost table of every load-aware contender, before any clock starts: a table given (cost_table=) checked
    against this setup (drafter kind and weights, attention, processor...), else its setup's table loaded, or
    profiled for the slot counts this run needs only (up to ``concurrency``, the largest C; 1 at batch 1).
    ``attn``: the engine's attention math (None: the target's default, as ``SpeculativeDecoder`` uses it)."""
    from eagle_backbone.cost import slots_for

    if candidates is None:
        return
    done = set()
    from eagle_backbone.policy import DraftPolicy

    for p in policies:
        if not (isinstance(p, DraftPolicy) and p.needs_costs):
            continue
        pr = p.pricing
        if pr.cost_table_path is not None:  # a table given: it must be this setup's
            load_cost_table(None, pr.model_name, target, candidates, attn, path=pr.cost_table_path)
            continue
        if (pr.cost_dir, pr.model_name) in done:
            continue
        done.add((pr.cost_dir, pr.model_name))
        load_cost_table(pr.cost_dir, pr.model_name, target, candidates, attn, slots_for(concurrency),
                        profile_if_missing=pr.profile_if_missing)


# a policy's keys that name a learned folder (config.json + model.safetensors, or t<T>/ subfolders of them)
LEARNED_KEYS = ("path", "estimator")


def check_learned_files(policy_cfg, model_cfg) -> None:
    """The learned folders a policy would load (an LDLP checkpoint, the shipped predictor, an acceptance head, a
    folder of draft-acceptance heads) checked against the run's model before any weights load: made for another
    model or drafter (its ``meta.made_for``, :mod:`eagle_backbone.made_for`), one is refused in one line naming the
    file and both sides. A folder not there is the policy's to report; one without the record is taken."""
    from eagle_backbone.made_for import ACCEPTANCE_FIELDS, check_made_for, made_for_of, run_made_for

    run = None
    for key in LEARNED_KEYS:
        value = policy_cfg.get(key)
        if not isinstance(value, str) or not Path(value).is_dir():
            continue
        folder = Path(value)
        configs = [folder / "config.json"] if (folder / "config.json").is_file() else sorted(folder.glob("*/config.json"))
        for config in configs:
            try:
                meta = json.loads(config.read_text()).get("meta")
            except (OSError, ValueError, AttributeError):
                continue  # the loader names an unreadable file
            made_for = made_for_of(meta if isinstance(meta, dict) else None)
            if made_for is None:
                continue
            run = run or run_made_for(model_cfg)
            check_made_for(f"policy.{key}={config.parent}", made_for, run, ACCEPTANCE_FIELDS,
                           "train one on this pair's labels (docs/pipeline.md#learned-files) or point the policy at it")


def build_policy(policy_cfg, model_cfg=None):
    """The policy of ``policy_cfg`` (a conf/policy/*.yaml node); with ``model_cfg`` (the run's model) the learned
    files it names are first checked against it (:func:`check_learned_files`)."""
    from hydra.utils import instantiate

    if "_target_" not in policy_cfg:
        raise ValueError("policy config has no _target_: pick one with policy=static|ldlp|ddd|... "
                         "(files under conf/policy/)")
    if model_cfg is not None:
        check_learned_files(policy_cfg, model_cfg)
    from hydra.errors import InstantiationException

    try:
        policy = instantiate(policy_cfg)
    except InstantiationException as e:  # the policy's own one-line ValueError, not hydra's wrapper
        if isinstance(e.__cause__, ValueError):
            raise e.__cause__ from None
        raise
    if not (isinstance(policy, DraftPolicy) or is_peer(policy)):  # a peer (conf/peer/) runs in place of the engine
        raise ValueError(f"policy._target_={policy_cfg['_target_']} built a {type(policy).__name__}, not a DraftPolicy "
                         "(eagle_backbone/policy.py; docs/policies.md#adding-one)")
    return policy


_DIGESTS: dict[int, tuple] = {}  # id of a loaded pair's candidate generator -> (it, its drafter's digest)
TUNED_FIELDS = ("model", "dtype", "drafter_kind", "drafter_sha256")  # what a tuned file must match, where both know it


def run_setup(model_cfg, pair=None) -> dict:
    """What a run drives a tuned policy file with (a tuning.json records it as ``made_for``): the model's name, the
    dtype it loads in, the drafter kind, and with ``pair`` loaded the drafter weights' digest."""
    from eagle_backbone.cost import drafter_sha256
    from eagle_backbone.runtime import resolve_dtype

    kind = model_cfg.get("drafter_kind")
    setup = {"model": str(model_cfg.get("name", "")),
             "dtype": resolve_dtype(model_cfg.get("dtype"), str(model_cfg.get("device") or "cpu")),
             "drafter_kind": None if kind is None else str(kind)}
    if pair is not None:  # hashed once per loaded pair (the pairs live as long as the process: _PAIRS)
        held = _DIGESTS.get(id(pair.candidates))
        if held is None or held[0] is not pair.candidates:
            held = _DIGESTS[id(pair.candidates)] = (pair.candidates, drafter_sha256(pair.candidates))
        setup["drafter_sha256"] = held[1]
    return setup


def check_tuned(tuned_from, run: dict | None) -> None:
    """A tuning.json made for another setup than ``run`` (:func:`run_setup`) is refused in one line naming the file
    and both sides (or, with accept_mismatch=true, taken and recorded: eagle_backbone/errors.py). A file of before
    the record (no ``made_for``), or a field either side does not know, is taken as it is."""
    from eagle_backbone.made_for import check_made_for

    if not tuned_from or run is None:
        return
    try:
        made_for = json.loads(Path(tuned_from).read_text()).get("made_for")
    except (OSError, ValueError, AttributeError):
        return  # apply_tuned names an unreadable file
    if not isinstance(made_for, dict):
        log.debug("tuned_from=%s records no setup (a file of before the record): taken as it is", tuned_from)
        return
    # thresholds tuned on another model's acceptance or another dtype's costs: silently off here
    check_made_for(f"tuned_from={tuned_from}", made_for, run, TUNED_FIELDS,
                   "tune for this one (python scripts/tune_policies.py)", verb="tuned")


def apply_tuned(policy_cfg, tuned_from, policy_name: str | None, run: dict | None = None):
    """``policy_cfg`` with the best replay-tuned setting of ``policy_name`` from ``tuned_from`` (the
    tuning.json of scripts/tune_policies.py) merged in; (config, the applied setting or None). ``run``
    (:func:`run_setup`): a file applied must have been tuned for it (:func:`check_tuned`)."""
    if not tuned_from or not policy_name:
        return policy_cfg, None
    path = Path(tuned_from)
    if not path.is_file():
        raise ValueError(f"tuned_from={tuned_from}: no such file (run python scripts/tune_policies.py first)")
    try:
        results = json.loads(path.read_text())["results"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"tuned_from={tuned_from}: not a tuning.json of scripts/tune_policies.py ({e!r})") from None
    from ldlp.bench.harness.replay import best_per_policy

    best = best_per_policy(results).get(policy_name)
    if best is None or policy_name in ("static", "oracle"):
        return policy_cfg, None
    check_tuned(tuned_from, run)  # only where the file is applied
    log.info("policy %s: tuned setting %s from %s", policy_name, best["params"], tuned_from)
    return OmegaConf.merge(policy_cfg, best["params"]), best["params"]


def machine_info() -> dict:
    fields: dict[str, str] = {}  # /proc/cpuinfo's first CPU (every CPU repeats the same keys)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    # the model name is more telling than "x86_64" where /proc/cpuinfo exists
    cpu = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    info = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            # bfloat16 matmuls in hardware (AVX-512 BF16 or AMX) or emulated: it changes the embedded pair's
            # cost shape (bf16 emulated is compute-bound: extra scored tokens cost nearly their full price)
            "cpu_bf16": bool(flags & {"avx512_bf16", "amx_bf16"}) if flags else None,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def sampling_config(gen_cfg) -> SamplingConfig:
    return SamplingConfig(temperature=float(gen_cfg.get("temperature", 0.0)), top_k=int(gen_cfg.get("top_k", 0)),
                          top_p=float(gen_cfg.get("top_p", 1.0)))


def short_and_long_prompts(cfg, config_name: str, tokenizer) -> dict[str, list[list[int]]]:
    """The first ``cfg.prompts`` prompt ids of ``cfg.data`` (the short set) and, when ``cfg.long_path`` is given,
    of the ``cfg.long_data`` config read from that file (the long set), keyed by each set's name; a missing
    long file is one error line before any model loads. Call inside the Hydra app of ``config_name``."""
    from hydra import compose

    if cfg.long_path is not None and not Path(cfg.long_path).is_file():
        raise ValueError(f"long_path={cfg.long_path}: no such file (the long prompt set's file)")
    sets = {cfg.data.name: [ids for _, ids in load_prompts(cfg.data, tokenizer)][: cfg.prompts]}
    if cfg.long_path is not None:
        long_cfg = compose(config_name=config_name, overrides=[f"data={cfg.long_data}", f"data.path={cfg.long_path}",
                                                               "data.limit=null"]).data
        sets[long_cfg.name] = [ids for _, ids in load_prompts(long_cfg, tokenizer)][: cfg.prompts]
    return sets
