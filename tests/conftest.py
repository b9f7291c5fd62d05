"""Tiny randomly initialised Llama targets and EAGLE drafters, built in float64 so that greedy ties
between one-token and many-token forwards cannot flip an argmax."""

import copy
import itertools
import json
import os
from pathlib import Path

# One thread per process, as the scripts' default threads=1: tiny models gain nothing from more, and on a
# busy 2-core machine OpenMP threads waiting on each other made tests up to ten times slower (test_sampling
# and test_policies: 634 s against 68 s). Set OMP_NUM_THREADS to choose otherwise; started scripts inherit it.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, os.environ.get("OMP_NUM_THREADS", "1"))

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from eagle_backbone.drafter import EagleDrafter  # noqa: E402
from eagle_backbone.eagle3 import Eagle3Drafter  # noqa: E402
from eagle_backbone.policy import TreePolicy  # noqa: E402
from eagle_backbone.target import TargetModel  # noqa: E402
from eagle_backbone.tree import MC_SIM_7B_63  # noqa: E402
from eagle_backbone.tree_draft import TreeSpec  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def tiny_llama_config(vocab=64, d=32, layers=2, max_pos=256, eos=2, **kw):
    return LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                       bos_token_id=1, eos_token_id=eos, pad_token_id=0, tie_word_embeddings=False, **kw)


def make_target(seed=0, dtype=torch.float64, **kw) -> TargetModel:
    torch.manual_seed(seed)
    cfg = tiny_llama_config(**kw)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(dtype)
    # sharpen the output distribution so greedy paths are not near-ties and drafts get accepted sometimes
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return TargetModel(model)


def make_drafter(target: TargetModel, seed=1, dtype=torch.float64) -> EagleDrafter:
    torch.manual_seed(seed)
    d = EagleDrafter.from_target_config(target.model.config)
    d.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data.float())
    return d.to(dtype).eval()


def step_ldlp(d: int, out: Path, k_max: int = 8, seed: int = 0) -> str:
    """A tiny untrained LDLP on every StepFeatures group (policy=learned reads one), saved to ``out``."""
    from ldlp.models.features import GROUPS, feature_names
    from ldlp.models.predictor import LDLP, LDLPConfig

    torch.manual_seed(seed)
    width = len(feature_names(GROUPS, d))
    config = LDLPConfig(input_dim=width, hidden_dim=8, k_max=k_max, head="distribution", inputs=list(GROUPS),
                        meta={"token_ratio": 0.4})
    return str(LDLP(config).save_pretrained(out))


def save_tiny_pair(root: Path, vocab: int, layers: int = 2, head_scale: float | None = 8.0) -> LlamaForCausalLM:
    """A tiny float32 Llama target (seed 0; its LM head scaled by ``head_scale`` so greedy paths are not
    near-ties) and its EAGLE drafter sharing the target's embedding, saved to ``root/{target,drafter}`` as
    the embedded pair is; returns the target."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config(vocab=vocab, d=32, layers=layers, max_pos=512, eos=2))
    if head_scale:
        with torch.no_grad():
            target.lm_head.weight.mul_(head_scale)
    target.save_pretrained(root / "target")
    drafter = EagleDrafter.from_target_config(target.config)
    drafter.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    drafter.save_pretrained(root / "drafter")
    return target


TINY_VOCAB = 4096  # the tiny saved pair's vocabulary: the embedded tokenizer's, so its prompts encode


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Llama target and its EAGLE drafter (:func:`save_tiny_pair`), a standalone draft LM (``draft_lm``), and
    ``noisy_lm``: the target with noise on its LM head, a draft LM the target accepts sometimes; saved like the
    embedded ones (the scripts' tests load them through :func:`pair_overrides`)."""
    root = tmp_path_factory.mktemp("models")
    target = save_tiny_pair(root, TINY_VOCAB)
    torch.manual_seed(2)
    LlamaForCausalLM(tiny_llama_config(vocab=TINY_VOCAB, d=32, layers=1, max_pos=512, eos=2)).save_pretrained(
        root / "draft_lm")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = target.lm_head.weight
        w.add_(0.6 * w.std() * torch.randn(w.shape, generator=g))
    target.save_pretrained(root / "noisy_lm")
    return root


