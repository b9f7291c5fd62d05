"""Replay beside a head to head (``scripts/replay_vs_measured.py``): each contender of a head to head replayed on
oracle labels of the same prompts, priced by each cost model, beside the ratio the head to head measured."""

from __future__ import annotations

from ldlp.bench.harness.replay import OracleRows, replay
from ldlp.policies.learned import LearnedPolicy, step_seconds_table


def replay_beside_measured(h2h: dict, rows: OracleRows, costs: dict, embed, vocab_size: int, learned_path: str,
                           k_max: int = 8) -> list[dict]:
    """Each contender of a head to head (``h2h``: its head_to_head.json) replayed on oracle rows of the same
    prompts, priced by each of ``costs`` ({label: cost table}), beside its measured ratio to the reference:
    where the modelled and the measured gain part, and whether the price or the policy explains it. Replay prices
    the steps alone; with the policy's own share of the measured seconds (``policy_share`` of the head to head)
    on top, ``{label}_with_policy`` is the ratio the measurement should give.

    Replayable: static γ, the oracle, ``learned`` and ``learned_in_step`` (the shipped predictor at
    ``learned_path``, deciding with each table's prices and learning the seconds a token is worth, and its
    corrections, as it does in the engine)."""
    from eagle_backbone.policy import StaticPolicy
    from ldlp.policies.in_step import InStepPolicy

    def policy_of(row, table):
        if row["policy"] == "static":
            return StaticPolicy(int(row["setting"]["gamma"]))
        if row["policy"] == "oracle":
            return "oracle"
        if row["policy"] == "learned":
            return LearnedPolicy(learned_path, max_gamma=int(row["setting"].get("max_gamma", k_max)),
                                 rule=row["setting"].get("rule", "cost"), seconds=step_seconds_table(table, k_max))
        if row["policy"] == "learned_in_step":
            return InStepPolicy(learned_path, max_gamma=int(row["setting"].get("max_gamma", k_max)),
                                seconds=step_seconds_table(table, k_max))
        return None

    out = []
    for row in h2h["rows"]:
        if row.get("policy") in (None, "ar"):  # the AR baseline
            continue
        measured = 1.0 if row["contender"] == h2h["reference"] else row["vs_best_static"]
        entry = {"contender": row["contender"], "measured": measured, "ci95": row.get("ci95"),
                 "tau_measured": row["tau"], "policy_share": row.get("policy_share")}
        for label, table in costs.items():
            p = policy_of(row, table)
            if p is None:
                continue
            r = replay(rows, p, table, embed, vocab_size, oracle_cap=k_max)
            entry[label] = r.tokens_per_s
            n = len(rows.sequences)  # the engine's τ counts each prompt's forward and its first token too
            entry["tau_replay"] = (r.new_tokens + n) / (r.steps + n)
        out.append(entry)
    ref = next(e for e in out if e["contender"] == h2h["reference"])
    for e in out:
        for label in costs:
            if label in e and label in ref:
                e[f"{label}_ratio"] = e[label] / ref[label]
                if e["policy_share"] is not None and ref["policy_share"] is not None:
                    # replay prices the steps; the policy's own measured share of the seconds comes on top
                    e[f"{label}_with_policy"] = e[f"{label}_ratio"] * (1 - e["policy_share"]) / (1 - ref["policy_share"])
    return out
