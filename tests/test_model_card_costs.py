"""The model card's step costs (ldlp/bench/measurements/model_card.py): the EAGLE-3 entry times the EAGLE-3 head and the
EAGLE-1 drafter in one loop, and each c is its own model's step over the target's. A card once showed the two
equal to three decimals (c = 0.189 and 0.189: 1.837 and 1.835 ms, a coincidence of two models of nearly equal
work); this checks the two are measured apart: slowing one model moves its own c alone."""

from __future__ import annotations

import time

import torch
from conftest import make_drafter, make_eagle3, make_target

from ldlp.bench.measurements.model_card import eagle3_step_cost

torch.set_num_threads(1)
SLOW_S = 0.025  # far above a tiny model's step (under a millisecond idle, 6 ms seen on a loaded 2-core machine)


def _slowed(obj, name: str):
    """``obj`` whose method ``name`` first spins for SLOW_S (a sleep would let the clock drift with the scheduler)."""
    forward = getattr(obj, name)

    def slow(*args, **kwargs):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < SLOW_S:
            pass
        return forward(*args, **kwargs)

    setattr(obj, name, slow)
    return obj


def test_each_drafters_c_is_its_own_step_over_the_targets():
    target = make_target(seed=0, dtype=torch.float32, layers=3, vocab=64)
    prompt = list(range(3, 20))

    def costs(slow: str) -> dict:
        head = make_eagle3(target, layer_ids=(0, 1, 2))
        eagle1 = make_drafter(target, dtype=torch.float32)
        if slow == "eagle1":
            _slowed(eagle1, "forward")
        elif slow == "eagle3":
            _slowed(head, "mix")  # the head's input (token embedding and state): every drafting step runs it once
        return eagle3_step_cost(target, head, prompt, reps=15, eagle1=eagle1)

    e1_slow, e3_slow = costs("eagle1"), costs("eagle3")
    for c in (e1_slow, e3_slow):
        assert c["c_eagle3"] == c["eagle3_step_s"] / c["target_step_s"]
        assert c["c_eagle"] == c["eagle_step_s"] / c["target_step_s"]
    assert e1_slow["eagle_step_s"] >= SLOW_S > 2 * e1_slow["eagle3_step_s"]
    assert e3_slow["eagle3_step_s"] >= SLOW_S > 2 * e3_slow["eagle_step_s"]
    assert e1_slow["c_eagle"] > 2 * e1_slow["c_eagle3"] and e3_slow["c_eagle3"] > 2 * e3_slow["c_eagle"]


def test_the_card_prints_both_steps_and_their_ratio():
    """The card's EAGLE-3 line gives EAGLE-1's step beside EAGLE-3's and their ratio, so two c equal to three
    decimals read as two measurements, not one figure printed twice."""
    import json
    from pathlib import Path

    from ldlp.report.model_card import render_card

    card = json.loads((Path(__file__).parents[1] / "data" / "embedded" / "model_card.json").read_text())
    card["eagle3"]["costs"] = {"target_step_s": 0.010, "eagle3_step_s": 0.0025, "c_eagle3": 0.25,
                               "eagle_step_s": 0.0020, "c_eagle": 0.20}
    line = next(x for x in render_card(card).splitlines() if x.startswith("- EAGLE-3 head:"))
    assert "**c = 0.250**" in line and "2.000 ms, c = 0.200, the EAGLE-3 step 1.250× it" in line