def pair_overrides(models: Path, dtype: str = "float64", draft_lm: bool = False) -> list[str]:
    """The ``model.*`` overrides for a pair saved by :func:`save_tiny_pair` (with the embedded tokenizer)."""
    tokenizer = Path(__file__).resolve().parent.parent / "data" / "embedded" / "tokenizer"
    return [f"model.target={models / 'target'}", f"model.tokenizer={tokenizer}",
            f"model.drafter={models / ('draft_lm' if draft_lm else 'drafter')}",
            f"model.drafter_kind={'draft_lm' if draft_lm else 'eagle'}", f"model.name={'tiny_lm' if draft_lm else 'tiny'}",
            f"model.dtype={dtype}"]


def compose_config(name: str, overrides: list[str]):
    """The config ``scripts/<name>.py`` would compose under ``overrides`` (conf/ of this checkout)."""
    from hydra import compose, initialize_config_dir

    import eagle_backbone.paths  # noqa: F401  (registers ${repo:...})

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent.parent / "conf"), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def vllm_python() -> str | None:
    """The Python that has vLLM (ADAEAGLE_VLLM_PYTHON, or this interpreter), or None: the vLLM tests skip."""
    import sys

    from ldlp.bench.peers.vllm_peer import vllm_available

    py = os.environ.get("ADAEAGLE_VLLM_PYTHON") or sys.executable
    return py if vllm_available(py) else None


needs_vllm = pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (pip install -e '.[vllm]', or "
                                "set ADAEAGLE_VLLM_PYTHON to a Python that has it: docs/batched.md)")


def one_line(excinfo) -> str:
    """The message of a ``pytest.raises`` error, checked to be one line (what the scripts print)."""
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


def table_rows(md: str) -> list[str]:
    """The first cell of every body row of the Markdown tables in ``md`` (header and rule rows left
    out): what a test checks of a generated table (one row per contender) without pinning its layout."""
    lines = [line.strip() for line in md.splitlines() if line.strip().startswith("|")]
    is_rule = lambda line: set(line) <= set("|-: ")  # noqa: E731
    return [line.strip("|").split("|")[0].strip() for i, line in enumerate(lines)
            if not is_rule(line) and not (i + 1 < len(lines) and is_rule(lines[i + 1]))]


@pytest.fixture(scope="session")
def target():
    return make_target()


@pytest.fixture(scope="session")
def drafter(target):
    return make_drafter(target)


@pytest.fixture(scope="session")
def tiny_vocab_pair():
    """A 4-token target and an independent draft LM of the same size, no EOS: small enough to enumerate
    every sequence's exact probability (the sampling tests' chi-square)."""
    target = make_target(seed=11, vocab=4, d=16, layers=1, eos=None)
    draft = make_target(seed=12, vocab=4, d=16, layers=1, eos=None)
    target.eos_token_ids = draft.eos_token_ids = set()
    return target, draft


@pytest.fixture(scope="session")
def t32():
    """A tiny float32 target (the batched engine's tests: float32 makes batch identity exact)."""
    return make_target(dtype=torch.float32)


@pytest.fixture(scope="session")
def eagle32(t32):
    return make_drafter(t32, dtype=torch.float32)


@pytest.fixture(scope="session")
def embedded_corpus(tmp_path_factory) -> Path:
    """The embedded corpus ({train,validation,test}.json and manifest.json), built once per test run by its
    builder into a temporary folder: no test reads or writes data/embedded/corpus."""
    from eagle_backbone.data.corpus import write_corpus

    out = tmp_path_factory.mktemp("embedded_corpus")
    write_corpus(out)
    return out


@pytest.fixture(scope="module")
def mimic():
    """A target and a drafter that is mostly a copy of it (:func:`oracle_helpers.mimic_pair`)."""
    from oracle_helpers import mimic_pair

    return mimic_pair()


@pytest.fixture(scope="module")
def pair_and_ldlp():
    """:func:`oracle_helpers.mimic_pair_and_ldlp`: the mimic pair and a distribution LDLP on ``[e; f]`` for it (the
    learned policy's tests)."""
    from oracle_helpers import mimic_pair_and_ldlp

    return mimic_pair_and_ldlp()


# ---- prompts, reference decoding and draft LMs (the batched engine's tests) ---------------------------------


