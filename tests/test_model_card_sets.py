"""The model card's τ on each prompt set (ldlp/bench/measurements/model_card.py, ``only=eagle3_sets``): EAGLE-1's and
the EAGLE-3 head's τ come from the drafters' head to head run on the shipped folders, row for row, and a head to head
of other folders, or a card without an EAGLE-3 entry, is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ldlp.bench.measurements.model_card import update_eagle3_sets
from ldlp.report.model_card import render_card


def _result(root: Path, eagle3: Path) -> dict:
    """A bench_drafters result in small: two sets at T = 0 and 1, one set skipped."""
    rows = [{"set": s, "temperature": T, "n_prompts": 2, "drafter": "eagle3", "gamma": 6, "tau": tau, "reference_tau": 3.5,
             "ratio": tau / 3.5, "ci95": [tau / 3.5 - 0.1, tau / 3.5 + 0.1], "lossless": True if T == 0 else None}
            for s, T, tau in (("embedded_test", 0.0, 3.9), ("embedded_test", 1.0, 2.9), ("mt_bench", 0.0, 2.5),
                              ("mt_bench", 1.0, 2.4))]
    return {"drafters": {"eagle1": {"drafter": str(root / "drafter"), "drafter_kind": "eagle"},
                         "eagle3": {"drafter": str(eagle3), "drafter_kind": "eagle3"}},
            "reference": "eagle1", "tau_gamma": 6, "max_new_tokens": 64, "dtype": "float32", "summary": rows,
            "sets": {s: {"prompt_set": {"data_sha256": s * 2}} for s in ("embedded_test", "mt_bench")},
            "skipped": {"sharegpt": "x.json does not exist (prompt_sets.sharegpt.path)"}}


def test_the_cards_prompt_sets_are_the_head_to_heads_rows_and_other_folders_are_refused(tmp_path):
    shipped = json.loads((Path(__file__).parents[1] / "data" / "embedded" / "model_card.json").read_text())
    (tmp_path / "model_card.json").write_text(json.dumps(shipped))
    cfg = OmegaConf.create({"embedded_dir": str(tmp_path), "eagle3_sets": {"overrides": ["data.limit=2"]}})
    result = _result(tmp_path, tmp_path / "eagle3")

    card = update_eagle3_sets(cfg, lambda c: result)
    entry = json.loads((tmp_path / "model_card.json").read_text())["eagle3"]["prompt_sets"]
    assert entry == card["eagle3"]["prompt_sets"] and entry["rows"] == result["summary"]
    assert (entry["gamma"], entry["overrides"], entry["skipped"]) == (6, ["data.limit=2"], result["skipped"])
    assert entry["data_sha256"] == {"embedded_test": "embedded_testembedded_test", "mt_bench": "mt_benchmt_bench"}
    page = render_card(card).splitlines()
    assert "| mt_bench | 1 | 2 | eagle3 | 2.40 | 3.50 | 0.686 (0.586–0.786) |  |" in page
    assert sum(line.startswith("| embedded_test | ") or line.startswith("| mt_bench | ") for line in page) == 4
    assert f"- prompt set sharegpt skipped: {result['skipped']['sharegpt']}" in page

    other = _result(tmp_path, tmp_path / "outputs" / "eagle3_new")  # a head to head of another head
    with pytest.raises(ValueError, match=r"^only=eagle3_sets: the head to head measured .*eagle3_new") as err:
        update_eagle3_sets(cfg, lambda c: other)
    assert "\n" not in str(err.value)
    (tmp_path / "model_card.json").write_text(json.dumps({k: v for k, v in shipped.items() if k != "eagle3"}))
    with pytest.raises(ValueError, match=r"^only=eagle3_sets: .* has no EAGLE-3 entry") as err:
        update_eagle3_sets(cfg, lambda c: pytest.fail("measured before the card was checked"))
    assert "\n" not in str(err.value)
