"""Test helpers around the oracle: label a prompt's greedy response in one call, a drafter that agrees with its
target for a while, label rows compared, an oracle folder written in the collector's layout, and the
collector's tiny conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from conftest import make_drafter, make_target

from eagle_backbone.decoder import autoregressive_generate
from types import SimpleNamespace

from eagle_backbone.policy import DraftPolicy
from eagle_backbone.target import TargetModel
from ldlp.labels.oracle import oracle_labels


def greedy_oracle(target: TargetModel, drafter, prompt_ids, max_new_tokens: int, k_max: int,
                  **kw) -> tuple[list[int], dict]:
    """The target's greedy response to ``prompt_ids`` and its label rows (row ``i - len(prompt_ids)``
    is index ``i``; the engine's step with ``ctx.position = p`` is index ``len(prompt_ids) + p - 1``)."""
    prompt = list(prompt_ids)
    response = autoregressive_generate(target, prompt, max_new_tokens).tokens
    return response, oracle_labels(target, drafter, prompt + response, len(prompt), k_max, **kw)


def mimic_pair(seed=3, alpha=0.2):
    """A one-layer target and a drafter that is mostly a copy of it: drafts agree for a while, then
    diverge, so labels cover 0..k_max (a random drafter almost never agrees: labels all 0)."""
    target = make_target(seed=seed, layers=1)
    with torch.no_grad():  # unit-RMS embeddings make the target's input norm (which EAGLE drops) a no-op
        emb = target.embed_tokens.weight
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6))  # the padding row stays 0
    drafter = make_drafter(target)
    with torch.no_grad():
        d = drafter.hidden_size
        drafter.embed_tokens.weight.copy_(target.embed_tokens.weight)
        take_token = torch.zeros_like(drafter.fc.weight)
        take_token[:, :d] = torch.eye(d)
        drafter.fc.weight.mul_(alpha).add_((1 - alpha) * take_token)
        drafter.fc.bias.mul_(alpha)
        for name, value in target.model.model.layers[0].state_dict().items():
            if not name.startswith("input_layernorm"):
                drafter.layers[0].get_parameter(name).mul_(alpha).add_((1 - alpha) * value)
    return target, drafter



def mimic_pair_and_ldlp():
    """:func:`mimic_pair` and an LDLP with a distribution head on ``[e; f]`` for it, its outputs scaled so that the
    survival curves differ from row to row (a learned policy then chooses different γ)."""
    from ldlp.models.predictor import LDLP, LDLPConfig

    target, drafter = mimic_pair()
    torch.manual_seed(0)
    d = target.hidden_size
    ldlp = LDLP(LDLPConfig(input_dim=2 * d, hidden_dim=32, k_max=8, head="distribution", inputs=["ef"]))
    with torch.no_grad():
        ldlp.output.weight.mul_(20.0)
        ldlp.output.bias.add_(1.5)
    return target, drafter, ldlp.eval()

def assert_same_rows(a, b, atol=1e-6):
    """Two label-row dicts hold the same columns and values (NaNs in the same places)."""
    assert set(a) == set(b)
    for key in a:
        x, y = a[key], b[key]
        assert x.shape == y.shape, key
        if x.is_floating_point():
            assert torch.equal(x.isnan(), y.isnan()), key
            assert torch.allclose(x.double().nan_to_num(), y.double().nan_to_num(), atol=atol, rtol=0), key
        else:
            assert torch.equal(x, y), key


class LabelPolicy(DraftPolicy):
    """Drafts exactly the oracle label at each step and records what the engine showed it: per row, its
    ``position`` (tokens generated so far), ``last_token`` and ``feature``. ``label_at(position)``."""

    name = "labels"

    def __init__(self, label_at):
        self.label_at, self.seen = label_at, []

    def plan(self, rows):
        for i, p in enumerate(rows.positions):
            self.seen.append(SimpleNamespace(position=p, last_token=int(rows.last_tokens[i]),
                                             feature=rows.features[i].clone()))
        return [self.label_at(p) for p in rows.positions]


