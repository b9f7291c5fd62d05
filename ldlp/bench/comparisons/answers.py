"""Answer files in the format FastChat's MT-bench judge and Spec-Bench's ``evaluation/speed.py`` read.

``answers/<model_id>.jsonl`` holds one JSON line per question::

    {"question_id": 81, "category": "writing", "answer_id": "...", "model_id": "tiny-static-g4",
     "choices": [{"index": 0, "turns": ["first answer", "second answer"], "new_tokens": [212, 180],
                  "wall_time": [1.93, 1.71], "accept_lengths": [3, 1, 4, ...]}],
     "tstamp": 1764567890.1}

``question_id`` is the file's own (an integer when it is one: FastChat's judge matches answers to
``question.jsonl`` by it); ``turns`` are the decoded answers (EOS and special tokens left out);
``new_tokens`` and ``wall_time`` are per turn, the seconds being the median over the evaluation's rounds
of that turn; ``accept_lengths`` are Spec-Bench's: the tokens each verification step emitted (accepted
drafts plus the target's own token), over all turns, the prefill's token not counted (1 per step for
the AR baseline). ``category`` is there because Spec-Bench's ``speed.py`` selects a task by it.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from eagle_backbone.io import atomic_write_text

ANSWER_KEYS = ("question_id", "category", "answer_id", "model_id", "choices", "tstamp")
CHOICE_KEYS = ("index", "turns", "new_tokens", "wall_time", "accept_lengths")


def model_id(model: str, policy: str, gamma: int | None = None) -> str:
    """``<model>-<policy>`` (``-g<γ>`` for a static γ), safe as a file name; ``<model>-ar`` for the baseline."""
    name = f"{model or 'model'}-{policy}" + ("" if gamma is None else f"-g{gamma}")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def _question_id(qid: str):
    return int(qid) if str(qid).isdigit() else qid


def answer_lines(rows: list[dict], mid: str, ar: bool = False, tstamp: float | None = None) -> list[dict]:
    """The answer lines of the speculative run (``ar=False``) or of the AR baseline, from
    :func:`ldlp.bench.comparisons.conversation.question_rows`."""
    tstamp = time.time() if tstamp is None else tstamp
    pre = "ar_" if ar else ""
    out = []
    for r in rows:
        out.append({"question_id": _question_id(r["question_id"]), "category": r["category"],
                    "answer_id": f"{mid}:{r['question_id']}", "model_id": mid,
                    "choices": [{"index": 0, "turns": list(r[f"{pre}turns"]), "new_tokens": list(r[f"{pre}new_tokens"]),
                                 "wall_time": [float(x) for x in r[f"{pre}wall_time"]],
                                 "accept_lengths": list(r[f"{pre}accept_lengths"])}],
                    "tstamp": tstamp})
    return out


def write_answers(rows: list[dict], out_dir: str | Path, spec_id: str, ar_id: str) -> dict:
    """``answers/<spec_id>.jsonl`` and ``answers/<ar_id>.jsonl`` under ``out_dir``; their paths by run."""
    folder = Path(out_dir) / "answers"
    folder.mkdir(parents=True, exist_ok=True)
    tstamp = time.time()
    paths = {}
    for kind, mid, ar in (("speculative", spec_id, False), ("ar", ar_id, True)):
        path = folder / f"{mid}.jsonl"
        atomic_write_text(path, "".join(json.dumps(line, ensure_ascii=False) + "\n"
                                        for line in answer_lines(rows, mid, ar, tstamp)))
        paths[kind] = str(path)
    return paths
