"""What a benchmark runs, one record whatever form it was written in: :class:`ContenderSpec`, read by one parser
(:func:`parse_contender`) for ``scripts/bench_batch.py``, ``scripts/compare.py`` and the main command's checks.

A contender is a policy of this engine (``policy``: a conf/policy/NAME.yaml and settings over it), optionally on
this engine's own settings (``engine``: ``prefill``, ``max_batched_tokens``; alone: batched AR on them), or a peer
engine (``peer``: vLLM). Two forms give the same record:

    structured, a node of a ``contenders`` list in a YAML or a Hydra override:
        {policy: {name: static, gamma: 3}}
        {policy: {name: load_aware_step, goodput: {enabled: false}}, engine: {prefill: joined}}
        {engine: {prefill: chunked, max_batched_tokens: 512}}
        {peer: {engine: vllm, method: eagle3, k: 6}}
    a string, as the command line gives it (values read as Hydra reads an override's):
        "policy=static policy.gamma=3"
        "policy=load_aware_step policy.goodput.enabled=false prefill=joined"   (or engine.prefill=joined)
        "prefill=chunked max_batched_tokens=512"
        "engine=vllm spec.method=eagle3 spec.k=6"

A bad contender is refused before anything loads, in one line naming the contender and the key. This engine's
settings are checked against the engine's own defaults (:data:`ENGINE_DEFAULTS`, the constants its constructor
takes them from). The labels the pages show come from here too (:func:`policy_label`, :func:`engine_label`).

Spellings of before, still read: a cost-driven policy's pricing key written flat (``policy.online_costs=false``,
``policy.cost_model=FILE``, ``policy.cost_table=FILE``) is its ``pricing`` node's (``policy.pricing.*``), in a
contender and on scripts/evaluate.py's command line (:func:`flat_pricing_args`); a transformers peer named as a
policy there (``policy=hf_heuristic``, from when conf/policy/ held them) is ``peer=hf_heuristic`` (:func:`peer_alias`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle_backbone.errors import ConfigError
from eagle_backbone.paths import CONF_DIR
from eagle_backbone.prefill import MAX_BATCHED_TOKENS, MAX_DRAFT, PREFILL_DEFAULT, check_prefill
from ldlp.policies.pricing import PRICING_KEYS

# this engine's settings a contender may give itself, with the engine's own defaults (eagle_backbone/prefill.py)
ENGINE_DEFAULTS = {"prefill": PREFILL_DEFAULT, "max_batched_tokens": MAX_BATCHED_TOKENS}
PEER_ENGINES = ("vllm",)
PEER_KEYS = ("engine", "method", "k", "schedule")  # a peer node's keys; the string form writes spec.KEY for the last 3
METHODS = ("eagle", "eagle3")  # vLLM's speculative methods this peer runs; a drafter kind names its own (vllm_method)
PEER_DIR = CONF_DIR / "peer"  # transformers' assisted generation: not a policy of this engine (scripts/evaluate.py)


def draft_cap(max_new_tokens: int) -> int:
    """The most drafts the engine scores in one step with this budget: the engine's ``max_draft`` and the
    tokens left after the one the target adds (``max_new_tokens - 1``)."""
    return max(0, min(int(MAX_DRAFT), int(max_new_tokens) - 1))


@dataclass(frozen=True)
class PolicyNode:
    """A policy of this engine: conf/policy/``name``.yaml with ``settings`` (dotted key -> value) over it."""

    name: str
    settings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PeerNode:
    """A peer engine (vLLM): its AR (``k`` None, no ``schedule``), its EAGLE or EAGLE-3 (``method``) drafting ``k``
    tokens a step, or its Dynamic SD ``schedule`` file (``k`` None until the file is read: its largest K)."""

    engine: str = "vllm"
    k: int | None = None
    method: str | None = None
    schedule: str | None = None


@dataclass(frozen=True)
class ContenderSpec:
    """One contender: ``policy`` (None: batched AR, or a peer), ``engine`` (this engine's settings it gives itself,
    in the order given) or ``peer``. ``text``: how it was written (its string form when it was a node), which
    errors and the skipped list name; two specs are equal when they say the same, whatever their form."""

    policy: PolicyNode | None = None
    engine: dict = field(default_factory=dict)
    peer: PeerNode | None = None
    text: str = field(default="", compare=False)

    def __str__(self) -> str:
        return self.text or to_string(self)

    def policy_overrides(self) -> list[str]:
        """The Hydra overrides that compose this policy (``policy=NAME``, ``policy.KEY=VALUE``): what
        scripts/evaluate.py would be given."""
        if self.policy is None:
            return []
        return [f"policy={self.policy.name}"] + [f"policy.{k}={render_value(v)}" for k, v in self.policy.settings.items()]


def to_string(spec: ContenderSpec) -> str:
    """The string form of ``spec`` (what the command line takes; :func:`parse_contender` reads it back the same)."""
    if spec.peer is not None:
        p = spec.peer
        method = None if p.method == "eagle" else p.method  # vLLM's EAGLE: what spec.k alone means
        words = [f"engine={p.engine}"] + [f"spec.{k}={v}" for k, v in (("method", method), ("k", p.k),
                                                                      ("schedule", p.schedule)) if v is not None]
        return " ".join(words)
    words = spec.policy_overrides() + [f"{k}={render_value(v)}" for k, v in spec.engine.items()]
    return " ".join(words)


# -- values, as Hydra reads an override's and writes them back --


def _override_value(token: str, where: str):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        o = OverridesParser.create().parse_override(token)
    except HydraException as e:
        why = (str(e).strip().splitlines() or ["unreadable"])[0]
        raise ConfigError(f"{where}: {token!r} is not KEY=VALUE ({why})") from None
    if o.is_sweep_override():
        raise ConfigError(f"{where}: {token!r} is a sweep; a contender takes one value a key (give one contender each)")
    return o.value()


def render_value(v) -> str:
    """``v`` written as a Hydra override's value that reads back as ``v``."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(render_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{render_value(x)}" for k, x in v.items()) + "}"
    s = str(v)
    try:
        if s and " " not in s and _override_value(f"k={s}", "") == s:
            return s
    except ConfigError:
        pass
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


