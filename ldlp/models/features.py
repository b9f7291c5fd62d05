"""What the draft-length predictors read before a step, by group, each defined once and computed for a batch of
rows on the device (no host read: a policy that plans ahead sends its γ in the step's one read). The oracle
collector stores the values it needs, replay hands the stored values to the policies, and the engine's policies
compute them from the same tensors with the same functions (``tests/test_predictor_features.py`` checks that the
engine and replay record the same vectors):

* ``history``     the sequence's recent accepted lengths, their EMA, whether the last step kept every draft,
                  log(1 + steps) (:func:`history_features`);
* ``target``      the target's confidence at the last verified position (:func:`confidence`: top-1, top-1 minus
                  top-2, entropy; :attr:`~eagle_backbone.policy.Rows.target_stats`, free from the verify logits);
* ``draft_prev``  the drafter's top-1 probability at depths 1..3 of the previous step (-1 where it did not
                  draft that deep);
* ``position``    log(1 + tokens generated so far);
* ``ef``          AdaEAGLE's ``[e; f]``: the target embedding of the last token and the feature behind it.

:func:`step_features` assembles them in a given group order from :class:`~eagle_backbone.policy.Rows`.
"""

from __future__ import annotations

import torch

from eagle_backbone.sampling import confidence  # noqa: F401  (re-exported: the collector's and policies' one definition)

CONFIDENCE_NAMES = ("top1", "margin", "entropy")
HISTORY_STEPS = 3  # the last accepted lengths a feature vector holds
EMA_DECAY = 0.7  # weight of the past in the accepted-length EMA (a step's weight halves in about 2 steps)
HISTORY_NAMES = tuple(f"accepted_{j}" for j in range(1, HISTORY_STEPS + 1)) + ("accepted_ema", "last_full", "steps")


DRAFT_PREV_DEPTHS = 3
GROUP_NAMES = {
    "history": HISTORY_NAMES,
    "target": ("target_top1", "target_margin", "target_entropy"),
    "draft_prev": tuple(f"prev_draft_top1_{m}" for m in range(1, DRAFT_PREV_DEPTHS + 1)),
    "position": ("log_position",),
}
GROUPS = (*GROUP_NAMES, "ef")


def history_features(accepted: list[list[int]], drafted: list[list[int]], step_accepted=None, step_drafted=None,
                     device=None) -> torch.Tensor:
    """(R, 6) float32: per row, the last ``HISTORY_STEPS`` accepted lengths (most recent first, -1 where the
    sequence has fewer steps), their EMA (-1 before the first step), whether the last step kept every draft (its
    length is then censored by γ: the truth may be longer) and log(1 + steps).

    ``accepted``/``drafted``: each row's past steps on the host (oldest first); ``step_accepted``/``step_drafted``:
    a step verified but not yet read (device (R,), planning ahead) that comes after them. Either way the last step
    enters through the same device arithmetic, so both give the same bits."""
    R = len(accepted)
    if step_accepted is None:  # the last step is the lists' last entry
        has = [len(a) > 0 for a in accepted]
        a_t = torch.tensor([a[-1] if a else 0 for a in accepted], dtype=torch.float32, device=device)
        d_t = torch.tensor([d[-1] if d else 0 for d in drafted], dtype=torch.float32, device=device)
        past = [a[:-1] for a in accepted]
        has_t = torch.tensor(has, device=device)
    else:
        a_t, d_t = step_accepted.float(), step_drafted.float()
        device, past, has_t = a_t.device, accepted, torch.ones(R, dtype=torch.bool, device=a_t.device)
    ema_p = []
    for p in past:
        e = -1.0
        for a in p:
            e = float(a) if e < 0 else EMA_DECAY * e + (1 - EMA_DECAY) * a
        ema_p.append(e)
    host = torch.tensor([[p[-1] if p else -1, p[-2] if len(p) > 1 else -1, e, len(p)]
                         for p, e in zip(past, ema_p)], dtype=torch.float32, device=device).reshape(R, 4)
    none = torch.full_like(a_t, -1.0)
    last = torch.where(has_t, a_t, none)
    ema = torch.where(has_t, torch.where(host[:, 2] < 0, a_t, EMA_DECAY * host[:, 2] + (1 - EMA_DECAY) * a_t), none)
    full = (has_t & (a_t == d_t) & (d_t > 0)).float()
    steps = torch.log1p(host[:, 3] + has_t.float())
    return torch.stack([last, host[:, 0], host[:, 1], ema, full, steps], dim=-1)


def step_features(rows, groups, draft_prev: torch.Tensor | None = None) -> torch.Tensor:
    """(R, F) float32 on the rows' device: the groups' features of each row before its next step, in ``groups``
    order (``draft_prev``: (R, DRAFT_PREV_DEPTHS) from the policy, -1 where nothing was drafted)."""
    device = rows.features.device
    R = len(rows)
    parts = []
    for g in groups:
        if g == "history":
            parts.append(history_features(rows.accepted or [[] for _ in range(R)], rows.drafted or [[] for _ in range(R)],
                                          rows.step_accepted, rows.step_drafted, device))
        elif g == "target":
            parts.append(rows.target_stats.float())
        elif g == "draft_prev":
            parts.append(draft_prev if draft_prev is not None
                         else torch.full((R, DRAFT_PREV_DEPTHS), -1.0, device=device))
        elif g == "position":
            pos = torch.tensor(rows.positions, dtype=torch.float32, device=device)
            if rows.step_accepted is not None:  # the step's emitted tokens, not yet on the host
                pos = pos + rows.step_accepted.float() + 1
            parts.append(torch.log1p(pos)[:, None])
        elif g == "ef":
            parts.append(torch.cat([rows.embeddings.float(), rows.features.float()], dim=-1))
        else:
            raise ValueError(f"unknown feature group {g!r}; known: {list(GROUPS)}")
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def feature_names(groups, d: int | None = None) -> list[str]:
    """The column names of :func:`step_features` for ``groups`` (``d``: the target's hidden size, for ``ef``)."""
    out = []
    for g in groups:
        out += list(GROUP_NAMES[g]) if g != "ef" else [f"e{j}" for j in range(d or 0)] + [f"f{j}" for j in range(d or 0)]
    return out
