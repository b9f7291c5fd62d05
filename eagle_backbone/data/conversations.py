"""Conversations in ShareGPT layout: loading them from the usual files, and turning them into prompts.

Every loader returns ShareGPT dicts ``{"id", "conversations": [{"from", "value"}, ...]}`` (other
top-level keys of a ShareGPT record are kept). Accepted files (``fmt="auto"`` tells them apart):

* ShareGPT ``.json`` (an array of records) or ``.jsonl`` (one record a line), multi-turn, ``human`` /
  ``gpt`` turns and an optional leading ``system`` turn;
* MT-bench / Spec-Bench ``question.jsonl``: ``{"question_id", "turns": [str, ...]}``, each turn a user turn;
* plain prompts: ``.txt`` (one per non-empty line), a JSON array of strings, or ``.jsonl`` lines that
  are strings or ``{"prompt": ...}`` / ``{"text": ...}`` objects;
* the embedded corpus (ShareGPT ``.json``), once ``python scripts/build_corpus.py`` has built it (or
  through an explicit ``build_if_missing=True``: reading never builds it otherwise).

Files are parsed with :mod:`json` rather than ``datasets.load_dataset("json")`` so that a bad record is
reported with its file and line, and can be skipped (``on_error="skip"``) without losing the rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from pathlib import Path

from eagle_backbone.errors import MissingInput
from eagle_backbone.runtime import int_setting

log = logging.getLogger(__name__)

ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
           "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}
FORMATS = ("auto", "sharegpt", "mt_bench", "prompts")

# FastChat's vicuna_v1.1 layout with Vicuna's own system prompt, for tokenizers that ship no chat
# template (vicuna-7b-v1.3 does not): "{system} USER: {q} ASSISTANT: {a}</s>USER: ... ASSISTANT:".
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.")
NAMED_CHAT_TEMPLATES = {
    "vicuna_v1.1": (
        "{{ bos_token }}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{{ messages[0]['content'] + ' ' }}{%- set loop_messages = messages[1:] -%}"
        "{%- else -%}{{ '" + VICUNA_SYSTEM.replace("'", "\\'") + " ' }}{%- set loop_messages = messages -%}"
        "{%- endif -%}"
        "{%- for m in loop_messages -%}"
        "{%- if m['role'] == 'user' -%}{{ 'USER: ' + m['content'] + ' ' }}"
        "{%- else -%}{{ 'ASSISTANT: ' + m['content'] + eos_token }}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
    ),
}


class DataError(ValueError):
    """A malformed input record; the message names the file, the line and the problem."""


def to_messages(conversation: list[dict]) -> list[dict]:
    """ShareGPT turns (``from``/``value``) -> chat messages (``role``/``content``)."""
    return [{"role": ROLE_OF[t["from"]], "content": t["value"]} for t in conversation]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False, chat_template: str | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template)


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
                chat_template: str | None = None) -> list[int]:
    """Token ids of the rendered chat, where the template's own special tokens (BOS, EOS, ...) are special
    and the messages' text never is: a literal ``</s>`` or ``<s>`` in a message is encoded as the text it
    is (``split_special_tokens``), not as the EOS or BOS id.

    Messages without a special token's string are tokenized as the whole rendering (as before). Otherwise
    each special string in a message is hidden behind a placeholder while the template renders, the
    rendering is cut at the special tokens left (the template's), and the text between them, the
    messages' strings restored, is tokenized with ``split_special_tokens=True``: a tokenizer cuts its input
    at special tokens anyway, so the template's text tokenizes as it would have. (One exception: a
    Metaspace pre-tokenizer with ``prepend_scheme="first"`` prefixes every piece tokenized alone with a word
    boundary, which it does not do after a special token; byte-level BPE, the embedded tokenizer, and
    Llama-1/Vicuna's, which prefixes every piece anyway, are exact.)"""
    specials = sorted({str(s) for s in tokenizer.all_special_tokens if s}, key=len, reverse=True)
    if not any(s in str(m.get("content", "")) for m in messages for s in specials):
        text = render(tokenizer, messages, add_generation_prompt, chat_template)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    hidden: dict[str, str] = {}

    def hide(text: str) -> str:
        for s in specials:  # longest first: "</s>" before "<s>" would matter if one contained the other
            if s in text:
                text = text.replace(s, hidden.setdefault(s, f"\ue000{len(hidden)}\ue001"))
        return text

    rendered = render(tokenizer, [{**m, "content": hide(str(m.get("content", "")))} for m in messages],
                      add_generation_prompt, chat_template)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, specials)) + ")", rendered):
        if piece in specials:  # the template's own marker
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            for s, placeholder in hidden.items():
                piece = piece.replace(placeholder, s)
            ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