# -- the parser --


def parse_contender(node, where: str = "contender") -> ContenderSpec:
    """The :class:`ContenderSpec` of ``node``: a string (``"policy=static policy.gamma=3 prefill=joined"``) or a
    mapping, a dict or an OmegaConf node (``{policy: {name: static, gamma: 3}, engine: {prefill: joined}}``). A
    ContenderSpec is returned as it is. One ConfigError line naming the contender and the key for anything else: an
    unknown key, a policy without its conf/policy/NAME.yaml or a key that file does not have, a peer with a policy,
    a bad peer or engine setting."""
    if isinstance(node, ContenderSpec):
        return node
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, dict):
        return _from_node(node, where)
    if isinstance(node, str):
        return _from_string(node, where)
    raise ConfigError(f"{where} {node!r}: a contender is a string ('policy=NAME policy.KEY=VALUE ...') or a node "
                      "({policy: {name: NAME, KEY: VALUE}, engine: {...}} or {peer: {engine: vllm, k: K}})")


ENGINE_WORDS = {**{k: k for k in ENGINE_DEFAULTS}, **{f"engine.{k}": k for k in ENGINE_DEFAULTS}}


def _from_string(text: str, where: str) -> ContenderSpec:
    at = f"{where} {text!r}"
    words = text.split()
    if not words:
        raise ConfigError(f"{where} {text!r} is empty: give policy=NAME, engine settings or engine=vllm")
    kv: dict[str, str] = {}
    for w in words:
        key, eq, value = w.partition("=")
        if not eq or not key:
            raise ConfigError(f"{at}: {w!r} is not KEY=VALUE")
        if key in kv:
            raise ConfigError(f"{at}: give exactly one policy=NAME, not {kv[key]} and {value}" if key == "policy"
                              else f"{at}: {key} is given twice")
        kv[key] = value
    if "engine" in kv:  # a peer engine: engine=vllm [spec.method=M] [spec.k=K] [spec.schedule=FILE]
        unknown = sorted(set(kv) - {"engine", "spec.k", "spec.method", "spec.schedule"})
        if unknown and kv["engine"] in PEER_ENGINES:
            raise ConfigError(f"{at}: takes engine=vllm and optionally spec.k=K, spec.method={'|'.join(METHODS)} "
                              f"and spec.schedule=FILE, not {', '.join(unknown)}")
        peer = {k.removeprefix("spec."): v for k, v in kv.items()}
        return ContenderSpec(peer=_peer(peer, at, "spec."), text=text)
    policy, settings, engine = None, {}, {}
    for key, value in kv.items():
        if key == "policy":
            policy = value
        elif key.startswith("policy."):
            settings[key[len("policy."):]] = _override_value(f"{key}={value}", at)
        elif key in ENGINE_WORDS:
            engine[ENGINE_WORDS[key]] = _override_value(f"{key}={value}", at)
        else:
            raise ConfigError(f"{at}: unknown key {key!r} (a contender takes policy=NAME, policy.KEY=VALUE, "
                              f"{', '.join(f'{k}=...' for k in ENGINE_DEFAULTS)}, or engine=vllm spec.k=K)")
    return _spec(policy, settings, engine, at, text)


