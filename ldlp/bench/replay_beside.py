"""Replay beside a head to head (``scripts/replay_vs_measured.py``): each contender of a head to head replayed on
oracle labels of the same prompts, priced by each cost model, beside the ratio the head to head measured."""

from __future__ import annotations

from ldlp.bench.replay import OracleRows, replay
from ldlp.policies.learned import LearnedPolicy, step_seconds_table


def replay_beside_measured(h2h: dict, rows: OracleRows, costs: dict, embed, vocab_size: int, learned_path: str,
                           k_max: int = 8) -> list[dict]:
    """Each contender of a head to head (``h2h``: its head_to_head.json) replayed on oracle rows of the same
    prompts, priced by each of ``costs`` ({label: cost table}), beside its measured ratio to the reference:
    where the modelled and the measured gain part, and whether the price or the policy explains it.

    Replayable: static γ, the oracle and ``learned`` (the shipped predictor at ``learned_path``, deciding with
    each table's prices and learning the seconds a token is worth as it does in the engine)."""
    from eagle_backbone.policy import StaticPolicy

    def policy_of(row, table):
        if row["policy"] == "static":
            return StaticPolicy(int(row["setting"]["gamma"]))
        if row["policy"] == "oracle":
            return "oracle"
        if row["policy"] == "learned":
            return LearnedPolicy(learned_path, max_gamma=int(row["setting"].get("max_gamma", k_max)),
                                 rule=row["setting"].get("rule", "cost"), seconds=step_seconds_table(table, k_max))
        return None

    out = []
    for row in h2h["rows"]:
        if row.get("policy") in (None, "ar"):  # the AR baseline
            continue
        measured = 1.0 if row["contender"] == h2h["reference"] else row["vs_best_static"]
        entry = {"contender": row["contender"], "measured": measured, "ci95": row.get("ci95"),
                 "tau_measured": row["tau"]}
        for label, table in costs.items():
            p = policy_of(row, table)
            if p is None:
                continue
            r = replay(rows, p, table, embed, vocab_size, oracle_cap=k_max)
            entry[label] = r.tokens_per_s
            entry["tau_replay"] = r.tau
        out.append(entry)
    ref = next(e for e in out if e["contender"] == h2h["reference"])
    for e in out:
        for label in costs:
            if label in e and label in ref:
                e[f"{label}_ratio"] = e[label] / ref[label]
    return out