# ---- loading --------------------------------------------------------------------------------------


def _missing_embedded_corpus(path: Path, build_if_missing: bool) -> None:
    """The embedded corpus is generated (gitignored) by ``python scripts/build_corpus.py``. A reader of a
    missing corpus file builds it only when asked to (``build_if_missing``); otherwise it says how to."""
    from eagle_backbone.paths import EMBEDDED_DIR

    corpus_dir = EMBEDDED_DIR / "corpus"
    if path.exists() or path.parent.resolve() != corpus_dir.resolve():
        return
    if not build_if_missing:
        raise MissingInput(f"{path} does not exist: the embedded corpus is generated, build it first with "
                           "`python scripts/build_corpus.py` (deterministic, a few seconds), or set "
                           "data.build_if_missing=true")
    from eagle_backbone.data.corpus import write_corpus

    log.info("%s is missing: building the embedded corpus into %s (build_if_missing=True)", path, corpus_dir)
    write_corpus(corpus_dir)


def _check_turns(turns, where: str) -> list[dict]:
    if not isinstance(turns, list):
        raise DataError(f"{where}: 'conversations' must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise DataError(f"{where}: empty conversation")
    out = []
    for k, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise DataError(f"{where}: turn {k} must be an object with 'from' and 'value', got {str(t)[:80]!r}")
        role = str(t["from"]).lower()
        if role not in ROLE_OF:
            raise DataError(f"{where}: turn {k} has unknown role 'from': {t['from']!r} "
                            f"(expected one of {sorted(ROLE_OF)})")
        if not isinstance(t["value"], str):
            raise DataError(f"{where}: turn {k} 'value' must be a string, got {type(t['value']).__name__}")
        out.append({"from": role, "value": t["value"]})
    if not any(ROLE_OF[t["from"]] == "user" for t in out):
        raise DataError(f"{where}: conversation has no human turn, so no prompt can be built from it")
    return out


def _record(rec, fmt: str, where: str, default_id: str) -> dict:
    """One input record -> one ShareGPT dict (or DataError)."""
    if fmt == "auto":
        if isinstance(rec, str):
            fmt = "prompts"
        elif isinstance(rec, dict) and "conversations" in rec:
            fmt = "sharegpt"
        elif isinstance(rec, dict) and "turns" in rec:
            fmt = "mt_bench"
        elif isinstance(rec, dict) and ("prompt" in rec or "text" in rec):
            fmt = "prompts"
        else:
            keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise DataError(f"{where}: cannot tell the format of this record (keys {keys}); expected ShareGPT "
                            "'conversations', MT-bench 'turns', or a prompt string / 'prompt' / 'text'")
    if fmt == "sharegpt":
        if not isinstance(rec, dict) or "conversations" not in rec:
            raise DataError(f"{where}: ShareGPT record needs a 'conversations' key")
        out = {k: v for k, v in rec.items() if k != "conversations"}
        out["id"] = str(rec.get("id", default_id))
        out["conversations"] = _check_turns(rec["conversations"], where)
        return out
    if fmt == "mt_bench":
        if not isinstance(rec, dict) or "turns" not in rec:
            raise DataError(f"{where}: MT-bench record needs a 'turns' key")
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DataError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        return {"id": str(rec.get("question_id", default_id)), "category": rec.get("category"),
                "conversations": [{"from": "human", "value": t} for t in turns]}
    if fmt == "prompts":
        text = rec if isinstance(rec, str) else (rec.get("prompt", rec.get("text")) if isinstance(rec, dict) else None)
        if not isinstance(text, str):
            raise DataError(f"{where}: a prompt must be a string (or an object with a 'prompt' or 'text' string)")
        if not text.strip():
            raise DataError(f"{where}: empty prompt")
        rid = rec.get("id", default_id) if isinstance(rec, dict) else default_id
        return {"id": str(rid), "conversations": [{"from": "human", "value": text}]}
    raise ValueError(f"unknown data format {fmt!r}; expected one of {FORMATS}")


_WS = re.compile(r"[\s,]*")


def _json_array_records(text: str, path: Path):
    """(line, record) for each element of a top-level JSON array, decoded one element at a time so
    that each record's line is known."""
    decoder = json.JSONDecoder()
    i = _WS.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        raise DataError(f"{path}: expected a JSON array of records (or use .jsonl with one record per line)")
    i += 1
    line, last = 1, 0
    k = 0
    while True:
        i = _WS.match(text, i).end()
        if i >= len(text):
            raise DataError(f"{path}: the JSON array is not closed (file truncated?)")
        if text[i] == "]":
            return
        line += text.count("\n", last, i)
        last = i
        try:
            rec, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}:{e.colno}: invalid JSON in record {k} ({e.msg}); a broken JSON "
                            "array cannot be skipped past, fix the file or convert it to .jsonl") from None
        yield line, rec
        k += 1