def _from_node(node: dict, where: str) -> ContenderSpec:
    at = f"{where} {node!r}"
    unknown = sorted(set(node) - {"policy", "engine", "peer"})
    if unknown:
        raise ConfigError(f"{at}: unknown key {unknown[0]!r} (a contender node takes policy, engine or peer)")
    if node.get("peer") is not None:
        if node.get("policy") is not None or node.get("engine"):
            raise ConfigError(f"{at}: a peer engine takes no policy or engine settings of this engine")
        peer = node["peer"]
        peer = {"engine": peer} if isinstance(peer, str) else peer
        if not isinstance(peer, dict):
            raise ConfigError(f"{at}: peer must be a node {{engine: vllm, k: K, method: M, schedule: FILE}}")
        bad = sorted(set(peer) - set(PEER_KEYS))
        if bad:
            raise ConfigError(f"{at}: unknown key 'peer.{bad[0]}' (a peer takes {', '.join(PEER_KEYS)})")
        spec = ContenderSpec(peer=_peer(peer, at, "peer."))
        return ContenderSpec(peer=spec.peer, text=to_string(spec))
    policy, settings = node.get("policy"), {}
    if isinstance(policy, dict):
        rest = dict(policy)
        policy = rest.pop("name", None)
        if policy is None:
            raise ConfigError(f"{at}: policy needs a name (policy: {{name: NAME, ...}}, a conf/policy/NAME.yaml)")
        settings = _flatten(rest)
    engine = node.get("engine") or {}
    if not isinstance(engine, dict):
        raise ConfigError(f"{at}: engine must be a node of this engine's settings ({', '.join(ENGINE_DEFAULTS)})")
    for k in engine:
        if k not in ENGINE_DEFAULTS:
            raise ConfigError(f"{at}: unknown key 'engine.{k}' (this engine's settings: {', '.join(ENGINE_DEFAULTS)})")
    spec = _spec(policy, settings, dict(engine), at, "")
    return ContenderSpec(spec.policy, spec.engine, text=to_string(spec))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _spec(policy, settings: dict, engine: dict, at: str, text: str) -> ContenderSpec:
    # a pricing key written flat (policy.online_costs=false, as before the pricing node) is the node's
    settings = {(f"pricing.{k}" if k in PRICING_KEYS else k): v for k, v in settings.items()}
    if policy is None:
        if settings:
            raise ConfigError(f"{at}: policy.{next(iter(settings))} is set but no policy=NAME is given")
        if not engine:
            raise ConfigError(f"{at}: names no policy, engine setting or peer engine")
        return ContenderSpec(engine=engine, text=text)
    if not isinstance(policy, str) or not policy:
        raise ConfigError(f"{at}: policy must be the name of a conf/policy/NAME.yaml, got {policy!r}")
    check_policy_keys(policy, settings, at)
    return ContenderSpec(PolicyNode(policy, settings), engine, text=text)


