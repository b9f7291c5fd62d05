"""The evaluation's unit: a question of the prompt set, decoded turn by turn by one runner.

A :class:`Question` is one of two kinds.

* **Fixed prompts** (``Question.prompts``): every turn's prompt ids are known before decoding. First turns
  (``data.turns=first``), and ShareGPT's later turns with ``data.turns=all``, whose history answers come
  from the data (each such prompt is a question of its own, ``ID@turnK``, as before).
* **Own answers** (``Question.messages``): MT-bench / Spec-Bench ``question.jsonl`` files (user turns
  only, no answers in the file) with ``data.turns=all``. Turn k is prompted with the chat template over
  ``[system?, user 1, assistant = the model's own answer 1, ..., user k]`` plus the generation prompt,
  as FastChat's ``gen_model_answer`` does: the answer is the decoded text of the runner's own tokens
  (EOS and special tokens left out). The speculative run and the AR reference each see their own
  answers; under greedy decoding those coincide, so every turn's output must equal AR's.

:meth:`Dialogue.run` decodes one question with one runner (``run(prompt, max_new_tokens, seed)``) and one
random stream for the whole conversation (a ``torch.Generator`` seeded once, passed to every turn), and
returns its :class:`Turn` records. A later turn whose prompt (history included) is longer than
``max_prompt_tokens`` or the target's context is not decoded, nor are the turns after it: they are
counted as dropped, like first turns that are too long (:func:`load_questions`).

:func:`question_rows` turns the timed runs into one record per question (tokens, seconds per turn,
accept lengths, for the speculative run and AR): the source of the per-category breakdown
(:func:`ldlp.bench.comparisons.categories.category_rows`) and of the answer files
(:mod:`ldlp.bench.comparisons.answers`).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

import torch

from eagle_backbone.metrics import GenerationStats
from ldlp.bench.harness.identity import GreedyReference

log = logging.getLogger(__name__)

MODES = ("prompts", "own_answers")


@dataclass
class Question:
    """One question: its id, category and first prompt, with either its fixed prompts or its messages."""

    id: str
    category: str | None
    first_ids: list[int]  # the first turn's prompt (warm-up, the AR baseline's calibration)
    prompts: list[tuple[str, list[int]]] | None = None  # fixed prompts: (prompt id, ids) per turn
    messages: list[dict] | None = None  # own answers: an optional system message, then the user turns

    @property
    def n_turns(self) -> int:
        if self.prompts is not None:
            return len(self.prompts)
        return sum(1 for m in self.messages if m["role"] == "user")


@dataclass
class Turn:
    """One decoded turn: its id (``ID`` or ``ID@turnK``), prompt, new tokens, their text and counters."""

    prompt_id: str
    prompt_ids: list[int]
    tokens: list[int]
    stats: GenerationStats
    text: str = ""


class QuestionSet(list):
    """``[Question, ...]`` plus ``info`` (the prompt set's identity and dropped prompts, as
    :class:`ldlp.bench.harness.loaders.PromptSet` has), ``mode`` (``prompts`` or ``own_answers``) and
    ``dropped_by_category`` (turns dropped at loading, per category)."""

    info: dict = {}
    mode: str = "prompts"
    dropped_by_category: dict = {}
    chat_template: str | None = None  # resolved (own answers: later turns are rendered with it)

    def first_prompts(self) -> list[tuple[str, list[int]]]:
        """``[(question id, first prompt ids), ...]``: what the AR calibration and the warm-up take."""
        return [(q.id, q.first_ids) for q in self]


def turn_id(question_id: str, k: int) -> str:
    return question_id if k == 0 else f"{question_id}@turn{k}"


def answer_text(tokenizer, tokens: list[int], eos_ids) -> str:
    """The decoded answer, as FastChat keeps it: EOS and special tokens left out, surrounding space stripped."""
    return tokenizer.decode([t for t in tokens if t not in eos_ids], skip_special_tokens=True).strip()


@dataclass
class Dialogue:
    """Decodes questions turn by turn (see the module docstring). ``max_length``: the target's context."""

    tokenizer: object
    chat_template: str | None  # resolved (None: the tokenizer's own)
    max_prompt_tokens: int | None
    max_length: int
    eos_ids: set = field(default_factory=set)
    device: object = "cpu"  # the target's: the random stream is drawn where the probabilities are

    def fits(self, ids: list[int]) -> bool:
        return (self.max_prompt_tokens is None or len(ids) <= self.max_prompt_tokens) and len(ids) < self.max_length

    def run(self, runner, q: Question, max_new_tokens: int, seed: int) -> list[Turn]:
        rng = torch.Generator(device=self.device).manual_seed(int(seed))  # one stream for the whole conversation
        turns = []
        if q.prompts is not None:
            for pid, ids in q.prompts:
                tokens, stats = runner.run(ids, max_new_tokens, rng)
                turns.append(Turn(pid, ids, tokens, stats, answer_text(self.tokenizer, tokens, self.eos_ids)))
            return turns
        from eagle_backbone.data.conversations import encode_chat

        history, k = [], 0
        for m in q.messages:
            history.append(m)
            if m["role"] != "user":
                continue
            ids = q.first_ids if k == 0 else encode_chat(self.tokenizer, history, add_generation_prompt=True,
                                                         chat_template=self.chat_template)
            if not self.fits(ids):
                break  # this turn and the later ones (longer still) are dropped
            tokens, stats = runner.run(ids, max_new_tokens, rng)
            text = answer_text(self.tokenizer, tokens, self.eos_ids)
            turns.append(Turn(turn_id(q.id, k), ids, tokens, stats, text))
            history.append({"role": "assistant", "content": text})
            k += 1
        return turns


