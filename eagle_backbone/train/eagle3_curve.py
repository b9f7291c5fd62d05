"""The learning curve of an EAGLE-3 head while it trains: τ at a static chain γ on small prompt sets (in domain and
out of domain), greedy and sampled, every ``every`` steps, in the training process itself (one process, one
thread: no second job beside the training on a small machine).

τ is a count (new tokens over target forwards, prefill included, as everywhere here), so it is the same on a busy
machine. Sampled decodes draw with seed ``seed + prompt index``: a point differs from the next only by the
head's weights. The reference drafter (EAGLE-1 by default) is measured once on the same prompts, so every point
also has its ratio. Rows go to ``<ckpt_dir>/curve.jsonl``, one per (step, set, T); a resumed run skips the
steps already there.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L

log = logging.getLogger(__name__)


def curve_prompt_sets(sets: dict, tokenizer, limit: int, max_prompt_tokens: int) -> dict[str, list[list[int]]]:
    """{name: the first ``limit`` first-turn prompts} of each ``{name: file}`` (ShareGPT or MT-bench layout);
    a missing file is left out with one warning line."""
    from eagle_backbone.data.conversations import build_prompts, load_conversations

    out = {}
    for name, path in sets.items():
        if not Path(str(path)).is_file():
            log.warning("learning curve: prompt set %s skipped: %s does not exist", name, path)
            continue
        prompts = build_prompts(tokenizer, load_conversations(str(path), limit=None), max_prompt_tokens)
        out[name] = [list(ids) for _, ids in prompts[:limit]]
    return out


def measure_tau(target, drafter, kind: str, prompts: list[list[int]], gamma: int, temperature: float,
                max_new_tokens: int, seed: int) -> tuple[float, int, int]:
    """(τ, new tokens, target forwards) of a static chain γ over ``prompts``, sampled with seed + prompt index."""
    import torch

    from eagle_backbone.drafter_kinds import make_candidates
    from eagle_backbone.decoder import SpeculativeDecoder
    from eagle_backbone.policy import StaticPolicy
    from eagle_backbone.sampling import SamplingConfig

    was_training = drafter.training
    drafter.eval()
    try:
        with torch.no_grad():
            dec = SpeculativeDecoder(target, make_candidates(kind, drafter, target, "sdpa"), StaticPolicy(gamma))
            sampling = SamplingConfig(temperature=temperature)
            tokens = forwards = 0
            for k, ids in enumerate(prompts):
                st = dec.generate(ids, max_new_tokens, sampling=sampling, seed=seed + k).stats
                tokens, forwards = tokens + st.new_tokens, forwards + max(1, st.target_forwards)
    finally:
        drafter.train(was_training)
    return tokens / forwards, tokens, forwards


class LearningCurve(L.Callback):
    """τ of the training head every ``every`` steps (and at the start) on each prompt set at each temperature,
    beside a reference drafter's on the same prompts (module docstring)."""

    def __init__(self, path: str | Path, prompts: dict[str, list[list[int]]], every: int, gamma: int = 6,
                 temperatures=(0.0, 1.0), max_new_tokens: int = 64, seed: int = 0, tokens_per_step: int = 0,
                 reference: dict | None = None):
        if int(every) < 1:
            raise ValueError(f"drafter_training.curve.every must be an integer >= 1, got {every!r}")
        self.path, self.prompts, self.every, self.gamma = Path(path), prompts, int(every), int(gamma)
        self.temperatures = [float(t) for t in temperatures]
        self.n, self.seed, self.tokens_per_step, self.reference = int(max_new_tokens), int(seed), tokens_per_step, reference

    def _rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def _append(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def measure(self, target, drafter, step: int) -> None:
        import torch

        done = {(r["drafter"], r["step"], r["set"], r["temperature"]) for r in self._rows()}
        heads = [("head", step, drafter, "eagle3")]
        if self.reference:
            heads.insert(0, (self.reference["name"], None, self.reference["load"], self.reference["kind"]))
        for name, at, model, kind in heads:
            for set_name, prompts in self.prompts.items():
                for T in self.temperatures:
                    if (name, at, set_name, T) in done:
                        continue
                    if not isinstance(model, torch.nn.Module):  # the reference loads on first use
                        model = model(target)
                    tau, tokens, forwards = measure_tau(target, model, kind, prompts, self.gamma, T, self.n, self.seed)
                    self._append({"drafter": name, "step": at, "block_tokens": None if at is None else at * self.tokens_per_step,
                                  "set": set_name, "temperature": T, "gamma": self.gamma, "prompts": len(prompts),
                                  "max_new_tokens": self.n, "tau": tau, "new_tokens": tokens, "target_forwards": forwards})
                    log.info("learning curve: %s step %s %s T=%g τ %.3f", name, at, set_name, T, tau)

    def on_train_start(self, trainer, module):
        if trainer.is_global_zero and trainer.global_step % self.every == 0:
            self.measure(module.target, module.drafter, trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_global_zero and trainer.global_step % self.every == 0:
            self.measure(module.target, module.drafter, trainer.global_step)


def learning_curve(cfg, tokenizer, tokens_per_step: int, seed: int) -> LearningCurve | None:
    """The callback ``drafter_training.curve`` asks for (``every: null`` or no prompt set found: none)."""
    c = cfg.get("curve") or {}
    if not c.get("every"):
        return None
    prompts = curve_prompt_sets(dict(c.sets), tokenizer, int(c.prompts), int(c.get("max_prompt_tokens", 1024)))
    if not prompts:
        log.warning("learning curve: no prompt set found; no curve")
        return None
    reference = None
    if c.get("reference"):
        from eagle_backbone.loading import load_drafter

        ref = c.reference
        def load(target):
            from eagle_backbone.loading import tie_drafter_embedding

            model = load_drafter(str(ref.kind), str(ref.path), "float32")
            tie_drafter_embedding(model, target)
            return model

        reference = {"name": str(ref.name), "kind": str(ref.kind), "load": load}
    return LearningCurve(Path(cfg.ckpt_dir) / "curve.jsonl", prompts, int(c.every), int(c.get("gamma", 6)),
                         c.get("temperatures", (0.0, 1.0)), int(c.get("max_new_tokens", 64)), seed, tokens_per_step,
                         reference)
