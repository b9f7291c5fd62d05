"""notebooks/analysis.ipynb runs top to bottom on small synthetic data (sweep results, oracle labels,
a tiny target and LDLP), executed with nbclient."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
D, K_MAX, VOCAB = 16, 6, 64

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


def write_results(runs: Path) -> None:
    """results.json files as scripts/evaluate.py writes them: a static sweep, two adaptive policies, the oracle."""
    rows = [("static", g, 100 + 20 * g - 3 * g * g) for g in range(1, 7)] + [
        ("ldlp", None, 138.0), ("ddd", None, 131.0), ("oracle", None, 170.0)]
    for k, (policy, gamma, tps) in enumerate(rows):
        out = runs / str(k)
        out.mkdir(parents=True)
        result = {"policy": policy, "gamma": gamma, "dataset": "synthetic", "n_prompts": 4, "temperature": 0.0,
                  "new_tokens": 400, "wall_s": 400 / tps, "tokens_per_s": tps, "ar_tokens_per_s": 80.0,
                  "speedup": tps / 80.0, "tau": 2.5, "target_forwards": 160, "drafted_tokens": 300,
                  "wasted_tokens": 60, "draft_s": 1.0, "target_s": 2.0, "policy_s": 0.01, "lossless": True,
                  "model": "tiny", "drafter_kind": "eagle", "max_new_tokens": 100, "repeats": 1,
                  "policy_config": {"gamma": gamma} if gamma else {}, "machine": {"cpu": "test", "cpu_count": 1}}
        (out / "results.json").write_text(json.dumps(result))


def write_random_oracle(out_dir: Path, n_rows: int = 60) -> None:
    """A one-part oracle collection per split, in the collector's layout: one sequence of ``n_rows`` rows each,
    labels and features random (what the notebook reads, not what a predictor learns)."""
    from ldlp.labels.store import META_SUFFIX, ROWS_SUFFIX, SEQS_SUFFIX, rows_features, sequences_features, write_arrow

    rng = np.random.default_rng(0)
    for s, split in enumerate(("train", "validation")):
        part = out_dir / split / "w0.00000"
        part.parent.mkdir(parents=True)
        stats = rng.random((n_rows, K_MAX)).astype(np.float32)
        rows = {"seq_id": [s] * n_rows, "conversation_id": [f"c{s}"] * n_rows, "split": [split] * n_rows,
                "index": list(range(3, 3 + n_rows)), "last_token": rng.integers(3, VOCAB, n_rows).tolist(),
                "label": rng.integers(0, K_MAX + 1, n_rows).tolist(), "remaining": list(range(n_rows, 0, -1)),
                "draft_top1_prob": stats, "draft_entropy": stats, "target_prob": stats,
                "target_stats": rng.random((n_rows, 3)).astype(np.float32),
                "feature": rng.normal(size=(n_rows, D)).astype(np.float32)}
        write_arrow(Path(str(part) + ROWS_SUFFIX), rows, rows_features(K_MAX, D, "float32", "float32"))
        seqs = {"seq_id": [s], "conversation_id": [f"c{s}"], "split": [split],
                "input_ids": [rng.integers(3, VOCAB, n_rows + 4).tolist()], "prompt_len": [3], "positions": [n_rows],
                "eos": [False]}
        write_arrow(Path(str(part) + SEQS_SUFFIX), seqs, sequences_features())
        Path(str(part) + META_SUFFIX).write_text(json.dumps({"rows": n_rows}))
    (out_dir / "manifest.json").write_text(json.dumps({"k_max": K_MAX}))


def test_analysis_notebook_executes(tmp_path, monkeypatch):
    from conftest import tiny_llama_config
    from transformers import LlamaForCausalLM

    from ldlp.models.predictor import LDLP, LDLPConfig

    write_results(tmp_path / "runs")
    write_random_oracle(tmp_path / "oracle")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(vocab=VOCAB, d=D, layers=1)).save_pretrained(tmp_path / "target")
    LDLP(LDLPConfig(input_dim=2 * D, hidden_dim=8, k_max=K_MAX)).save_pretrained(tmp_path / "ldlp")
    for name, sub in (("RUNS", "runs"), ("ORACLE", "oracle"), ("LDLP", "ldlp"), ("TARGET", "target")):
        monkeypatch.setenv(f"ANALYSIS_{name}", str(tmp_path / sub))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")

    nb = nbformat.read(REPO / "notebooks" / "analysis.ipynb", as_version=4)
    # a last cell reports what the notebook computed, so the test checks numbers rather than its layout
    nb.cells.append(nbformat.v4.new_code_cell(
        "print(json.dumps({'rows': len(rows), 'best': headline(rows), 'labels': len(labels), 'counts': counts.tolist(),"
        " 'scored': len(pred) if 'pred' in globals() else None}, default=str))"))
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    seen = json.loads(code[-1]["outputs"][-1]["text"])
    assert seen["rows"] == 9  # every results.json of write_results
    best = seen["best"]["tiny"]
    assert best["best_static"]["gamma"] == 3 and best["best_adaptive"]["policy"] == "ldlp"  # 133 and 138 tokens/s
    assert seen["labels"] == 120 and sum(seen["counts"]) == 120 and len(seen["counts"]) == K_MAX + 1  # both splits
    assert seen["scored"] == 60  # the LDLP cell ran (not skipped) on the validation rows
