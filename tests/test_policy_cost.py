"""The LDLP's cost (ldlp/models/policy_cost.py): its forward timed against a target step in turns, under the
threads set, and a step far off the last one recorded for the same setting flagged."""

import itertools
import json

import pytest
import torch

from eagle_backbone.runtime import set_threads
from ldlp.models.policy_cost import HISTORY_FILE, benchmark_ldlp, check_step_cost
from ldlp.models.predictor import LDLP, LDLPConfig


def test_ldlp_benchmark_interleaves_respects_threads_and_flags_a_step_far_off(tmp_path, target, monkeypatch):
    ldlp = LDLP(LDLPConfig(input_dim=2 * target.hidden_size, hidden_dim=8)).double().eval()
    calls = []
    predict, forward = ldlp.predict_length, type(target).forward
    monkeypatch.setattr(ldlp, "predict_length", lambda *a: calls.append("ldlp") or predict(*a))
    monkeypatch.setattr(type(target), "forward", lambda self, *a, **k: calls.append("target") or forward(self, *a, **k))
    before = torch.get_num_threads()
    set_threads(1)
    try:
        t = benchmark_ldlp(ldlp, target, context_len=16, reps=20, history=tmp_path / HISTORY_FILE)
        assert torch.get_num_threads() == 1 and t["threads"] == 1  # the benchmark left the threads as set
    finally:
        torch.set_num_threads(before)
    timed = calls[calls.index("target", 1):]  # after the context's prefill
    assert t["interleaved"] and t["reps"] == 20 and timed.count("target") >= 20 and timed.count("ldlp") >= 20
    # every repetition has one of each: the two never run in long blocks of their own
    runs = max(len(list(g)) for _, g in itertools.groupby(timed))
    assert runs <= 2, timed[:40]
    assert t["flag"] is None and t["last_target_step_ms"] is None  # nothing measured before
    history = json.loads((tmp_path / HISTORY_FILE).read_text())
    [(setting, last)] = history.items()
    # a recorded step 10x faster than today's: flagged (metrics.json and metrics.md carry the flag)
    history[setting]["target_step_ms"] = t["target_step_ms"] / 10
    (tmp_path / HISTORY_FILE).write_text(json.dumps(history))
    checked = check_step_cost(tmp_path / HISTORY_FILE, t, setting)
    assert checked["flag"] and "more than 3x off" in checked["flag"] and checked["ratio_to_last"] == pytest.approx(10)
    assert check_step_cost(tmp_path / HISTORY_FILE, {**t, "target_step_ms": t["target_step_ms"] / 5}, setting)["flag"] is None
