"""Issue 13: silent wrong results and errors that were tracebacks. Each test fails on the code before its fix."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from conftest import make_target, tiny_llama_config
from eagle_backbone.paths import REPO_ROOT

EMBEDDED = REPO_ROOT / "data" / "embedded"


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


# -- 2. every loader fails on missing or unexpected keys ----------------------------------------------


def test_eagle_drafter_folder_loaded_as_draft_lm_fails_in_one_line():
    from eagle_backbone.loading import load_drafter

    with pytest.raises(ValueError) as e:
        load_drafter("draft_lm", EMBEDDED / "drafter")
    msg = _one_line(e)
    assert str(EMBEDDED / "drafter") in msg
    assert "lm_head.weight" in msg and "model.norm.weight" in msg and "fc.weight" in msg
    assert "drafter_kind=eagle" in msg


def _save_llama(path: Path, tie: bool = False, drop: str | None = None, add: str | None = None) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tied_config() if tie else tiny_llama_config())
    model.save_pretrained(path)
    if drop or add:
        state = load_file(str(path / "model.safetensors"))
        if drop:
            del state[drop]
        if add:
            state[add] = torch.zeros(3)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _tied_config():
    cfg = tiny_llama_config()
    cfg.tie_word_embeddings = True
    return cfg


def test_target_with_missing_or_unexpected_weights_is_refused(tmp_path):
    from eagle_backbone.target import TargetModel

    with pytest.raises(ValueError) as e:
        TargetModel.from_pretrained(_save_llama(tmp_path / "missing", drop="model.norm.weight"))
    assert "model.norm.weight" in _one_line(e) and "missing" in str(e.value)
    with pytest.raises(ValueError) as e:
        TargetModel.from_pretrained(_save_llama(tmp_path / "extra", add="extra.weight"))
    assert "extra.weight" in _one_line(e) and "unexpected" in str(e.value)
    # a tied output head is not missing: it is the embedding
    tied = TargetModel.from_pretrained(_save_llama(tmp_path / "tied", tie=True))
    assert tied.lm_head.weight.data_ptr() == tied.embed_tokens.weight.data_ptr()


def test_drafter_without_embedding_is_the_one_documented_exception(tmp_path, target, drafter):
    from eagle_backbone.candidates import EagleCandidateGenerator
    from eagle_backbone.drafter import EagleDrafter

    drafter.save_pretrained(tmp_path / "d")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    del state["embed_tokens.weight"]
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    loaded = EagleDrafter.from_pretrained(tmp_path / "d", dtype=torch.float64)
    assert loaded.has_own_embedding is False
    EagleCandidateGenerator(loaded, target)
    assert torch.equal(loaded.embed_tokens.weight, target.embed_tokens.weight)
    del state["fc.weight"]  # any other key missing is refused
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        EagleDrafter.from_pretrained(tmp_path / "d")


def test_heads_with_missing_or_unexpected_keys_are_refused(tmp_path):
    from ldlp.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from ldlp.predictor import LDLP, LDLPConfig

    LDLP(LDLPConfig(input_dim=8)).save_pretrained(tmp_path / "ldlp")
    AcceptanceHead(AcceptanceHeadConfig(hidden_size=4, k_max=8)).save_pretrained(tmp_path / "acc")
    for folder, cls in ((tmp_path / "ldlp", LDLP), (tmp_path / "acc", AcceptanceHead)):
        state = load_file(str(folder / "model.safetensors"))
        state["stray.weight"] = torch.zeros(2)
        state.pop(sorted(state)[0])
        save_file(state, str(folder / "model.safetensors"))
        with pytest.raises(ValueError) as e:
            cls.from_pretrained(folder)
        msg = _one_line(e)
        assert str(folder / "model.safetensors") in msg and "stray.weight" in msg and "missing keys" in msg


# -- 7. truncated or corrupt weight files: one line naming the file ------------------------------------


def _truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("kind", ["target", "drafter", "draft_lm", "ldlp", "acceptance"])
def test_truncated_weights_name_the_file(tmp_path, kind, drafter):
    from eagle_backbone.drafter import EagleDrafter
    from eagle_backbone.loading import load_drafter
    from eagle_backbone.target import TargetModel
    from ldlp.acceptance import AcceptanceHead, AcceptanceHeadConfig
    from ldlp.predictor import LDLP, LDLPConfig

    folder = tmp_path / kind
    if kind in ("target", "draft_lm"):
        _save_llama(folder)
        load = (lambda: TargetModel.from_pretrained(folder)) if kind == "target" else (
            lambda: load_drafter("draft_lm", folder))
    elif kind == "drafter":
        drafter.save_pretrained(folder)
        load = lambda: EagleDrafter.from_pretrained(folder)  # noqa: E731
    elif kind == "ldlp":
        LDLP(LDLPConfig(input_dim=8)).save_pretrained(folder)
        load = lambda: LDLP.from_pretrained(folder)  # noqa: E731
    else:
        AcceptanceHead(AcceptanceHeadConfig(hidden_size=4, k_max=8)).save_pretrained(folder)
        load = lambda: AcceptanceHead.from_pretrained(folder)  # noqa: E731
    _truncate(folder / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load()
    msg = _one_line(e)
    assert str(folder / "model.safetensors") in msg and "truncated or corrupt" in msg
