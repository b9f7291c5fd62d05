"""Contenders as one record (ldlp/bench/harness/contender.py): the string form and the structured node read by one
parser into the same ContenderSpec, bad ones refused in one line naming the contender and the key, this engine's
settings checked against the engine's own defaults, and the labels the pages show."""

from __future__ import annotations

import inspect

import pytest
from conftest import one_line
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from eagle_backbone.errors import ConfigError
from eagle_backbone.paths import CONF_DIR
from ldlp.bench.harness.contender import (
    ENGINE_DEFAULTS,
    ContenderSpec,
    PeerNode,
    PolicyNode,
    draft_cap,
    engine_defaults,
    engine_label,
    engine_settings,
    parse_contender,
    policy_label,
    render_value,
)

SAME = [
    ("policy=static policy.gamma=3", {"policy": {"name": "static", "gamma": 3}},
     ContenderSpec(PolicyNode("static", {"gamma": 3}))),
    ("policy=load_aware_step policy.goodput.enabled=false",
     {"policy": {"name": "load_aware_step", "goodput": {"enabled": False}}},
     ContenderSpec(PolicyNode("load_aware_step", {"goodput.enabled": False}))),
    ("prefill=joined policy=static policy.gamma=4", {"policy": {"name": "static", "gamma": 4},
                                                    "engine": {"prefill": "joined"}},
     ContenderSpec(PolicyNode("static", {"gamma": 4}), {"prefill": "joined"})),
    ("engine.prefill=joined policy=static policy.gamma=4", {"engine": {"prefill": "joined"},
                                                           "policy": {"name": "static", "gamma": 4}},
     ContenderSpec(PolicyNode("static", {"gamma": 4}), {"prefill": "joined"})),
    ("prefill=chunked max_batched_tokens=512", {"engine": {"prefill": "chunked", "max_batched_tokens": 512}},
     ContenderSpec(engine={"prefill": "chunked", "max_batched_tokens": 512})),
    # the pricing keys: one node now; written flat (as before it, and in earlier results' commands) they are its
    ("policy=load_aware policy.cost_model=/tmp/step_costs.json policy.online_costs=false",
     {"policy": {"name": "load_aware", "pricing": {"cost_model": "/tmp/step_costs.json", "online_costs": False}}},
     ContenderSpec(PolicyNode("load_aware", {"pricing.cost_model": "/tmp/step_costs.json",
                                             "pricing.online_costs": False}))),
    ("policy=load_aware_step policy.pricing.online_costs=false",
     {"policy": {"name": "load_aware_step", "online_costs": False}},
     ContenderSpec(PolicyNode("load_aware_step", {"pricing.online_costs": False}))),
    ("policy=heuristic", {"policy": "heuristic"}, ContenderSpec(PolicyNode("heuristic"))),
    ("engine=vllm", {"peer": {"engine": "vllm"}}, ContenderSpec(peer=PeerNode("vllm"))),
    ("engine=vllm spec.k=3", {"peer": {"engine": "vllm", "k": 3}}, ContenderSpec(peer=PeerNode("vllm", 3, "eagle"))),
    ("engine=vllm spec.method=eagle3 spec.k=6", {"peer": {"engine": "vllm", "method": "eagle3", "k": 6}},
     ContenderSpec(peer=PeerNode("vllm", 6, "eagle3"))),
]


@pytest.mark.parametrize("text, node, spec", SAME, ids=[s[0] for s in SAME])
def test_the_string_and_the_node_give_the_same_spec(text, node, spec):
    assert parse_contender(text) == spec
    assert parse_contender(node) == spec
    assert parse_contender(OmegaConf.create(node)) == spec  # as a Hydra list holds it
    assert str(parse_contender(text)) == text  # errors and the skipped list name it as it was written
    assert parse_contender(str(parse_contender(node))) == spec  # a node's string form reads back the same