def check_policy_keys(name: str, settings: dict, at: str) -> None:
    """One line when conf/policy/``name``.yaml is not there (a transformers peer of conf/peer/ says so) or lacks a
    key ``settings`` sets (a file that takes keys from a defaults list is left to Hydra's composition)."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "policy" / f"{name}.yaml"
    if not path.is_file():
        if (PEER_DIR / f"{name}.yaml").is_file():
            raise ConfigError(f"{at}: {name} is a peer (transformers' assisted generation, conf/peer/{name}.yaml), "
                              f"not a policy of this engine: scripts/evaluate.py peer={name} runs it")
        raise ConfigError(f"{at}: policy={name}: there is no conf/policy/{name}.yaml")
    own = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if "defaults" in own:
        return
    for key in settings:
        node = own
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"{at}: policy {name} has no key {key!r} (conf/policy/{name}.yaml)")
            node = node[part]


def _peer(kv: dict, at: str, pre: str) -> PeerNode:
    engine = kv.get("engine")
    if engine not in PEER_ENGINES:
        raise ConfigError(f"{at}: engine must be vllm (the only peer engine), got {engine!r}")
    k = kv.get("k")
    if k is not None:
        ok = (isinstance(k, int) and not isinstance(k, bool)) or (isinstance(k, str) and k.isdigit())
        if not ok or int(k) < 1:
            raise ConfigError(f"{at}: {pre}k must be an integer >= 1, got {k!r}")
        k = int(k)
    method, schedule = kv.get("method"), kv.get("schedule")
    if schedule is not None and str(schedule) == "":
        raise ConfigError(f"{at}: {pre}schedule needs a file (scripts/tune_vllm_schedule.py writes one)")
    if method is not None and method not in METHODS:
        raise ConfigError(f"{at}: {pre}method must be one of {'|'.join(METHODS)}, got {method!r}")
    if method is not None and k is None and schedule is None:
        raise ConfigError(f"{at}: {pre}method needs {pre}k=K (the drafted tokens per step)")
    speculative = k is not None or schedule is not None
    return PeerNode(str(engine), k, (method or "eagle") if speculative else None,
                    None if schedule is None else str(schedule))


# -- this engine's settings --


def engine_defaults(config: dict | None) -> dict:
    """This engine's settings for every contender: the engine's own defaults (:data:`ENGINE_DEFAULTS`) with the
    config's (``engine`` of conf/bench_batch.yaml; null: the engine's) over them, checked (one line)."""
    config = {k: v for k, v in (config or {}).items() if v is not None}
    unknown = sorted(set(config) - set(ENGINE_DEFAULTS))
    if unknown:
        raise ConfigError(f"engine: unknown key {unknown[0]!r} (this engine's settings: {', '.join(ENGINE_DEFAULTS)})")
    out = {**ENGINE_DEFAULTS, **config}
    try:
        check_prefill(out["prefill"], out["max_batched_tokens"])
    except ValueError as e:
        raise ConfigError(f"engine: {e}") from None
    return out


def engine_settings(spec: ContenderSpec, defaults: dict) -> dict:
    """The engine's settings for ``spec``: ``defaults`` (:func:`engine_defaults`) with its own over them, checked
    before anything loads (one line naming the contender)."""
    out = {**defaults, **spec.engine}
    at = f"contender {str(spec)!r}"
    try:
        check_prefill(out["prefill"], out["max_batched_tokens"])
    except ValueError as e:
        raise ConfigError(f"{at}: {e}") from None
    if "max_batched_tokens" in spec.engine and out["prefill"] != "chunked":
        # its label would say a budget the engine never applies (only chunked prefill has one)
        raise ConfigError(f"{at}: max_batched_tokens applies to prefill=chunked only, and this contender's prefill "
                          f"is {out['prefill']}")
    return out


# -- the labels the pages show --


def engine_label(label: str, own: dict) -> str:
    """A contender's label with the engine settings it gives itself (none: the label as it is)."""
    return label + "".join(f" {k}={v}" for k, v in own.items())