def prompts_of(lengths, seed=0, vocab=64):
    """One random prompt of each length in ``lengths`` (tokens 4..vocab-1)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


def random_prompts(n, seed=0, vocab=64):
    """``n`` random prompts of 3..11 tokens (the load sweep's tests)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 12, (n,), generator=g)]


def ar(target, prompts, n):
    """The target's own greedy decoding of each prompt, ``n`` new tokens."""
    from eagle_backbone.decoder import autoregressive_generate

    return [autoregressive_generate(target, p, n).tokens for p in prompts]


def noisy_copy(target, scale: float, seed: int = 3):
    """A draft LM that agrees with the target often but not always: noise on every weight."""
    torch.manual_seed(seed)
    m = copy.deepcopy(target.model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * p.std() * torch.randn_like(p))
    return m.eval()


def noisy_head_copy(target, scale: float = 0.6, seed: int = 0):
    """A draft LM that is the target plus noise on its LM head only (a generator of its own draws it; the other
    weights are the target's): it agrees with the target often, not always."""
    model = copy.deepcopy(target.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.lm_head.weight
        w.add_(scale * w.std() * torch.randn(w.shape, generator=g, dtype=w.dtype))
    return model


@pytest.fixture(scope="module")
def draft_lm(t32):
    return noisy_copy(t32, 0.3)


@pytest.fixture(scope="module")
def drafters(eagle32, draft_lm):
    """The float32 target's drafter of each kind the batched engine's chain and tree tests run: by kind name."""
    return {"eagle": eagle32, "draft_lm": draft_lm}


def table(target_per_token: float, draft: float, base: float = 10.0, key=None):
    """A synthetic cost table: the target costs ``base`` + ``target_per_token`` per scored token past the first
    a row; a draft depth ``draft`` ms whatever the rows."""
    from eagle_backbone.cost import CostTable

    slots, tokens = [1, 2, 4, 8, 16, 32], [1, 2, 3, 5, 9]
    return CostTable(key or {}, slots, tokens,
                     [[base + target_per_token * R * (t - 1) for t in tokens] for R in slots],
                     [draft] * len(slots), [[draft] * len(tokens) for _ in slots], [0.0] * len(slots))


def load_aware_policy(folder: Path, costs, mode: str = "marginal", **kw):
    """policy=load_aware (``mode`` "marginal") or its one-depth ablation ("step", policy=load_aware_step) under the
    cost table ``costs``, saved in ``folder`` and taken as given (online_costs=False: decisions under a set price),
    without exploration steps."""
    from ldlp.policies.load_aware import LoadAwareMarginal, LoadAwareStep

    p = folder / "cost.json"
    costs.save(p)
    cls = {"marginal": LoadAwareMarginal, "step": LoadAwareStep}[mode]
    return cls({"cost_dir": str(folder), "model": "tiny", "cost_table": str(p), "online_costs": False},
               explore_every=0, **kw)


# ---- exact distributions and chi-square tests (sampling is lossless) ---------------------------------------


def exact_sequence_distribution(target, prompt, length, cfg):
    """P(x_1..x_L | prompt) of the target itself, by enumerating every sequence (tiny vocabulary)."""
    from eagle_backbone import sampling as S

    V = target.vocab_size
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=length):
            logits, _ = target(torch.tensor([prompt + list(seq)]))
            p = 1.0
            for k, tok in enumerate(seq):
                p *= float(S.probs_from_logits(logits[0, len(prompt) - 1 + k], cfg)[tok])
            probs[seq] = p
    return probs


def chi2_pvalue(counts, probs, n):
    """Pearson chi-square of sequence ``counts`` (a dict) against ``probs``, every cell of positive probability
    its own; sampling a sequence of probability 0 fails."""
    from scipy.stats import chisquare

    assert all(counts.get(k, 0) == 0 for k in probs if probs[k] == 0), "sampled a sequence of probability 0"
    keys = sorted(k for k in probs if probs[k] > 0)
    total = sum(probs.values())
    expected = [probs[k] / total * n for k in keys]
    observed = [counts.get(k, 0) for k in keys]
    return chisquare(observed, expected).pvalue


# sampled sequences against the enumerated distribution (tiny_vocab_pair's targets): each sequence's first 3 tokens
TINY_PROMPT, SAMPLES = [1, 3], 1200
# small trees of a 4-token vocabulary: (shape, depth cap)
TINY_TREES = {"dyn2x2": (TreeSpec(2, 2), 2), "dyn2x3": (TreeSpec(2, 3), 3),
              "static": (TreeSpec.static([[0], [1], [0, 0], [0, 1], [1, 0]]), 2)}


def sampled_prefix_counts(target, drafter, kind, policy, cfg, capacity=16, n=SAMPLES, slots=600):
    """Counts of the first 3 tokens of ``n`` sequences sampled from :data:`TINY_PROMPT` and decoded 5 tokens deep (so
    that the first verification has a draft of full depth), one random stream (seed) per sequence, ``slots``
    sequences an engine of ``kind`` (``policy()`` each engine's policy); and the drafts accepted."""
    from eagle_backbone.batched_engine import BatchedSpeculativeEngine

    counts, accepted = {}, 0
    for start in range(0, n, slots):
        m = min(slots, n - start)
        engine = BatchedSpeculativeEngine(target, drafter, kind, slots=m, policy=policy(), sampling=cfg,
                                          capacity=capacity)
        for o in engine.generate([TINY_PROMPT] * m, 5, seeds=range(start, start + m)):
            key = tuple(o.tokens[:3])
            counts[key] = counts.get(key, 0) + 1
            accepted += o.stats.accepted_tokens
    return counts, accepted


def pooled_grid_chi2_pvalue(counts, probs, min_expected=5.0):
    """Pearson chi-square of ``counts`` against ``probs``, two tensors over the same grid of outcomes (every cell,
    probability 0 included), cells with expected counts under ``min_expected`` pooled into one (none when no cell
    is that small)."""
    from scipy.stats import chisquare

    n = counts.sum()
    exp = probs.flatten() * n
    obs = counts.flatten().double()
    small = exp < min_expected
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    return chisquare(obs.numpy(), exp.numpy()).pvalue


def pair_distribution(target, prompt, temperature):
    """Exact P(x1, x2) of the target's sampling, as a dict (x1, x2) -> probability."""
    from eagle_backbone.sampling import SamplingConfig, probs_from_logits

    cfg = SamplingConfig(temperature=temperature)
    with torch.no_grad():
        p1 = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1], cfg).double()
        exact = {}
        for x1 in torch.nonzero(p1 > 1e-9).flatten().tolist():
            p2 = probs_from_logits(target.model(torch.tensor([prompt + [x1]])).logits[0, -1], cfg).double()
            for x2 in torch.nonzero(p2 > 1e-9).flatten().tolist():
                exact[(x1, x2)] = float(p1[x1] * p2[x2])
    return exact