def test_a_node_given_on_the_command_line_reads_as_its_string():
    """Hydra's override grammar gives a contenders list of nodes; the main command passes each one's string form."""
    from conftest import compose_config

    cfg = compose_config("bench_batch", ['contenders=[{policy:{name:static,gamma:3}},"policy=static policy.gamma=3",'
                                         '{peer:{engine:vllm,k:3}},{engine:{prefill:joined}}]'])
    specs = [parse_contender(c) for c in cfg.contenders]
    assert specs[0] == specs[1] and specs[2].peer == PeerNode("vllm", 3, "eagle")
    assert [str(s) for s in specs] == ["policy=static policy.gamma=3", "policy=static policy.gamma=3",
                                       "engine=vllm spec.k=3", "prefill=joined"]


def test_values_read_as_hydra_reads_them_and_write_back():
    spec = parse_contender("policy=ddd policy.threshold=-3.5 policy.max_gamma=null")
    assert spec.policy.settings == {"threshold": -3.5, "max_gamma": None}
    assert spec.policy_overrides() == ["policy=ddd", "policy.threshold=-3.5", "policy.max_gamma=null"]
    for v in ("a b", "3", "true", "${paths.cost}", "/tmp/x.json", "it's", 1e-5, True, None, [1, "x"], 0.1):
        from ldlp.bench.harness.contender import _override_value  # noqa: PLC0415  (the parser's own reader)

        assert _override_value(f"k={render_value(v)}", "t") == v, v


BAD = [
    ("policy=static policy.gama=3", "contender 'policy=static policy.gama=3': policy static has no key 'gama'"),
    ({"policy": {"name": "static", "gama": 3}}, "contender {'policy': {'name': 'static', 'gama': 3}}: policy static "
                                                "has no key 'gama'"),
    ("policy=static speed=1", "contender 'policy=static speed=1': unknown key 'speed'"),
    ("policy=nope", "contender 'policy=nope': policy=nope: there is no conf/policy/nope.yaml"),
    ("policy=ddd policy=static", "contender 'policy=ddd policy=static': give exactly one policy=NAME"),
    ("policy.gamma=3", "contender 'policy.gamma=3': policy.gamma is set but no policy=NAME is given"),
    ("static", "contender 'static': 'static' is not KEY=VALUE"),
    ("policy=static policy.gamma=1,2", "'policy.gamma=1,2' is a sweep"),
    ({"policy": {"gamma": 3}}, "policy needs a name"),
    ({"polcy": {"name": "static"}}, "unknown key 'polcy'"),
    ({"engine": {"prefil": "joined"}}, "unknown key 'engine.prefil'"),
    ({"peer": {"engine": "vllm", "kk": 3}}, "unknown key 'peer.kk'"),
    ({"peer": {"engine": "vllm", "k": 0}}, "peer.k must be an integer >= 1, got 0"),
    ({"peer": {"engine": "vllm", "k": 3}, "policy": "static"}, "a peer engine takes no policy"),
    ("engine=sglang", "contender 'engine=sglang': engine must be vllm"),
    ("engine=vllm spec.k=x", "spec.k must be an integer >= 1, got 'x'"),
    ("engine=vllm policy=static", "takes engine=vllm and optionally .* not policy"),
    (3, "a contender is a string"),
]


@pytest.mark.parametrize("node, why", BAD, ids=[str(b[0]) for b in BAD])
def test_a_bad_contender_is_one_line_naming_it_and_the_key(node, why):
    with pytest.raises(ConfigError, match=why.replace("{", "\\{").replace("}", "\\}").replace("(", "\\(")) as e:
        parse_contender(node)
    one_line(e)


