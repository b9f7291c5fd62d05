"""Host reads per step, for every policy YAML in conf/policy/: at most one in the engine's timed mode with the
stop codes kept on the device (as on a GPU), and one per draft depth more where the engine reads them to skip
stopped rows (``early_exit``, a CPU's default; a tree policy: one more, the selection's counts). A read is counted by hooks on ``Tensor.item``, ``tolist``,
``cpu`` and truthiness around each ``step()``; greedy outputs stay the target's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ar, compose_config, prompts_of, step_ldlp
from hydra.utils import instantiate

from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.cost import CostTable, cost_key
from eagle_backbone.batched_engine import BatchedSpeculativeEngine
from eagle_backbone.policy import TreePolicy

REPO = Path(__file__).resolve().parent.parent
POLICIES = sorted(p.stem for p in (REPO / "conf" / "policy").glob("*.yaml"))  # the peers are in conf/peer/


class ReadCounter:
    """Counts device-to-host reads while active: Tensor.item / tolist / cpu / __bool__."""

    NAMES = ("item", "tolist", "cpu", "__bool__")

    def __init__(self, monkeypatch):
        self.n, self.on = 0, False
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def counted(t, *a, _orig=orig, **k):
                if self.on:
                    self.n += 1
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def step(self, engine) -> int:
        self.n, self.on = 0, True
        try:
            engine.step()
        finally:
            self.on = False
        return self.n


@pytest.fixture(scope="module")
def artifacts(t32, tmp_path_factory):
    """Tiny checkpoints and a cost table for the policies that read one, sized for the conftest pair."""
    from ldlp.models.acceptance import AcceptanceHead, AcceptanceHeadConfig, DraftAcceptanceHead, DraftAcceptanceHeadConfig
    from ldlp.models.predictor import LDLP, LDLPConfig

    root = tmp_path_factory.mktemp("host_reads")
    d = t32.hidden_size
    torch.manual_seed(0)
    ldlp = LDLP(LDLPConfig(input_dim=2 * d, hidden_dim=8, k_max=6)).save_pretrained(root / "ldlp")
    survival = LDLP(LDLPConfig(input_dim=2 * d, hidden_dim=8, k_max=6, head="distribution")).save_pretrained(root / "surv")
    learned = step_ldlp(d, root / "learned", k_max=6)
    acc = AcceptanceHead(AcceptanceHeadConfig(hidden_size=d, k_max=6)).save_pretrained(root / "acc")
    DraftAcceptanceHead(DraftAcceptanceHeadConfig(hidden_size=d, temperature=0.0, k_max=6)).save_pretrained(root / "da" / "t0.0")
    key = cost_key("tiny", t32.dtype, t32.device, torch.get_num_threads())
    slots, tokens = [1, 2, 4, 8], [1, 2, 3, 5, 9]
    table = CostTable(key, slots, tokens, [[5.0 + 0.02 * R * (t - 1) for t in tokens] for R in slots],
                      [0.05] * len(slots), [[0.05] * len(tokens) for _ in slots], [0.0] * len(slots))
    table.save(root / "cost.json")
    return [f"ldlp_path={ldlp}", f"ldlp_survival_path={survival}", f"acceptance_path={acc}", f"learned_path={learned}",
            f"paths.draft_acceptance={root / 'da'}", f"paths.cost={root / 'cost'}", "model.name=tiny"], root / "cost.json"


def build(name: str, artifacts, t32, cand):
    overrides, table = artifacts
    cfg = compose_config("evaluate", [f"policy={name}", *overrides])
    if "pricing" in cfg.policy and "cost_table" in cfg.policy.pricing:
        cfg.policy.pricing.cost_table = str(table)
    if "explore_every" in cfg.policy:
        cfg.policy.explore_every = 0
    return instantiate(cfg.policy)


@pytest.mark.parametrize("early_exit", [False, True], ids=["codes_on_device", "early_exit"])
@pytest.mark.parametrize("name", POLICIES)
def test_host_reads_per_step(name, early_exit, artifacts, t32, eagle32, monkeypatch):
    cand = EagleCandidateGenerator(eagle32, t32)
    policy = build(name, artifacts, t32, cand)
    engine = BatchedSpeculativeEngine(t32, cand, slots=3, policy=policy, early_exit=early_exit)
    prompts = prompts_of((5, 9, 3, 7, 6), seed=4)
    counter = ReadCounter(monkeypatch)
    pending = list(enumerate(prompts))
    reads, drafted, outputs = [], 0, {}
    while pending or engine.busy():
        for b in engine.free_slots():
            if pending:
                i, p = pending.pop(0)
                engine.admit(b, p, 12, seed=i, request=i)
        reads.append(counter.step(engine))
        for s in engine.state:
            if s is not None and s.done and s.request not in outputs:
                outputs[s.request] = s.new
                drafted += s.stats.drafted_tokens
    policy = engine.policy
    cap = max(policy.max_gamma or 0, 8)
    if early_exit and policy.reads_drafts:
        assert max(reads) <= 1 + cap, (name, reads)
    elif early_exit and isinstance(policy, TreePolicy):  # the selection's counts, so that only selected nodes are scored
        assert max(reads) <= 2, (name, reads)
    else:
        assert max(reads) <= 1, (name, reads)
    assert drafted > 0  # it drafted, so the draft loop (and any stop codes) ran
    # greedy outputs are the target's own, whichever way the codes travel
    assert [outputs[i] for i in range(len(prompts))] == ar(t32, prompts, 12)


def test_codes_on_the_device_are_lossless(artifacts, t32, eagle32):
    """With the stop codes as device masks every row drafts to its cap and the target scores up to the caps;
    acceptance is bounded by the exact counts, so output and counters equal the early-exit engine's."""
    cand = EagleCandidateGenerator(eagle32, t32)
    prompts = prompts_of((5, 9, 3, 7), seed=6)
    got = {}
    for early in (False, True):
        policy = build("confidence", artifacts, t32, cand)
        policy.threshold = 0.08
        out = BatchedSpeculativeEngine(t32, cand, slots=4, policy=policy, early_exit=early).generate(prompts, 16)
        got[early] = [(o.tokens, o.stats.draft_lengths, o.stats.accept_lengths) for o in out]
        assert [o.tokens for o in out] == ar(t32, prompts, 16)
    assert got[False] == got[True]
    assert len({d for _, ds, _ in got[True] for d in ds}) > 1  # the rule stopped chains at several depths


def test_readme_policy_example_runs_with_one_host_read(t32, eagle32, monkeypatch):
    """README's "add a policy" example, as printed there: lossless in the engine, one read a step."""
    import re

    code = re.search(r"```python\n(import torch\nfrom eagle_backbone.policy import Depth.*?)```",
                     (REPO / "README.md").read_text(), re.S).group(1)
    space: dict = {}
    exec(compile(code, "README.md", "exec"), space)
    policy = space["TopTwoMargin"](margin=0.0)
    engine = BatchedSpeculativeEngine(t32, EagleCandidateGenerator(eagle32, t32), slots=2, policy=policy,
                                      early_exit=False)
    prompts = prompts_of((4, 7), seed=9)
    for b, p in enumerate(prompts):
        engine.admit(b, p, 10)
    counter = ReadCounter(monkeypatch)
    reads = []
    while engine.busy():
        reads.append(counter.step(engine))
    assert max(reads) == 1
    assert [engine.state[b].new for b in range(2)] == ar(t32, prompts, 10)
    assert engine.state[0].stats.drafted_tokens > 0