# -- loading ---------------------------------------------------------------------------------------------------


_QUESTIONS: dict[str, QuestionSet] = {}


def load_questions(data_cfg, tokenizer) -> QuestionSet:
    """The questions of the prompt set ``data_cfg`` names, cached per process.

    ``data.turns=all`` on a file without any assistant turn (MT-bench / Spec-Bench ``question.jsonl``, a
    prompt list) gives own-answer questions; otherwise each prompt of
    :func:`ldlp.bench.harness.loaders.load_prompts` is a question with one fixed prompt (ShareGPT's ``turns=all``
    takes the history answers from the data, as before). Categories come from the file's ``category``."""
    from eagle_backbone.data.conversations import (
        ROLE_OF,
        encode_chat,
        conversations_of,
        resolve_chat_template,
        to_messages,
    )
    from ldlp.bench.harness.loaders import config_key, load_prompts, prompt_set_info

    key = config_key(data_cfg) + str(getattr(tokenizer, "name_or_path", id(tokenizer)))
    if key in _QUESTIONS:
        return _QUESTIONS[key]
    path = data_cfg.get("path")
    if not path:
        raise ValueError(f"data.path is empty (data={data_cfg.get('name')}); give a prompt file with data.path=FILE")
    turns = str(data_cfg.get("turns", "first"))
    conversations = conversations_of(data_cfg, path)
    category = {str(c["id"]): c.get("category") for c in conversations}
    own = turns == "all" and not any(ROLE_OF[t["from"]] == "assistant" for c in conversations for t in c["conversations"])
    dropped: dict = {}
    if not own:
        prompts = load_prompts(data_cfg, tokenizer)
        out = QuestionSet(Question(pid, category.get(pid.split("@turn")[0]), ids, prompts=[(pid, ids)])
                          for pid, ids in prompts)
        out.info = dict(getattr(prompts, "info", {}))
        for pid in getattr(prompts, "dropped", []):  # ids of the prompts dropped for length
            cat = category.get(str(pid).split("@turn")[0])
            dropped[cat] = dropped.get(cat, 0) + 1
    else:
        template = resolve_chat_template(tokenizer, data_cfg.get("chat_template"))
        max_tokens = data_cfg.get("max_prompt_tokens")
        out, n_dropped = QuestionSet(), 0
        for c in conversations:
            messages = to_messages(c["conversations"])
            system = [m for m in messages[:1] if m["role"] == "system"]
            users = [m for m in messages if m["role"] == "user"]
            try:
                first = encode_chat(tokenizer, system + users[:1], add_generation_prompt=True, chat_template=template)
            except Exception as e:  # jinja's TemplateError and friends: name the conversation
                raise ValueError(f"conversation {c['id']!r}: the chat template failed ({type(e).__name__}: {e})") from None
            if max_tokens is not None and len(first) > int(max_tokens):
                n_dropped += len(users)  # its later turns cannot be decoded either
                dropped[c.get("category")] = dropped.get(c.get("category"), 0) + len(users)
                continue
            out.append(Question(str(c["id"]), c.get("category"), first, messages=system + users))
        if n_dropped:
            log.warning("dropped %d turn(s) of questions whose first prompt is longer than max_prompt_tokens=%s",
                        n_dropped, max_tokens)
        if not out:
            raise ValueError(f"data.path={path}: no prompts (empty file or every conversation skipped)")
        out.info = prompt_set_info(data_cfg, n_dropped, getattr(conversations, "skipped", 0))
        out.chat_template = template
    out.mode = "own_answers" if own else "prompts"
    out.dropped_by_category = dropped
    _QUESTIONS[key] = out
    return out