def policy_label(name: str, pcfg, gamma: int | None) -> str:
    """The label of policy ``name`` composed as ``pcfg`` (its fixed γ ``gamma``, None when adaptive): ``static γ=3``,
    or the name with the ablation it runs (``load_aware_step (no feedback)``, ``(hindsight costs)``...)."""
    from omegaconf import OmegaConf

    label = f"static γ={gamma}" if gamma is not None else name
    pricing = pcfg.get("pricing") if OmegaConf.is_dict(pcfg.get("pricing")) else {}
    if pricing.get("cost_model"):  # the same policy on costs measured in hindsight (a frozen step_costs.json)
        label += " (hindsight costs)"
    elif pricing.get("online_costs") is False:  # the same policy on the profiled table as it is
        label += " (profiled table)"
    if name == "learned" and pcfg.get("recalibrate") is not None:  # its hazards corrected online, or not
        label += " (recalibrated)" if pcfg.recalibrate else " (not recalibrated)"
    if name == "learned" and pcfg.get("batch", "uniform") != "uniform":  # under load: capped rows, or their own γ
        label += f" (batch {pcfg.batch})"
    goodput = pcfg.get("goodput") if "goodput" in pcfg else None
    if "goodput" in pcfg and not (goodput.get("enabled", True) if OmegaConf.is_dict(goodput) else goodput):
        label += " (no feedback)"  # the ablation: the plan alone
    elif OmegaConf.is_dict(goodput):  # the learner's ablations
        if goodput.get("reward") == "expected":
            label += " (expected reward)"  # chains credited their mean tokens by the pooled survival curve
        if goodput.get("prefill") == "skip":
            label += " (prefill steps skipped)"  # steps that also prefilled give no reward
        if goodput.get("monotone"):
            label += " (monotone feedback)"  # the buckets' best chains made non-increasing in the load
    return label


# -- the transformers peers, out of conf/policy/ --


def _is_peer_name(name: str) -> bool:
    return not (CONF_DIR / "policy" / f"{name}.yaml").is_file() and (PEER_DIR / f"{name}.yaml").is_file()


def flat_pricing_args(args: list[str]) -> list[str]:
    """A command line's pricing keys written flat (``policy.online_costs=false``, ``policy.cost_model=FILE``, as
    before the policies' ``pricing`` node) written as the node's (``policy.pricing.online_costs=false``)."""
    out = []
    for a in args:
        key, eq, value = a.partition("=")
        bare = key.lstrip("+~")
        if eq and bare.startswith("policy.") and bare[len("policy."):] in PRICING_KEYS:
            a = f"{key[: len(key) - len(bare)]}policy.pricing.{bare[len('policy.'):]}={value}"
        out.append(a)
    return out


def peer_alias(args: list[str]) -> list[str]:
    """scripts/evaluate.py's command line with the old spelling of a transformers peer (``policy=hf_heuristic``
    and its ``policy.KEY=VALUE``, from when the peers lived in conf/policy/) written as it is now
    (``peer=hf_heuristic``, ``peer.KEY=VALUE``): the commands of earlier results keep working. A sweep that mixes
    peers and policies (``policy=hf_heuristic,heuristic``) is refused in one line: they are two runs now."""
    chosen = [a.partition("=")[2] for a in args if a.partition("=")[0] == "policy"]
    names = [n for value in chosen for n in value.split(",")]
    peers = [n for n in names if _is_peer_name(n)]
    if not peers:
        return list(args)
    if len(peers) != len(names) or len(chosen) != 1:
        what = f"{peers[0]} is a peer" if len(peers) == 1 else f"{', '.join(peers)} are peers"
        raise ConfigError(f"policy={','.join(names)}: {what} (conf/peer/), not a policy of this engine: sweep the "
                          f"peers on their own (peer={','.join(peers)}) and the policies with policy=...")
    out = []
    for a in args:
        key, eq, value = a.partition("=")
        if eq and (key == "policy" or key.startswith("policy.")):
            a = "peer" + key[len("policy"):] + "=" + value
        out.append(a)
    return out
