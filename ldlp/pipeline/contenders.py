"""The head to head's contenders, chosen from the sweeps' rows and the replay tuning: the main command's
``contenders`` stage (scripts/choose_contenders.py) writes them to ``contenders.json``, and the ``head_to_head``
stage (scripts/compare.py ``contenders_from=<contenders>/contenders.json``) times them. ``cfg`` here is either
config, the main command's (conf/pipeline.yaml) or the stage's (conf/choose_contenders.yaml): both have
``sweep.static_gammas``, ``sweep.adaptive``, ``head_to_head.adaptive`` and ``head_to_head.choose_by``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eagle_backbone.errors import ConfigError

CONTENDERS = "contenders.json"
log = logging.getLogger(__name__)


def shipped_unfit(policy: str, predictor_dir, target_dir) -> str | None:
    """Why a shipped policy cannot serve this pair (None: it can): ``learned`` needs its predictor folder and a
    target whose hidden size is the one the predictor reads (the shipped one is the embedded pair's)."""
    if policy != "learned":
        return None
    from ldlp.models.predictor import LDLPConfig

    path = Path(predictor_dir) / "config.json"
    if not path.is_file():
        return f"no predictor at {path.parent} (python scripts/train_step_ldlp.py builds one)"
    raw = json.loads(path.read_text())
    d = LDLPConfig.from_dict(raw, where=str(path)).feature_dim
    target = Path(str(target_dir)) / "config.json"
    if not target.is_file():
        return f"cannot check {path.parent} against the target: {target} is not a local file"
    hidden = json.loads(target.read_text()).get("hidden_size")
    return None if hidden == d else f"{path.parent} reads features of size {d}, this target's are {hidden}"


def tuned_best(tuned: Path | None, model_cfg=None) -> dict:
    """{policy: its best replay-tuned result} from a tuning.json ({} when no tuning ran). With ``model_cfg`` the
    file must have been tuned for that setup (its ``made_for``: ldlp.bench.harness.loaders.check_tuned), as compare.py
    checks it when it applies the settings: a choice made on another model's or dtype's tuning is refused here."""
    if tuned is None or not tuned.is_file():
        return {}
    from ldlp.bench.harness.loaders import check_tuned, run_setup
    from ldlp.bench.harness.replay import best_per_policy

    try:
        results = json.loads(tuned.read_text(encoding="utf-8"))["results"]
        best = best_per_policy(results)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"tuned_from={tuned}: not a tuning.json of scripts/tune_policies.py ({e!r})") from None
    if model_cfg is not None:
        check_tuned(tuned, run_setup(model_cfg))  # eagle_backbone.errors.Mismatch, one line naming both sides
    return best


def static_contenders(cfg, best_swept: int, tuned_best: dict) -> list[int]:
    """The static γ the head to head times: the sweep's best, and the replay tuning's best (the sweep's
    when no tuning ran) with both neighbours. A sweep of a few prompts picks its best noisily; the
    tuning's comes from exact counts and a cost model; between them the best static γ is in the race."""
    static = tuned_best.get("static")
    around = int(static["params"]["gamma"]) if static else best_swept
    wanted = {best_swept, around - 1, around, around + 1}
    return sorted(g for g in wanted if g in cfg.sweep.static_gammas)


def adaptive_contenders(cfg, name: str, summary: dict, tuned_best: dict) -> list[str]:
    """The adaptive policies the head to head times: the best of the replay tuning (chosen on the
    validation labels, so the test prompts judge them without a winner's curse) or of the sweep."""
    swept = [p for p in cfg.sweep.adaptive if p != "oracle"]
    if cfg.head_to_head.get("choose_by", "tuning") == "tuning" and tuned_best:
        ranked = sorted((r for p, r in tuned_best.items() if p in swept), key=lambda r: -r["tokens_per_s"])
    else:
        ranked = sorted((r for r in summary["rows"] if r["model"] == name and r["policy"] in swept
                         and r.get("speedup") is not None), key=lambda r: -r["speedup"])
    return list(dict.fromkeys(r["policy"] for r in ranked))[: int(cfg.head_to_head.adaptive)]


def choose(cfg, sweep_dirs, tuned_from: str | Path | None, name: str) -> dict:
    """The contenders of model ``name``: static γ around the best of the sweeps in ``sweep_dirs`` (their rows as
    the summary aggregates them) and the tuning's, the best adaptive policies, and the oracle when it was swept
    (the upper bound, timed in the same turns: headroom in paired numbers)."""
    from ldlp.report.summary import aggregate, find_results, headline

    rows = aggregate(find_results([str(d) for d in sweep_dirs]))
    head = headline(rows).get(name) or {}
    if "best_static" not in head or "best_adaptive" not in head:
        missing = "best static γ" if "best_static" not in head else "best adaptive policy"
        raise ConfigError(f"contenders: the sweeps have no {missing} of model {name} (a row with a speedup over AR) "
                          "to choose the head to head's contenders from; set head_to_head.enabled=false, or check "
                          "the sweeps' results.json")
    tuned = tuned_best(Path(tuned_from) if tuned_from else None, cfg.model)
    gammas = static_contenders(cfg, int(head["best_static"]["gamma"]), tuned)
    policies = adaptive_contenders(cfg, name, {"rows": rows}, tuned)
    shipped = []
    for p in cfg.head_to_head.get("shipped") or []:
        why = None if p in policies else shipped_unfit(p, cfg.get("predictor_dir"), cfg.model.target)
        if why:
            log.warning("head to head: the shipped policy %s is not timed: %s", p, why)
        elif p not in policies:
            shipped.append(p)
    from ldlp.bench.harness.contender import ContenderSpec, PolicyNode

    # written in the string form compare.py reads back (ldlp/bench/harness/contender.py): "policy=static policy.gamma=5"
    chosen = [PolicyNode("static", {"gamma": x}) for x in gammas] + [PolicyNode(p) for p in policies + shipped]
    if "oracle" in cfg.sweep.adaptive:
        chosen.append(PolicyNode("oracle"))
    contenders = [str(ContenderSpec(p)) for p in chosen]
    return {"model": name, "static_gammas": gammas, "adaptive": policies, "shipped": shipped, "contenders": contenders}