def _raw_records(path: Path, fmt: str):
    """(where, default_id, record-or-DataError) for every record of the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte {e.start}: {e.reason}); convert it, e.g. iconv -f latin1 -t utf-8")\
            from None
    if not text.strip():
        raise DataError(f"{path}: the file is empty (no conversations)")
    stem = path.stem
    if path.suffix == ".txt" or (fmt == "prompts" and path.suffix not in (".json", ".jsonl")):
        for line_no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                yield f"{path}:{line_no}", f"{stem}:{line_no}", line.rstrip("\n")
        return
    if path.suffix == ".jsonl":
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                rec = DataError(f"{path}:{line_no}: invalid JSON ({e.msg} at column {e.colno})")
            yield f"{path}:{line_no}", f"{stem}:{line_no}", rec
        return
    for k, (line_no, rec) in enumerate(_json_array_records(text, path)):
        yield f"{path}:{line_no} (record {k})", f"{stem}:{k}", rec


class Conversations(list):
    """A list of ShareGPT conversations that also tells how many malformed records were ``skipped``."""

    skipped: int = 0


class Prompts(list):
    """A list of ``(conversation_id, prompt_ids)`` that also tells how many prompts were dropped as ``too_long``
    (and ``dropped``: their ids, ``conversation_id`` or ``conversation_id@turnK``)."""

    too_long: int = 0
    too_short: int = 0  # under min_prompt_tokens: left out by design (a long-prompt set), not lost
    dropped: list = []


def conversations_of(data_cfg, path=None) -> Conversations:
    """:func:`load_conversations` with a prompt-set config's keys (``conf/data``): ``path`` (or the one given),
    ``format``, ``on_error``, ``limit``, ``sample_seed`` and ``build_if_missing``."""
    return load_conversations(path if path is not None else data_cfg.get("path"), fmt=data_cfg.get("format", "auto"),
                              on_error=data_cfg.get("on_error", "raise"), limit=data_cfg.get("limit"),
                              sample_seed=data_cfg.get("sample_seed"),
                              build_if_missing=bool(data_cfg.get("build_if_missing", False)))


def load_conversations(path, fmt: str = "auto", on_error: str = "raise", limit: int | None = None,
                       sample_seed: int | None = None, build_if_missing: bool = False) -> Conversations:
    """Conversations from a ShareGPT / MT-bench / prompt-list file, in ShareGPT layout; the list's
    ``skipped`` is the number of malformed records skipped.

    ``on_error="raise"`` stops at the first malformed record with a message naming file and line;
    ``"skip"`` drops malformed records, counts them and logs the count (plus the first few reasons). A
    record whose id repeats an earlier one's is malformed: ids key the prompts, their categories, the answer
    files and the greedy identity check.
    ``limit`` keeps the first N valid conversations, or with ``sample_seed`` a seeded random sample of
    N (kept in file order). An empty file, or one without a single valid record, is always an error.
    A missing embedded-corpus file is built only with ``build_if_missing=True``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"data.format must be one of {FORMATS}, got {fmt!r}")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"data.on_error must be 'raise' or 'skip', got {on_error!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"data.limit must be null or an integer >= 1, got {limit!r}")
    path = Path(path)
    _missing_embedded_corpus(path, build_if_missing)
    if not path.is_file():
        raise MissingInput(f"data file {path} does not exist (data.path)")
    out, skipped, reasons = [], 0, []
    seen: dict[str, str] = {}  # id -> where it first appeared
    for where, default_id, rec in _raw_records(path, fmt):
        try:
            if isinstance(rec, DataError):
                raise rec
            conv = _record(rec, fmt, where, default_id)
            if conv["id"] in seen:  # ids key prompts, categories, answers and the identity check
                raise DataError(f"{where}: duplicate id {conv['id']!r} (first at {seen[conv['id']]}); give every "
                                "record its own id")
            seen[conv["id"]] = where
            out.append(conv)
        except DataError as e:
            if on_error == "raise":
                raise
            skipped += 1
            if len(reasons) < 3:
                reasons.append(str(e))
        if limit is not None and sample_seed is None and len(out) >= limit:
            break
    if skipped:
        log.warning("%s: skipped %d malformed record(s) (on_error=skip), e.g. %s", path, skipped, "; ".join(reasons))
    if not out:
        raise DataError(f"{path}: no valid conversations" + (f" ({skipped} malformed records skipped)" if skipped else ""))
    if limit is not None and sample_seed is not None and len(out) > limit:
        keep = sorted(random.Random(sample_seed).sample(range(len(out)), limit))
        out = [out[i] for i in keep]
    out = Conversations(out)
    out.skipped = skipped
    return out