def test_engine_settings_are_checked_against_the_engines_own_defaults():
    """One place sets them (eagle_backbone/prefill.py), the engine's constructor takes them from there, and a
    contender's settings are checked over them: no second copy to drift (conf/bench_batch.yaml's are null)."""
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine
    from conftest import compose_config

    params = inspect.signature(BatchedSpeculativeEngine.__init__).parameters
    assert ENGINE_DEFAULTS == {k: params[k].default for k in ENGINE_DEFAULTS}
    assert draft_cap(1000) == params["max_draft"].default and draft_cap(8) == 7
    config = OmegaConf.to_container(compose_config("bench_batch", []).engine)
    assert engine_defaults(config) == ENGINE_DEFAULTS  # the config leaves them to the engine
    assert engine_defaults({"prefill": "joined"}) == {**ENGINE_DEFAULTS, "prefill": "joined"}
    budget = parse_contender("max_batched_tokens=512")
    assert engine_settings(budget, engine_defaults({})) == {"prefill": "chunked", "max_batched_tokens": 512}
    with pytest.raises(ConfigError, match="contender 'max_batched_tokens=512': max_batched_tokens applies to "
                                          "prefill=chunked only, and this contender's prefill is joined") as e:
        engine_settings(budget, engine_defaults({"prefill": "joined"}))
    one_line(e)
    with pytest.raises(ConfigError, match="engine: unknown key 'prefil'"):
        engine_defaults({"prefil": "joined"})


