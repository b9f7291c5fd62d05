"""The learned draft length, revised while drafting by the drafter's own confidence (``policy=learned_in_step``).

AdaEAGLE's LDLP decides γ before drafting; SpecDec++'s acceptance head stops after each draft, reading what the
drafter has just produced. This policy does both with one rule, :func:`~ldlp.policies.learned.gamma_by_cost`'s:

* before drafting, the predictor's hazard logits ``z_j`` (depth j kept given the drafts before it were), corrected
  online as ``sigmoid(w z_j + c)`` (:class:`~ldlp.policies.learned.HazardCalibration`), give γ by the cost rule.
  γ = 0 drafts nothing; otherwise the step may draft up to ``max_gamma``;
* after the m-th draft, whose drafter probability is ``q_m``, the hazards of the depths drafted so far become
  ``sigmoid(w' z_j + c' + v logit q_j)`` (fitted online too), the later ones stay the prior's, and the step drafts
  on only while the best draft length by expected gain on the revised curve is beyond m.

Both corrections learn from every verified step (each drafted depth up to the first rejection tells whether it
was kept) and start at the weights fitted on held-out labels, ``in_step.json`` beside the predictor
(``scripts/fit_in_step.py``; without it, at the predictor as it is and no weight on the drafter). q is the
drafter's probability of the token it drafted (its top-1 at greedy), read from the chain's log-probability that
the engine keeps anyway.

It plans ahead as the learned policy does (its γ rides in the step's one host read): the hazard logits and the
drafts' probabilities of the step being observed are read with the step (``reads``), or, on the one-row host path,
wait per slot for its observation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from scipy.special import expit

from eagle_backbone.policy import GO, STOP, Depth, Rows
from eagle_backbone.runtime import to_device
from ldlp.models.calibration import EPS, OnlineLogitCalibration, hazard_logits
from ldlp.models.features import step_features
from ldlp.policies.learned import HazardCalibration, LearnedPolicy

IN_STEP_FILE = "in_step.json"  # beside the predictor: the corrections' starting weights (scripts/fit_in_step.py)


def read_start(path: str | Path | None) -> dict | None:
    """The starting weights in ``path``/in_step.json: ``{"prior": [w, c], "drafted": [w', c', v]}``, or None
    where there is none (the corrections then start at the predictor as it is)."""
    if path is None or not (Path(path) / IN_STEP_FILE).is_file():
        return None
    where = Path(path) / IN_STEP_FILE
    try:
        start = json.loads(where.read_text())
        prior, drafted = [float(v) for v in start["prior"]], [float(v) for v in start["drafted"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"learned_in_step: {where} is not an in-step start ({type(e).__name__}: {e}); rebuild it "
                         "with python scripts/fit_in_step.py") from None
    if len(prior) != 2 or len(drafted) != 3:
        raise ValueError(f"learned_in_step: {where}: prior needs 2 values (w, c) and drafted 3 (w, c, v), got "
                         f"{len(prior)} and {len(drafted)}")
    return {"prior": prior, "drafted": drafted}


def revised_hazards(xp, z, lq, depth: int, prior, drafted):
    """(R, K) hazards after ``depth`` drafts: depths ≤ ``depth`` revised by the drafter's logit probabilities
    ``lq`` (R, K; read up to ``depth``), later ones the prior's. ``xp``: numpy or torch (the host and device paths
    share this formula)."""
    a = prior[0] * z + prior[1]
    if depth:
        b = drafted[0] * z + drafted[1] + drafted[2] * lq
        seen = xp.arange(z.shape[-1]) < depth
        if xp is torch:
            seen = seen.to(z.device)
        a = xp.where(seen, b, a)
    return 1.0 / (1.0 + xp.exp(-a))


def best_length(hazards, W, c, token_s: float, low: int, cap: int):
    """(R,) the draft length in [low, cap] with the largest expected gain (the shortest among equals) on the
    survival curve of ``hazards``; ``(W, c)``: the rule's linear terms (:func:`~ldlp.policies.learned._step_terms`)."""
    both = hazards.cumprod(-1) @ W + c
    n = W.shape[1] // 2
    gain = both[:, :n] - both[:, n:] / token_s
    return gain[:, low: cap + 1].argmax(-1) + low