def held_out(conversation_id: str, percent: float, seed: int = 0) -> bool:
    """Stable membership of a conversation in a held-out share (by a hash of its id)."""
    h = int(hashlib.sha256(f"{seed}:{conversation_id}".encode()).hexdigest(), 16) % 10_000
    return h < percent * 100


# ---- prompts ---------------------------------------------------------------------------------------


def resolve_chat_template(tokenizer, chat_template: str | None) -> str | None:
    """None: the tokenizer's own; a name in NAMED_CHAT_TEMPLATES; or a Jinja string."""
    if chat_template is None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template: set data.chat_template "
                             f"(one of {sorted(NAMED_CHAT_TEMPLATES)} or a Jinja string)")
        return None
    return NAMED_CHAT_TEMPLATES.get(chat_template, chat_template)


def build_prompts(tokenizer, conversations: list[dict], max_prompt_tokens: int | None, turns: str = "first",
                  chat_template: str | None = None, min_prompt_tokens: int | None = None) -> Prompts:
    """Token ids of the prompts in ``conversations``, ``[(conversation_id, prompt_ids), ...]``; the list's
    ``too_long`` is the number of prompts dropped for length.

    A prompt is the chat-template rendering of the dialogue up to a user turn (earlier assistant
    answers taken from the data) plus the generation prompt. ``turns="first"`` gives one prompt per
    conversation, ``"all"`` one per user turn; the ids of prompts after the first user turn get an
    ``@turnK`` suffix so every prompt has its own. A user turn with no data answer after it ends the
    dialogue for ``"all"`` beyond it (MT-bench's second turns need the model's own first answer, which
    is not in the file). Leading assistant turns (ShareGPT has some) are dropped. Prompts over
    ``max_prompt_tokens`` are dropped and counted, not left-truncated: cutting the front would cut the
    system prompt and the template's structure. Prompts under ``min_prompt_tokens`` (a long-prompt set) are
    dropped and counted as ``too_short``.
    """
    if turns not in ("first", "all"):
        raise ValueError(f"data.turns must be 'first' or 'all', got {turns!r}")
    for key, value in (("max_prompt_tokens", max_prompt_tokens), ("min_prompt_tokens", min_prompt_tokens)):
        if value is not None:  # null: no bound
            int_setting(f"data.{key}", value, 0)
    template = resolve_chat_template(tokenizer, chat_template)
    prompts, too_long, dropped, too_short = [], 0, [], 0
    for conv in conversations:
        messages = to_messages(conv["conversations"])
        system = [m for m in messages[:1] if m["role"] == "system"]
        rest = messages[len(system):]
        while rest and rest[0]["role"] != "user":
            rest = rest[1:]
        for k, m in enumerate(rest):
            if m["role"] != "user":
                continue
            if k > 0 and rest[k - 1]["role"] != "assistant":
                break  # no answer to the previous user turn in the data
            try:
                ids = encode_chat(tokenizer, system + rest[: k + 1], add_generation_prompt=True, chat_template=template)
            except Exception as e:  # jinja's TemplateError and friends: name the conversation
                raise ValueError(f"conversation {conv['id']!r}: the chat template failed ({type(e).__name__}: {e})") from None
            n_before = sum(1 for x in rest[:k] if x["role"] == "user")
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                too_long += 1
                dropped.append(conv["id"] if n_before == 0 else f"{conv['id']}@turn{n_before}")
                if turns == "all":
                    break  # later turns only grow
                continue
            if min_prompt_tokens is not None and len(ids) < min_prompt_tokens:
                too_short += 1  # a later turn may be long enough
            else:
                prompts.append((conv["id"] if n_before == 0 else f"{conv['id']}@turn{n_before}", ids))
            if turns == "first":
                break
    if too_long:
        log.warning("dropped %d prompt(s) longer than max_prompt_tokens=%s", too_long, max_prompt_tokens)
    if too_short:
        log.info("left out %d prompt(s) shorter than min_prompt_tokens=%s", too_short, min_prompt_tokens)
    prompts = Prompts(prompts)
    prompts.too_long, prompts.dropped, prompts.too_short = too_long, dropped, too_short
    return prompts