# -- results per question and per category ----------------------------------------------------------------------


def _median_per_turn(runs: list[list[Turn]]) -> list[float]:
    """Seconds of each turn, the median over the rounds (rounds that decoded other turns left out)."""
    ref = runs[0]
    same = [r for r in runs if [t.prompt_id for t in r] == [t.prompt_id for t in ref]]
    return [statistics.median(r[j].stats.wall_s for r in same) for j in range(len(ref))]


def question_rows(questions: list[Question], spec_runs, ar_runs, check_lossless: bool, ref_runs=None) -> list[dict]:
    """One record per question from the timed runs (``spec_runs[r][k]``: the turns of question k in round
    r; ``ar_runs`` the same for AR): per turn the new tokens and the median seconds over the rounds, target
    forwards, Spec-Bench's accept lengths (tokens per verification step, the bonus token included), the
    decoded texts, turns dropped and whether every turn, speculative and AR, equals the reference's
    (``ref_runs``, default AR's; None unless ``check_lossless``)."""
    # per question, its turns' reference tokens
    reference = GreedyReference([[t.tokens for t in turns] for turns in (ref_runs or ar_runs)[0]])
    rows = []
    for k, q in enumerate(questions):
        spec = [run[k] for run in spec_runs]
        ar = [run[k] for run in ar_runs]
        row = {"question_id": q.id, "category": q.category, "n_turns": q.n_turns,
               "prompt_ids": [t.prompt_id for t in spec[0]],
               "turns": [t.text for t in spec[0]], "new_tokens": [t.stats.new_tokens for t in spec[0]],
               "wall_time": _median_per_turn(spec), "target_forwards": [t.stats.target_forwards for t in spec[0]],
               "accept_lengths": [a + 1 for t in spec[0] for a in t.stats.accept_lengths],
               "ar_turns": [t.text for t in ar[0]], "ar_new_tokens": [t.stats.new_tokens for t in ar[0]],
               "ar_wall_time": _median_per_turn(ar),
               "ar_accept_lengths": [1 for t in ar[0] for _ in range(max(0, t.stats.new_tokens - 1))],
               "n_dropped": q.n_turns - len(spec[0]),
               "lossless": all(reference.same([[t.tokens for t in spec[0]], [t.tokens for t in ar[0]]], [k, k]))
               if check_lossless else None}
        rows.append(row)
    return rows


def prompt_categories(data_cfg, prompt_ids: list[str]) -> list[str | None]:
    """The category of each prompt id (``ID`` or ``ID@turnK``) of the prompt set ``data_cfg`` names, from the
    file's ``category`` (None where a record has none): what the head to head groups its seconds by."""
    from eagle_backbone.data.conversations import conversations_of

    conversations = conversations_of(data_cfg)
    category = {str(c["id"]): c.get("category") for c in conversations}
    return [category.get(str(pid).split("@turn")[0]) for pid in prompt_ids]
