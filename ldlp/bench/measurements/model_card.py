"""Measure the embedded models into ``data/embedded/model_card.json`` (every figure from a run), from which
:mod:`ldlp.report.model_card` renders ``MODEL_CARD.md``.

Quality: validation loss/perplexity of the target and the draft LM against a unigram baseline, and
the drafter's teacher-forced top-1 agreement with the target. Cost: c = (one drafter step) / (one
target step), timed interleaved in one process. Decoding: AR tokens/s, and τ and speedup at static
γ = 1..6 on the test split, with the EAGLE drafter and with the draft LM. The EAGLE-3 head
(``data/embedded/eagle3``, when shipped) gets its own entry (:func:`eagle3_entry`: size, training, its
validation top-1 by depth, c on the engine's drafting path, and its static-γ rows); ``only=eagle3`` measures
that entry alone and merges it into the existing ``model_card.json``. Its τ beside EAGLE-1's on each prompt set (in
and out of domain, T = 0 and 1) comes from the drafters' head to head (:func:`eagle3_sets_entry`, ``only=eagle3_sets``).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
from collections import Counter
from pathlib import Path

import torch

from eagle_backbone.kinds.draft_lm import DraftModelCandidateGenerator
from eagle_backbone.kinds.eagle import EagleCandidateGenerator
from eagle_backbone.data.conversations import build_prompts, encode_chat, load_conversations, to_messages
from eagle_backbone.drafter import EagleDrafter
from eagle_backbone.decoder import autoregressive_generate
from eagle_backbone.io import atomic_write_json
from eagle_backbone.loading import load_tokenizer
from eagle_backbone.metrics import total
from eagle_backbone.policy import StaticPolicy
from eagle_backbone.runtime import Clock, set_threads
from eagle_backbone.target import TargetModel, rollback
from eagle_backbone.timing import interleaved
from ldlp.bench.harness.engines import EngineFactory
from ldlp.bench.harness.identity import GreedyReference


def _tokens(tokenizer, convs) -> list[int]:
    return [t for c in convs for t in encode_chat(tokenizer, to_messages(c["conversations"]))]  # user text stays text


def unigram_perplexity(train_ids: list[int], val_ids: list[int], vocab: int) -> float:
    """Add-one unigram model fitted on the train split: the floor any LM must clear."""
    counts, n = Counter(train_ids), len(train_ids)
    nll = -sum(math.log((counts[t] + 1) / (n + vocab)) for t in val_ids) / len(val_ids)
    return math.exp(nll)


@torch.inference_mode()
def lm_validation_loss(model, blocks, batch_size: int = 8, max_blocks: int = 64) -> float:
    losses = []
    for i in range(0, min(len(blocks), max_blocks), batch_size):
        x = blocks[i:i + batch_size]["input_ids"]
        losses.append(float(model(input_ids=x, labels=x).loss) * len(x))
    return sum(losses) / min(len(blocks), max_blocks)


@torch.inference_mode()
def drafter_top1(target: TargetModel, drafter: EagleDrafter, blocks, max_blocks: int = 64) -> float:
    """Teacher-forced next-token agreement: argmax(lm_head(f̂_{j+1})) == argmax(target logits_{j+1})."""
    hits = n = 0
    for i in range(min(len(blocks), max_blocks)):
        x = blocks[i]["input_ids"][None]
        logits, feats = target(x)
        pred = drafter(x[:, 1:], feats[:, :-1].to(next(drafter.parameters()).dtype))
        draft = target.lm_head(pred.to(target.dtype)).argmax(-1)
        hits += int((draft == logits[:, 1:].argmax(-1)).sum())
        n += draft.numel()
    return hits / n


@torch.inference_mode()
def step_costs(target: TargetModel, drafter: EagleDrafter, draft_lm, prompt: list[int], reps: int = 200) -> dict:
    """Median seconds of one decoding step of each model at the same context, interleaved."""
    ids = torch.tensor([prompt])
    t_cache, d_cache = target.new_cache(), drafter.new_cache()
    _, feats = target(ids, t_cache)
    h = drafter(ids[:, 1:], feats[:, :-1], d_cache)
    from eagle_backbone.target import new_cache

    lm_cache = new_cache(draft_lm)
    draft_lm(input_ids=ids, cache=lm_cache, use_cache=True)
    n, tok = ids.shape[1], ids[:, -1:]
    clock = Clock()
    steps = {  # one step of each model, and the cache length it goes back to (not timed)
        "target": (lambda: target(tok, t_cache), t_cache, n),
        "eagle": (lambda: target.lm_head(drafter(tok, h[:, -1:], d_cache)), d_cache, n - 1),
        "draft_lm": (lambda: draft_lm(input_ids=tok, cache=lm_cache, use_cache=True), lm_cache, n),
    }

    def one_step(name, _, k, r):
        step, cache, length = steps[name]
        t0 = clock()
        step()
        seconds = clock() - t0
        rollback(cache, length)
        return seconds

    times = interleaved(list(steps), [None], reps, one_step, order="fixed")
    med = {name: statistics.median(row[0] for row in per) for name, per in zip(steps, times)}
    return {"target_step_s": med["target"], "eagle_step_s": med["eagle"], "draft_lm_step_s": med["draft_lm"],
            "c_eagle": med["eagle"] / med["target"], "c_draft_lm": med["draft_lm"] / med["target"]}


def static_gamma_table(target, candidates: dict, prompts: list[list[int]], gammas, max_new_tokens: int,
                       repeats: int) -> tuple[dict, list[dict]]:
    """AR and each (drafter, γ) on the same prompts, interleaved prompt by prompt; medians over repeats."""
    configs = [("ar", None, None)] + [(name, cand, g) for name, cand in candidates.items() for g in gammas]

    def generate(config, p, k, r):
        _, cand, g = config
        if cand is None:
            return autoregressive_generate(target, p, max_new_tokens)
        return EngineFactory(target, cand).decoder(StaticPolicy(g)).generate(p, max_new_tokens)

    outs = interleaved(configs, prompts, repeats, generate, order="fixed")
    # every speculative output against AR's on the same prompt in the same round
    lossless = all(all(GreedyReference([ar.tokens for ar in ar_row]).same([out.tokens for out in row]))
                   for per in outs[1:] for row, ar_row in zip(per, outs[0]))
    runs = {(name, g): [total([o.stats for o in row]) for row in per] for (name, _, g), per in zip(configs, outs)}
    ar_tps = statistics.median(s.tokens_per_s for s in runs[("ar", None)])
    rows = []
    for (name, g), stats in runs.items():
        if name == "ar":
            continue
        tps = statistics.median(s.tokens_per_s for s in stats)
        rows.append({"drafter": name, "gamma": g, "tau": stats[0].tau, "tokens_per_s": tps, "speedup": tps / ar_tps,
                     "acceptance_rate": stats[0].acceptance_rate})
    return {"ar_tokens_per_s": ar_tps, "lossless": lossless, "new_tokens": runs[("ar", None)][0].new_tokens}, rows


def greedy_samples(target, tokenizer, prompts: list[tuple[str, list[int]]], n: int, max_new_tokens: int) -> list[dict]:
    out = []
    for cid, p in prompts[:n]:
        toks = autoregressive_generate(target, p, max_new_tokens).tokens
        out.append({"id": cid, "prompt": tokenizer.decode(p), "answer": tokenizer.decode(toks, skip_special_tokens=True)})
    return out


@torch.inference_mode()
def eagle3_step_cost(target: TargetModel, head, prompt: list[int], reps: int = 200, eagle1=None) -> dict:
    """Median seconds of one target decoding step and one EAGLE-3 drafting step (the engine's path: the
    batched drafter's forward on its slot cache and its logits over the target's vocabulary), interleaved;
    with ``eagle1`` (an EAGLE-1 drafter) its step too, timed as :func:`step_costs` times it, in the same loop."""
    from eagle_backbone.eagle3 import BatchedEagle3Drafter
    from eagle_backbone.ragged import RaggedBatch

    ids = torch.tensor([prompt])
    n = ids.shape[1]
    layers = head.aux_layers(target.model.config.num_hidden_layers)
    t_cache = target.new_cache()
    out = target.decoder(input_ids=ids, cache=t_cache, use_cache=True, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in layers], -1)
    dm = BatchedEagle3Drafter(head, n + 8)
    cache = dm.new_cache(1)
    h = dm(ids[0, 1:], aux[:-1], RaggedBatch([0], [0], [n - 1], "cpu"), cache)[-1:]
    tok, one = ids[:, -1:], RaggedBatch([0], [n - 1], [1], "cpu")
    if eagle1 is not None:
        d_cache = eagle1.new_cache()
        h1 = eagle1(ids[:, 1:], out.last_hidden_state[:, :-1], d_cache)
    clock = Clock()

    def one_step(name, _, k, r):
        t0 = clock()
        if name == "target":
            target(tok, t_cache)
            seconds = clock() - t0
            rollback(t_cache, n)
            return seconds
        if name == "eagle":
            target.lm_head(eagle1(tok, h1[:, -1:], d_cache))
            seconds = clock() - t0
            rollback(d_cache, n - 1)
            return seconds
        dm.logits(dm.draft(tok[0], h, one, cache))  # overwrites the same position every time
        return clock() - t0

    names = ["target", "eagle3"] + (["eagle"] if eagle1 is not None else [])
    times = interleaved(names, [None], reps, one_step, order="fixed")
    med = {name: statistics.median(row[0] for row in per) for name, per in zip(names, times)}
    out = {"target_step_s": med["target"], "eagle3_step_s": med["eagle3"], "c_eagle3": med["eagle3"] / med["target"]}
    if eagle1 is not None:
        out.update(eagle_step_s=med["eagle"], c_eagle=med["eagle"] / med["target"])
    return out


def eagle3_entry(cfg, root: Path, target: TargetModel, val_prompt: list[int], prompts: list[list[int]]) -> dict:
    """The EAGLE-3 head's card entry, measured in the decoding setting (``target`` loaded with it)."""
    from eagle_backbone.kinds.eagle3 import Eagle3CandidateGenerator
    from eagle_backbone.eagle3 import Eagle3Drafter
    from eagle_backbone.loading import tie_drafter_embedding

    head = Eagle3Drafter.from_pretrained(root / "eagle3", dtype=cfg.decode.dtype)
    tie_drafter_embedding(head, target)
    summary_path = root / "eagle3" / "training_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    eagle1 = EagleDrafter.from_pretrained(root / "drafter", dtype=cfg.decode.dtype)  # c of both in one loop
    costs = eagle3_step_cost(target, head, val_prompt, reps=cfg.cost_reps, eagle1=eagle1)
    autoregressive_generate(target, prompts[0], 16)  # warm-up
    decode, rows = static_gamma_table(target, {"eagle3": Eagle3CandidateGenerator(head, target)}, prompts,
                                      list(cfg.gammas), cfg.max_new_tokens, cfg.repeats)
    top1 = [summary[f"val_top1_{k}"] for k in range(int(summary.get("ttt_steps", 0))) if f"val_top1_{k}" in summary]
    return {"params": sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed")),
            "layers": summary.get("layers"), "steps": summary.get("total_steps", summary.get("steps")),
            "seed": summary.get("seed", 0), "train_seconds_this_run": summary.get("train_seconds_this_run"),
            "train_seconds_total": summary.get("total_train_seconds"), "val_top1_by_depth": top1,  # a continued head: both runs
            "costs": costs, "decoding": {**decode, "dtype": cfg.decode.dtype,
                                         "attn_implementation": cfg.decode.attn_implementation,
                                         "n_prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
                                         "repeats": cfg.repeats, "rows": rows}}