# the collector's data files (the ``pair_dirs`` fixture of tests/conftest.py writes them)
CONVS = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"What does function f{i} do?"},
                                           {"from": "gpt", "value": f"It returns {i} plus x."},
                                           {"from": "human", "value": "Show the code."}]} for i in range(7)]
VAL = [{"id": f"v{i}", "conversations": [{"from": "human", "value": f"Explain g{i}."}]} for i in range(3)]


def arrow_files(out_dir):
    """Every rows and sequences Arrow file of a collection, by relative path: its bytes."""
    files = sorted(Path(out_dir).glob("*/*.rows.arrow")) + sorted(Path(out_dir).glob("*/*.seqs.arrow"))
    return {str(p.relative_to(out_dir)): p.read_bytes() for p in files}


def prompts(n, seed=0):
    """``n`` random prompts of 1..5 tokens (tokens 4..63)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 64) for _ in range(rng.randrange(1, 6))] for _ in range(n)]


def write_collection(out: Path, target, drafter, train_prompts, val_prompts, store_states=True, k_max: int = 8,
                     budget: int = 36) -> Path:
    """An oracle folder in the collector's layout (ldlp.labels.store): one part per split, the label rows of
    each prompt's greedy response (``budget`` new tokens), drafter states flattened row-major."""
    from ldlp.labels.store import rows_features, sequences_features, write_arrow, write_json

    d = target.hidden_size
    feats = rows_features(k_max, d, "float32", "float32", state_dim=d if store_states else None)
    seq_id = 0
    for split, ps in (("train", train_prompts), ("validation", val_prompts)):
        rows = {c: [] for c in feats}
        seqs = {c: [] for c in sequences_features()}
        for p in ps:
            response, lab = greedy_oracle(target, drafter, p, budget, k_max)
            r = len(lab["label"])
            for c, v in (("seq_id", seq_id), ("conversation_id", f"{split}{seq_id}"), ("split", split)):
                rows[c] += [v] * r
            for c in rows.keys() - {"seq_id", "conversation_id", "split"}:
                rows[c].append(lab[c].flatten(1).float().numpy() if lab[c].is_floating_point() else lab[c].numpy())
            for c, v in (("seq_id", seq_id), ("conversation_id", f"{split}{seq_id}"), ("split", split),
                         ("input_ids", p + response), ("prompt_len", len(p)), ("positions", r),
                         ("eos", bool(response) and response[-1] in target.eos_token_ids)):
                seqs[c].append(v)
            seq_id += 1
        rows.update({c: np.concatenate(v) for c, v in rows.items() if c not in ("seq_id", "conversation_id", "split")})
        stem = out / split / "000-of-001.00000"
        stem.parent.mkdir(parents=True, exist_ok=True)
        write_arrow(Path(str(stem) + ".rows.arrow"), rows, feats)
        write_arrow(Path(str(stem) + ".seqs.arrow"), seqs, sequences_features())
        write_json(Path(str(stem) + ".json"), {"split": split, "positions": len(rows["label"])})
    write_json(out / "manifest.json", {"k_max": k_max, "max_new_tokens": budget})
    return out


def partial_collection(root: Path, planned: int, num_shards: int = 2) -> Path:
    """An oracle folder (drafter states stored) whose manifest plans ``planned`` sequences; 8 are on disk."""
    target, drafter = mimic_pair()
    oracle = write_collection(root / "oracle", target, drafter, prompts(6, seed=1), prompts(2, seed=2))
    for meta, n in ((oracle / "train" / "000-of-001.00000.json", 6), (oracle / "validation" / "000-of-001.00000.json", 2)):
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "sequences": n}))
    manifest = json.loads((oracle / "manifest.json").read_text())
    manifest.update(num_prompts=planned, config={"num_shards": num_shards})
    (oracle / "manifest.json").write_text(json.dumps(manifest))
    return oracle
