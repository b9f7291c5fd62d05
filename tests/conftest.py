"""Tiny randomly initialised Llama targets and EAGLE drafters, built in float64 so that greedy ties
between one-token and many-token forwards cannot flip an argmax."""

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
from eagle_backbone.target import TargetModel  # noqa: E402


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

    from ldlp.bench.vllm_peer import vllm_available

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