def _shipped_mb(root: Path) -> float:
    shipped = [f for name in ("tokenizer", "target", "drafter", "draft_lm", "eagle3") for f in (root / name).rglob("*")]
    return sum(f.stat().st_size for f in shipped if f.is_file()) / 2**20


def _test_prompts(cfg, tokenizer, corpus: Path):
    test = load_conversations(corpus / "test.json")
    test_prompts = build_prompts(tokenizer, test, cfg.max_prompt_tokens, turns="first")
    step = max(1, len(test_prompts) // cfg.n_prompts)  # a deterministic spread over the split
    return test_prompts[::step][: cfg.n_prompts]


def update_eagle3(cfg) -> dict:
    """``only=eagle3``: measure the EAGLE-3 entry alone, merge it into model_card.json (the card:
    :func:`ldlp.report.model_card.write_card`)."""
    set_threads(cfg.get("threads"))
    root = Path(cfg.embedded_dir)
    card = json.loads((root / "model_card.json").read_text())
    tokenizer = load_tokenizer(root / "tokenizer")
    corpus = Path(cfg.corpus_dir)
    chosen = _test_prompts(cfg, tokenizer, corpus)
    val_prompt = build_prompts(tokenizer, load_conversations(corpus / "validation.json"), cfg.max_prompt_tokens)[0][1]
    target = TargetModel.from_pretrained(root / "target", dtype=cfg.decode.dtype,
                                         attn_implementation=cfg.decode.attn_implementation)
    card["eagle3"] = eagle3_entry(cfg, root, target, val_prompt, [p for _, p in chosen])
    card["eagle3"]["measured_apart"] = True  # its own run: its AR baseline and step costs are its own
    card["shipped_mb"] = _shipped_mb(root)
    atomic_write_json(root / "model_card.json", card, newline=False)
    return card


def eagle3_sets_entry(root: Path, result: dict, overrides: list[str]) -> dict:
    """EAGLE-1's and the EAGLE-3 head's τ on each prompt set, from a drafters' head to head on the shipped folders
    (:func:`ldlp.bench.peers.drafters.bench_drafters`'s result, run by ``scripts/model_card.py`` with ``overrides``):
    its summary rows (one per set and T: the head's τ, EAGLE-1's, their paired ratio with its bootstrap 95% interval
    over prompts), the folders' data hashes and the sets it skipped. Refuses,
    in one line, a result of other drafters than ``root``'s EAGLE-1 drafter (the reference) and EAGLE-3 head."""
    want = {"eagle1": (root / "drafter").resolve(), "eagle3": (root / "eagle3").resolve()}
    got = {name: Path(str(d["drafter"])).resolve() for name, d in result["drafters"].items()}
    if got != want or result["reference"] != "eagle1":
        raise ValueError(f"only=eagle3_sets: the head to head measured {({k: str(v) for k, v in got.items()})}, not "
                         f"the shipped EAGLE-1 drafter and EAGLE-3 head ({({k: str(v) for k, v in want.items()})})")
    return {"gamma": result["tau_gamma"], "max_new_tokens": result["max_new_tokens"], "dtype": result["dtype"],
            "overrides": list(overrides), "skipped": dict(result["skipped"]), "rows": list(result["summary"]),
            "data_sha256": {name: cell["prompt_set"].get("data_sha256") for name, cell in result["sets"].items()}}


def update_eagle3_sets(cfg, head_to_head) -> dict:
    """``only=eagle3_sets``: :func:`eagle3_sets_entry` of ``head_to_head(cfg)`` (the drafters' head to head on the
    shipped folders, a bench_drafters result) merged into model_card.json's EAGLE-3 entry; one line if the card has
    no EAGLE-3 entry, before anything is measured."""
    root = Path(cfg.embedded_dir)
    card = json.loads((root / "model_card.json").read_text())
    if not card.get("eagle3"):
        raise ValueError(f"only=eagle3_sets: {root / 'model_card.json'} has no EAGLE-3 entry "
                         "(python scripts/model_card.py only=eagle3 measures it)")
    card["eagle3"]["prompt_sets"] = eagle3_sets_entry(root, head_to_head(cfg), list(cfg.eagle3_sets.overrides))
    atomic_write_json(root / "model_card.json", card, newline=False)
    return card


def predictor_entry(root: Path) -> dict | None:
    """The shipped draft-length predictor's card entry (data/embedded/predictor: what it reads, its labels and its
    validation scores, from its config.json; ``scripts/train_step_ldlp.py`` measured them)."""
    path = root / "predictor" / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    meta = config.get("meta") or {}
    from safetensors import safe_open

    with safe_open(str(root / "predictor" / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if not k.startswith("input_"))  # not the
        # standardisation buffers
    counts = meta.get("oracle_counts") or {}
    return {"params": params, "inputs": config.get("inputs"), "head": config.get("head"), "k_max": config.get("k_max"),
            "train_examples": meta.get("train_examples"), "validation_examples": meta.get("validation_examples"),
            "behaviours": meta.get("behaviours"), "oracle_sequences": counts.get("sequences"),
            "oracle_positions": counts.get("positions"), "validation": meta.get("validation"),
            "token_ratio": meta.get("token_ratio"), "command": meta.get("command"),
            "in_step": in_step_entry(root / "predictor")}


def in_step_entry(folder: Path) -> dict | None:
    """``policy=learned_in_step``'s starting weights beside the predictor (``scripts/fit_in_step.py``), with the
    cross-fitted scores that file records."""
    path = folder / "in_step.json"
    if not path.is_file():
        return None
    fit = json.loads(path.read_text())
    return {k: fit.get(k) for k in ("prior", "drafted", "scores", "events", "positions", "sequences", "fitted_on")}


def update_predictor(cfg) -> dict:
    """``only=predictor``: the shipped predictor's entry alone, merged into model_card.json."""
    root = Path(cfg.embedded_dir)
    card = json.loads((root / "model_card.json").read_text())
    card["predictor"] = predictor_entry(root)
    atomic_write_json(root / "model_card.json", card, newline=False)
    return card


def build_model_card(cfg) -> dict:
    if cfg.get("only") not in (None, "eagle3", "predictor"):  # eagle3_sets: update_eagle3_sets (scripts/model_card.py)
        raise ValueError(f"only={cfg.get('only')}: build_model_card measures only=null, eagle3 or predictor")
    if cfg.get("only") == "eagle3":
        return update_eagle3(cfg)
    if cfg.get("only") == "predictor":
        return update_predictor(cfg)
    torch.manual_seed(cfg.seed)
    set_threads(cfg.get("threads"))
    root = Path(cfg.embedded_dir)
    tokenizer = load_tokenizer(root / "tokenizer")
    target = TargetModel.from_pretrained(root / "target")
    drafter = EagleDrafter.from_pretrained(root / "drafter")
    draft_lm = TargetModel.from_pretrained(root / "draft_lm").model
    corpus = Path(cfg.corpus_dir)
    train = load_conversations(corpus / "train.json")
    val = load_conversations(corpus / "validation.json")

    from eagle_backbone.train.lm import packed_blocks  # Lightning: imported when a card is built

    val_blocks = packed_blocks(tokenizer, val, cfg.block_size)
    target_loss = lm_validation_loss(target.model, val_blocks, max_blocks=cfg.max_val_blocks)
    draft_lm_loss = lm_validation_loss(draft_lm, val_blocks, max_blocks=cfg.max_val_blocks)
    unigram = unigram_perplexity(_tokens(tokenizer, train), _tokens(tokenizer, val[: cfg.max_val_conversations]),
                                 len(tokenizer))
    top1 = drafter_top1(target, drafter, val_blocks, max_blocks=cfg.max_val_blocks)

    chosen = _test_prompts(cfg, tokenizer, corpus)
    val_prompt = build_prompts(tokenizer, val, cfg.max_prompt_tokens)[0][1]
    # speed is measured as the main command decodes (conf/model/embedded.yaml: dtype and attention);
    # the losses and the top-1 agreement above describe the models in float32
    decode_setting = {"dtype": cfg.decode.dtype, "attn_implementation": cfg.decode.attn_implementation}
    target = TargetModel.from_pretrained(root / "target", **decode_setting)
    drafter = EagleDrafter.from_pretrained(root / "drafter", dtype=cfg.decode.dtype)
    draft_lm = TargetModel.from_pretrained(root / "draft_lm", **decode_setting).model
    costs = step_costs(target, drafter, draft_lm, val_prompt, reps=cfg.cost_reps)
    cands = {"eagle": EagleCandidateGenerator(drafter, target), "draft_lm": DraftModelCandidateGenerator(draft_lm, target)}
    autoregressive_generate(target, chosen[0][1], 16)  # warm-up
    decode, rows = static_gamma_table(target, cands, [p for _, p in chosen], list(cfg.gammas), cfg.max_new_tokens,
                                      cfg.repeats)
    summaries = {name: json.loads((root / name / "training_summary.json").read_text())
                 for name in ("target", "drafter", "draft_lm") if (root / name / "training_summary.json").exists()}
    manifest = json.loads((corpus / "manifest.json").read_text())
    eagle3 = eagle3_entry(cfg, root, target, val_prompt, [p for _, p in chosen]) if (root / "eagle3").is_dir() else None
    size_mb = _shipped_mb(root)
    card = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "corpus": manifest,
        "tokenizer_vocab": len(tokenizer),
        "target": {"params": sum(p.numel() for p in target.parameters()), "val_loss": target_loss,
                   "val_ppl": math.exp(target_loss), "unigram_val_ppl": unigram, **summaries.get("target", {})},
        "draft_lm": {"params": sum(p.numel() for p in draft_lm.parameters()), "val_loss": draft_lm_loss,
                     "val_ppl": math.exp(draft_lm_loss), **summaries.get("draft_lm", {})},
        "drafter": {"params": sum(p.numel() for n, p in drafter.named_parameters() if not n.startswith("embed")),
                    "val_top1": top1, **summaries.get("drafter", {})},
        "costs": costs,
        "decoding": {**decode, **decode_setting, "n_prompts": len(chosen), "max_new_tokens": cfg.max_new_tokens,
                     "repeats": cfg.repeats, "rows": rows},
        "samples": greedy_samples(target, tokenizer, chosen, cfg.n_samples, cfg.sample_tokens),
        "shipped_mb": size_mb,
        "command": cfg.command,
    }
    if eagle3 is not None:
        card["eagle3"] = eagle3
    if predictor_entry(root) is not None:
        card["predictor"] = predictor_entry(root)
    for key in ("config",):
        for part in ("target", "draft_lm", "drafter"):
            card[part].pop(key, None)
    atomic_write_json(root / "model_card.json", card, newline=False)
    return card