def pooled_chi2_pvalue(samples, exact, n):
    """Pearson chi-square of ``samples`` (a list) against ``exact``, cells with an expected count < 5 pooled."""
    from scipy.stats import chi2

    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    big = [k for k, v in exact.items() if v * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [exact[k] * n for k in big] + [n * (1 - sum(exact[k] for k in big))]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return float(chi2.sf(stat, len(obs) - 1))


# ---- EAGLE-3 heads -----------------------------------------------------------------------------------------

EAGLE3_VOCAB = 8  # a small vocabulary: random drafts are accepted now and then


def make_eagle3(target, seed=5, draft_vocab=None, layer_ids=(0, 1, 2), agree=True) -> Eagle3Drafter:
    """A random EAGLE-3 head for ``target``; ``agree``: its LM head and norm are the target's and fc passes the
    highest layer's state (on the 8-token target its drafts are then accepted now and then, so the tests reach
    accepted paths as well as rollback)."""
    torch.manual_seed(seed)
    d = Eagle3Drafter.from_target_config(target.model.config, draft_vocab_size=draft_vocab, layer_ids=layer_ids)
    d = d.to(target.dtype).eval()
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.embed_tokens.weight)
        if draft_vocab is not None:  # every other token, then the rest up to the size
            V = target.vocab_size
            ids = (list(range(0, V, 2)) + list(range(1, V, 2)))[:draft_vocab]
            d.set_vocab(torch.tensor(sorted(ids)))
        if agree:
            h = target.hidden_size
            d.fc.weight.mul_(0.1)[:, -h:] += torch.eye(h, dtype=d.fc.weight.dtype)
            d.midlayer.self_attn.o_proj.weight.mul_(0.1)
            d.midlayer.mlp.down_proj.weight.mul_(0.1)
            d.norm.weight.copy_(target.model.model.norm.weight)
            d.lm_head.weight.copy_(target.lm_head.weight[d.draft_to_target()])
    return d


@pytest.fixture(scope="module")
def t3():
    """A tiny float32 three-layer target of :data:`EAGLE3_VOCAB` tokens (an EAGLE-3 head reads three layers)."""
    return make_target(seed=0, dtype=torch.float32, layers=3, vocab=EAGLE3_VOCAB)


# ---- draft trees in the batched engine ---------------------------------------------------------------------

SMALL = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # a small static shape: siblings at depths 1 and 2
SPECS = {
    "dyn2x3": TreeSpec(2, 3),
    "dyn3x4": TreeSpec(3, 4),
    "static_small": TreeSpec.static(SMALL),
    "mc_sim_7b_63": TreeSpec.static(MC_SIM_7B_63),
}
TREE_PROMPTS = prompts_of((5, 12, 3, 8, 6, 1, 9))  # more prompts than slots: admissions join running tree steps
TREE_N = 20


