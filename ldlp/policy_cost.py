"""How long the LDLP takes next to a decoding step: it must stay a small fraction of one (target < 2%).

The decoding step measured here is a single-token target forward continuing a KV cache of
``context_len`` tokens: the cheapest part of a real step (which also drafts and verifies), so the ratio
is an upper bound on the LDLP's share.
"""

from __future__ import annotations

import torch

from eagle_backbone.runtime import Clock
from eagle_backbone.target import rollback
from eagle_backbone.timing import median_seconds


@torch.inference_mode()
def benchmark_ldlp(ldlp, target, context_len: int = 128, reps: int = 200, seed: int = 0) -> dict:
    """Median LDLP ``predict_length`` time (batch 1) and target step time, on the target's device."""
    device = target.device
    ldlp = ldlp.to(device)
    clock = Clock(device)
    g = torch.Generator().manual_seed(seed)
    context_len = max(1, min(context_len, target.max_length - 1))
    ids = torch.randint(3, target.vocab_size, (1, context_len + 1), generator=g).to(device)
    cache = target.new_cache()
    _, feats = target(ids[:, :context_len], cache)
    embedding, feature = target.embed(ids[0, context_len:])[0], feats[0, -1]

    def target_step():
        target(ids[:, context_len:], cache)
        rollback(cache, context_len)

    step_s = median_seconds(target_step, max(10, reps // 10), clock=clock)
    ldlp_s = median_seconds(lambda: ldlp.predict_length(embedding, feature), reps, clock=clock)
    return {"ldlp_us": ldlp_s * 1e6, "target_step_ms": step_s * 1e3, "ratio": ldlp_s / step_s,
            "context_len": context_len, "device": str(device), "threads": torch.get_num_threads()}
