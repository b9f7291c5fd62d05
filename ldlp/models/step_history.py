"""A predictor that reads the step history: a GRU over a sequence's last ``window`` step feature vectors.

The LDLP and the study's other models see one step's :func:`~ldlp.models.features.step_features` vector; the
``history`` group summarises earlier steps in six numbers (the last accepted lengths, their EMA). This model reads
the earlier steps' whole vectors instead: each of the last ``window`` steps (this one last) is standardised,
projected to ``hidden`` and fed to a GRU in step order; the GRU's last state gives continuation logits, and the
survival curve S_k = P(L >= k) is their cumulative product, as the LDLP's distribution head builds it
(:func:`~ldlp.models.predictor.survival_nll` trains both). A step with fewer predecessors is padded at the front
with zeros and a "present" flag of 0, so the GRU knows where the sequence began.

:class:`StreamingHistory` serves it one step at a time, as a policy asks: it keeps the last vectors and starts a
new history where the ``history`` group says a sequence has no step yet (batch-1 replay, the study's use).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class StepHistoryConfig:
    input_dim: int
    k_max: int
    window: int = 8  # steps read, this one included
    hidden: int = 64


class StepHistoryGRU(nn.Module):
    def __init__(self, config: StepHistoryConfig):
        super().__init__()
        self.config = c = config
        self.register_buffer("input_mean", torch.zeros(c.input_dim))
        self.register_buffer("input_std", torch.ones(c.input_dim))
        self.project = nn.Linear(c.input_dim + 1, c.hidden)  # + the "present" flag
        self.gru = nn.GRU(c.hidden, c.hidden, batch_first=True)
        self.output = nn.Linear(c.hidden, c.k_max)

    @torch.no_grad()
    def set_normalization(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.input_mean.copy_(mean)
        self.input_std.copy_(std.clamp_min(1e-6))

    def forward(self, xw: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """(B, W, F) windows (oldest first, padding rows anywhere ``present`` is 0) -> (B, k_max) continuation logits."""
        z = ((xw - self.input_mean) / self.input_std) * present[..., None]
        h = F.silu(self.project(torch.cat([z, present[..., None]], dim=-1)))
        _, last = self.gru(h)
        return self.output(last[-1])

    def survival_tensor(self, xw: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(F.logsigmoid(self(xw, present)), dim=-1).exp()


def windows(stream: np.ndarray, window: int) -> np.ndarray:
    """(n, window) indices of each example's last ``window`` examples of its own stream (this one last; -1 before
    the stream began). ``stream``: (n,) the stream of each example, its examples contiguous and in step order."""
    n = len(stream)
    start = np.r_[0, np.flatnonzero(stream[1:] != stream[:-1]) + 1]
    first = np.repeat(start, np.diff(np.r_[start, n]))  # each example's stream start
    idx = np.arange(n)[:, None] - np.arange(window - 1, -1, -1)[None, :]
    return np.where(idx >= first[:, None], idx, -1)


def gather(x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, W, F) windows and (B, W) present flags from (n, F) vectors and (B, W) indices (-1: absent)."""
    present = (idx >= 0).float()
    return x[idx.clamp_min(0)], present


class StreamingHistory:
    """One step at a time, as a policy asks (batch 1): ``survival(x)`` of (1, F) vectors, keeping the last
    ``window`` of them; a row whose ``steps_col`` value is 0 (no step yet in its sequence) starts a new history."""

    def __init__(self, model: StepHistoryGRU, steps_col: int):
        self.model, self.steps_col, self.past = model.eval(), steps_col, []

    def survival(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if len(x) != 1:
            raise ValueError(f"the step-history model serves one sequence at a time (batch 1), got {len(x)} rows")
        if x[0, self.steps_col] == 0:
            self.past = []
        W = self.model.config.window
        self.past = (self.past + [x[0]])[-W:]
        xw = np.zeros((1, W, x.shape[1]), dtype=np.float32)
        xw[0, W - len(self.past):] = np.stack(self.past)
        present = np.zeros((1, W), dtype=np.float32)
        present[0, W - len(self.past):] = 1
        with torch.no_grad():
            return self.model.survival_tensor(torch.from_numpy(xw), torch.from_numpy(present)).numpy()