class InStepPolicy(LearnedPolicy):
    """:class:`~ldlp.policies.learned.LearnedPolicy` revised by each draft's probability (module docstring).
    ``start``: the starting weights (default: ``path``/in_step.json where it exists); ``decay``, ``prior``,
    ``update_every``: the online fits' (:class:`~ldlp.models.calibration.OnlineLogitCalibration`)."""

    name = "learned_in_step"
    reads_drafts = True

    def __init__(self, path: str | None = None, max_gamma: int = 8, token_ratio: float | None = None, pricing=None,
                 start: dict | None = None, decay: float = 0.98, prior: float = 4.0, update_every: int = 32, *,
                 predictor=None, groups=None, seconds=None, token_s: float | None = None):
        super().__init__(path=path, max_gamma=max_gamma, token_ratio=token_ratio, pricing=pricing, recalibrate=True,
                         predictor=predictor, groups=groups, seconds=seconds, token_s=token_s)
        if getattr(getattr(self.predictor, "config", None), "head", "distribution") != "distribution":
            raise ValueError("learned_in_step: the predictor needs the distribution head")
        start = start if start is not None else read_start(path)
        self.start = start
        self.reads_drafts = True
        self.calibration = HazardCalibration(decay, prior, update_every, start["prior"] if start else (1.0, 0.0))
        self.drafted_fit = OnlineLogitCalibration(decay=decay, prior=prior, evidence=1,
                                                  start=start["drafted"] if start else None)
        self.drafted_wc = tuple(float(v) for v in self.drafted_fit.params.numpy())  # on the host, as its inputs
        self._host = True  # this step's state is numpy (one row on a CPU) or torch (any other)
        self._z = self._lq = self._logp = None  # (R, K) hazard logits, (R, K) logit q by depth, (R,) chain log p
        self._cap = 0
        self._pending: dict[int, list] = {}  # host path: slot -> (z, lq) of its steps not yet observed

    def _hazard_logits(self, rows: Rows, K: int):
        """(R, K) the predictor's raw hazard logits: numpy for one row on a CPU reading [e; f] alone, else torch."""
        device = rows.features.device
        if (len(rows) == 1 and device.type == "cpu" and self.groups == ("ef",)
                and hasattr(self.predictor, "numpy_decoder")):
            net = self._decider().net
            return net.output(**net.ef_inputs(rows))[None, :K].astype(np.float64)
        x = step_features(rows, self.groups)
        S = self.predictor.survival_tensor(x) if hasattr(self.predictor, "survival_tensor") else \
            torch.as_tensor(self.predictor.survival(x.cpu().numpy()), device=device)
        return hazard_logits(S[:, :K])

    def plan(self, rows: Rows) -> torch.Tensor | list[int]:
        self._rows = len(rows)
        K = min(self.predictor.config.k_max if hasattr(self.predictor, "config") else self.max_gamma,
                self.seconds().shape[0] - 1)
        z = self._hazard_logits(rows, K)
        self._host = isinstance(z, np.ndarray)
        self._cap = cap = min(self.max_gamma, K, *(rows.caps[:1] if self._host and rows.caps else []))
        token_s = self.token_seconds()
        if self._host:  # one row: numpy on host floats from here to the step's end (a torch op costs ~10 µs)
            W, c = (t.numpy() for t in self._terms(K, torch.device("cpu"))[1])
            h = revised_hazards(np, z, None, 0, self.calibration.wc, self.drafted_wc)
            g = int(best_length(h, W, c, token_s, 0, cap)[0])
            self._z, self._lq, self._logp = z, np.zeros_like(z), [0.0]
            self._pending.setdefault(rows.slots[0], []).append((self._z, self._lq))  # filled while drafting
            self._step = (h[0], W, c, token_s)  # this step's prior hazards, the rule's terms and the token worth
            return [cap if g > 0 else 0]
        W, c = self._terms(K, z.device)[1]
        g = best_length(revised_hazards(torch, z, None, 0, self.calibration.wc, self.drafted_wc), W, c, token_s, 0, cap)
        # by engine slot: a plan made ahead serves the slot's next step, whose rows may be others
        n = max(rows.slots) + 1
        if self._z is None or isinstance(self._z, np.ndarray) or self._z.shape[0] < n or self._z.shape[1] != K:
            self._z = torch.zeros(n, K, dtype=torch.float64, device=z.device)
            self._lq, self._logp = torch.zeros_like(self._z), torch.zeros(n, dtype=torch.float64, device=z.device)
        at = to_device(rows.slots, z.device)
        self._z[at], self._lq[at], self._logp[at] = z, 0.0, 0.0
        caps = cap if rows.caps is None else to_device(rows.caps, z.device).clamp(max=cap)
        return torch.where(g > 0, caps, 0)

    def stop(self, d: Depth) -> torch.Tensor | list[int]:
        m = d.depth
        if self._host:
            lp = d.logp.item()
            q = min(max(math.exp(lp - self._logp[0]), EPS), 1 - EPS)
            lq = math.log(q) - math.log1p(-q)
            self._logp[0] = lp
            self._lq[0, m - 1] = lq
            if m >= self._cap:
                return [STOP]
            h, W, c, token_s = self._step
            w, b, v = self.drafted_wc
            h[m - 1] = 1.0 / (1.0 + math.exp(-(w * self._z[0, m - 1] + b + v * lq)))  # revised_hazards, one depth
            return [GO if int(best_length(h[None], W, c, token_s, m, self._cap)[0]) > m else STOP]
        at = d.slots
        lp = d.logp.double()
        q = torch.exp(lp - self._logp[at]).clamp(EPS, 1 - EPS)
        self._logp[at] = lp
        self._lq[at, m - 1] = torch.log(q) - torch.log1p(-q)
        z = self._z[at]
        h = revised_hazards(torch, z, self._lq[at], m, self.calibration.wc, self.drafted_wc)
        W, c = self._terms(z.shape[1], z.device)[1]
        k = best_length(h, W, c, self.token_seconds(), min(m, self._cap), self._cap)
        return torch.where(k > m, GO, STOP)

    def begin(self, slot: int, prompt_ids: list[int], max_new_tokens: int | None = None) -> None:
        super().begin(slot, prompt_ids, max_new_tokens)
        self._pending.pop(slot, None)  # a plan made ahead for the slot's finished sequence is never observed

    def reads(self) -> dict[str, torch.Tensor]:
        # copies: the buffers are planned into again (ahead) before the step's read
        return {} if self._host or self._z is None else {"in_step_z": self._z.clone(), "in_step_lq": self._lq.clone()}

    def observe(self, rows: Rows, drafted: list[int], accepted: list[int], extra: dict | None = None) -> None:
        # the observed step's own path: its reads if it ran on the device, else the host queue (the plan made ahead
        # for the next step may already have switched paths, when the step's rows changed in number)
        if extra and "in_step_z" in extra:
            z, lq = np.asarray(extra["in_step_z"])[rows.slots], np.asarray(extra["in_step_lq"])[rows.slots]
        else:
            queue = self._pending.get(rows.slots[0]) if len(rows) == 1 else None
            if not queue:
                return
            z, lq = queue.pop(0)
        for slot, row in zip(rows.slots, z):  # the step's hazards, read with it (not at plan: no read of its own)
            self.calibration.planned(slot, row)
        super().observe(rows, drafted, accepted, extra)  # the prior's correction and the seconds a token is worth
        for i, (d, a) in enumerate(zip(drafted, accepted)):
            n = min(d, a + 1, z.shape[1])  # depths reached: kept up to a, then one rejection
            kept = min(a, n)
            if n and self.drafted_fit.add(expit(z[i, :n]).tolist(), [1.0] * kept + [0.0] * (n - kept),
                                          self.calibration.update_every, torch.float64,
                                          evidence=lq[i, :n, None].tolist()):
                self.drafted_wc = tuple(float(v) for v in self.drafted_fit.params.numpy())

    def report(self) -> dict:
        return {**super().report(), "drafted": self.drafted_fit.state()}