def test_the_labels_on_the_pages_stay_as_they_were():
    """The labels bench_batch.py gives (as its pages and their tests show them), whichever form the contender has."""
    from ldlp.bench.harness.loaders import build_policy, policy_config
    from ldlp.bench.peers.vllm_peer import contender_label

    cfg = OmegaConf.create({})
    expected = [
        ("policy=static policy.gamma=3", "static γ=3"),
        ({"policy": {"name": "static", "gamma": 4}, "engine": {"prefill": "joined"}}, "static γ=4 prefill=joined"),
        ("policy=load_aware_step policy.goodput.enabled=false", "load_aware_step (no feedback)"),
        ({"policy": {"name": "load_aware_step", "goodput": {"prefill": "skip"}}},
         "load_aware_step (prefill steps skipped)"),
        ("policy=load_aware policy.online_costs=false", "load_aware (profiled table)"),
        ("policy=load_aware_step policy.cost_model=FILE", "load_aware_step (hindsight costs)"),
        ("policy=learned policy.recalibrate=false", "learned (profiled table) (not recalibrated)"),
        ("policy=learned policy.online_costs=true policy.recalibrate=true", "learned (recalibrated)"),
        ("policy=tree_budget", "tree_budget"),
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for node, label in expected:
            spec = parse_contender(node)
            name, pcfg = policy_config(cfg, spec)
            gamma = build_policy(pcfg).fixed_gamma if name == "static" else None
            assert engine_label(policy_label(name, pcfg, gamma), spec.engine) == label
    assert engine_label("ar", parse_contender("prefill=chunked max_batched_tokens=512").engine) == \
        "ar prefill=chunked max_batched_tokens=512"
    peer = parse_contender({"peer": {"engine": "vllm", "k": 3}}).peer
    assert contender_label(peer.k, peer.method, peer.schedule) == "vllm eagle k=3"


@pytest.mark.parametrize("config, key", [("bench_batch", "contenders"), ("compare", "contenders"),
                                         ("pipeline", "bench_batch.contenders")])
def test_the_shipped_contender_lists_are_nodes_that_read_as_their_strings(config, key):
    """conf/'s own contender lists are written as structured nodes, each the spec its string form gives (the form
    the command line and the pages' commands keep)."""
    from hydra import compose

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        listed = OmegaConf.select(compose(config), key)
    assert len(listed) >= 5
    for node in listed:
        assert OmegaConf.is_dict(node) and set(node) == {"policy"}, node
        spec = parse_contender(node)
        assert parse_contender(str(spec)) == spec and str(spec).startswith(f"policy={node.policy.name}")


# a script each, through its one-line error path (the parser's messages, the string form's included, are checked
# in process above: a subprocess costs ~10 s of CI a case)
@pytest.mark.parametrize("script, contenders, why", [
    ("compare.py", '[{policy:{name:static,gamma:3},engine:{prefill:joined}}]',
     "error: contender 'policy=static policy.gamma=3 prefill=joined': the head to head times policies of this engine"),
    ("bench_batch.py", '[{policy:{name:static,gamma:3}},{peer:{engine:vllm,k:0}}]',
     "error: contender {'peer': {'engine': 'vllm', 'k': 0}}: peer.k must be an integer >= 1, got 0"),
])
def test_the_scripts_refuse_a_bad_contender_in_one_line_before_loading(tmp_path, script, contenders, why):
    import subprocess
    import sys

    from eagle_backbone.paths import REPO_ROOT

    prompts = tmp_path / "question.jsonl"
    prompts.write_text('{"question_id": 0, "turns": ["Reverse a list."]}\n')
    cmd = [sys.executable, f"scripts/{script}", "data=mt_bench", f"data.path={prompts}", "threads=1",
           f"out_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'run'}", "model.target=/nonexistent",
           f"contenders={contenders}"]
    res = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    err = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 1 and err and err[-1].startswith(why), res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_the_main_command_sweeps_the_transformers_peers_on_their_own(tmp_path):
    """conf/peer/ holds transformers' assisted generation (not policies of this engine): the main command sweeps them
    as peer=NAME beside its peer policies, and a peer listed among peer.policies is refused in one line."""
    from conftest import compose_config

    from ldlp.pipeline import plan

    assert not list((CONF_DIR / "policy").glob("hf_*.yaml"))
    assert sorted(p.stem for p in (CONF_DIR / "peer").glob("*.yaml")) == ["hf_confidence", "hf_heuristic"]
    stages = {s.name: s for s in plan(compose_config("pipeline", [f"paths.outputs={tmp_path}"]))}
    assert "policy=heuristic,confidence" in stages["sweep:peer:1"].args
    assert "peer=hf_heuristic,hf_confidence" in stages["sweep:peer_hf:1"].args
    cfg = compose_config("pipeline", [f"paths.outputs={tmp_path}", "peer.policies=[hf_heuristic,heuristic]"])
    with pytest.raises(ConfigError, match=r"peer.policies holds 'hf_heuristic': a peer \(conf/peer/hf_heuristic.yaml\)"
                                          ", not a policy of this engine; list it in peer.peers") as e:
        plan(cfg)
    one_line(e)


def test_the_pricing_keys_are_one_node_and_flat_spellings_still_work(tmp_path):
    """The six pricing keys are one ``pricing`` node in the YAMLs and one argument of the policies; the command line's
    flat spellings (policy.online_costs=false, policy.cost_model=FILE, policy.cost_table=FILE) are the node's, and the
    records keep them flat (results' policy_config, the head to head's settings)."""
    from conftest import compose_config

    from ldlp.bench.harness.contender import flat_pricing_args
    from ldlp.policies.load_aware import LoadAwareStep
    from ldlp.policies.pricing import PRICING_KEYS, StepPricing, flat_pricing

    for name in ("load_aware", "load_aware_step", "tree_budget", "oracle_budget", "learned"):
        own = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "policy" / f"{name}.yaml"), resolve=False)
        assert set(own["pricing"]) <= set(PRICING_KEYS) and not set(own) & set(PRICING_KEYS), name
    args = flat_pricing_args(["e.py", "policy=load_aware", "policy.online_costs=false", "policy.cost_table=F",
                              "policy.max_gamma=4"])
    assert args == ["e.py", "policy=load_aware", "policy.pricing.online_costs=false", "policy.pricing.cost_table=F",
                    "policy.max_gamma=4"]
    cfg = compose_config("evaluate", args[1:] + [f"paths.cost={tmp_path}"])
    assert cfg.policy.pricing.online_costs is False and cfg.policy.pricing.cost_table == "F"
    assert flat_pricing({"path": "p", "pricing": {"cost_dir": "d", "online_costs": False}, "rule": "cost"}) == \
        {"path": "p", "cost_dir": "d", "online_costs": False, "rule": "cost"}
    policy = LoadAwareStep({"cost_dir": str(tmp_path), "model": "tiny", "online_costs": False}, max_gamma=3)
    assert isinstance(policy.pricing, StepPricing) and policy.pricing.online is False
    assert policy.pricing.cost_dir == str(tmp_path) and policy.pricing.model_name == "tiny"
    with pytest.raises(ValueError, match=r"^load_aware policy: pricing.cost_dri is not a pricing key \(cost_dir,"):
        LoadAwareStep({"cost_dri": str(tmp_path), "model": "tiny"})