class AnyTree(TreePolicy):
    """A tree policy: depth cap ``g`` for every row (or ``caps(slot)``), ``sel(grown, rows)`` the selection
    (default: every valid node); ``outcomes`` keeps what ``verified`` saw when ``record``."""

    name = "tree_test"

    def __init__(self, spec: TreeSpec, g: int = 8, sel=None, caps=None, record: bool = False):
        self.tree, self.g, self.sel, self.caps, self.record = spec, g, sel, caps, record
        self.outcomes = []

    def plan(self, rows):
        return [self.caps(b) if self.caps else self.g for b in rows.slots]

    def select(self, grown, rows):
        return grown.valid if self.sel is None else self.sel(grown, rows)

    def verified(self, outcome):
        if self.record:
            self.outcomes.append(outcome)


def counters(outputs):
    """Each output's accept and draft lengths and its counters: what two runs that should agree compare."""
    return [(o.stats.accept_lengths, o.stats.draft_lengths, o.stats.accepted_tokens, o.stats.drafted_tokens,
             o.stats.target_forwards, o.stats.new_tokens) for o in outputs]


def decode(engine, prompts=TREE_PROMPTS, concurrency=None, n=TREE_N, seeds=None):
    """The outputs of ``prompts`` run through ``engine`` at ``concurrency`` (default: its slots)."""
    from ldlp.bench.harness.workload import run_workload

    return run_workload(engine, prompts, concurrency or engine.slots, n, seeds).outputs


# ---- the oracle collector's inputs -------------------------------------------------------------------------


def save_tiny_target(root, layers: int):
    """A tiny BPE tokenizer (on :data:`oracle_helpers.CONVS` and ``VAL``) and a Llama target of ``layers`` layers
    with a sharpened head, saved in ``root / "target"`` like the embedded pair; returns the model."""
    from oracle_helpers import CONVS, VAL
    from transformers import LlamaForCausalLM

    from eagle_backbone.data.tokenizer import train_bpe_tokenizer

    texts = [t["value"] for c in CONVS + VAL for t in c["conversations"]] * 4 + ["A chat USER: ASSISTANT:"] * 4
    tok = train_bpe_tokenizer(texts, 300, root / "target")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab=len(tok), d=32, layers=layers, max_pos=512))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(root / "target")
    return model


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """A tiny tokenizer, target and EAGLE drafter saved like the embedded pair, and two data files
    (:data:`oracle_helpers.CONVS` and ``VAL``)."""
    from oracle_helpers import CONVS, VAL

    root = tmp_path_factory.mktemp("pair")
    model = save_tiny_target(root, layers=2)
    torch.manual_seed(1)
    EagleDrafter.from_target_config(model.config).save_pretrained(root / "drafter")
    (root / "train.json").write_text(json.dumps(CONVS))
    (root / "validation.json").write_text(json.dumps(VAL))
    return root


# ---- a finished run's results folder (publishing) ----------------------------------------------------------


def a_run(folder: Path, model: str = "m", tuning: bool = True, sweep_complete: bool | None = True) -> Path:
    """A results folder as one pipeline run leaves it: the pages, the tuning when ``tuning``, the load sweep
    (complete or not; none when ``sweep_complete`` is None) and the run manifest."""
    from ldlp.report.publish import write_run_manifest

    folder.mkdir(parents=True)
    (folder / "results.md").write_text("| policy |\n")
    (folder / "results.csv").write_text(f"model,policy\n{model},static\n")
    (folder / "tokens_per_s.png").write_bytes(b"png")
    (folder / "summary.json").write_text(json.dumps({"headline": {model: {}}, "rows": []}))
    if tuning:
        (folder / "tuning").mkdir()
        (folder / "tuning" / "tuning.md").write_text("tuning")
        (folder / "tuning" / "tuning.json").write_text("{}")
    if sweep_complete is not None:
        (folder / "load_sweep").mkdir()
        for f in ("batch_bench.md", "batch_bench.png"):
            (folder / "load_sweep" / f).write_text(f)
        (folder / "load_sweep" / "batch_bench.json").write_text(json.dumps([{"complete": sweep_complete}]))
        (folder / "load_sweep" / "batch_bench_runs.json").write_text(json.dumps({"meta": {"model": model}}))
    stages = ["corpus", "oracle"] + (["tune"] if tuning else []) + (["bench_batch"] if sweep_complete is not None
                                                                    else [])
    write_run_manifest(folder, model, stages, {s: 10.0 for s in stages})
    return folder
