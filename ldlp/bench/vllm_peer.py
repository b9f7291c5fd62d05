"""vLLM as a peer in the batched benchmark (``scripts/bench_batch.py contenders=[..., "engine=vllm",
"engine=vllm spec.k=3", "engine=vllm spec.method=eagle3 spec.k=3"]``, issues 22 and 33): vLLM's own AR and
its own EAGLE (EAGLE-1) or EAGLE-3 speculative decoding with this project's drafter, on the same target,
prompts (the project's token ids), budgets, stop tokens and rounds.

vLLM never runs in the benchmark's process. A worker (:mod:`ldlp.bench.vllm_worker`, standard library and
vLLM only) runs vLLM's offline ``LLM`` API in a Python of its own, ``vllm.python`` (default: this
interpreter; a separate virtual environment when vLLM's pins clash with this project's, docs/batched.md),
and the benchmark talks to it over JSON lines: token ids in, token ids, seconds and counters out. Settings:
float32, one thread (the benchmark's ``threads``), no torch.compile (``enforce_eager``), no prefix caching,
one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the worker's CPU time is all of vLLM's), and
``max_num_seqs`` = C: one worker per (contender, C), started before that C's first timed block and warmed up.

**The drafter.** vLLM's EAGLE-1 Llama drafter (``EagleLlamaForCausalLM``) computes
``fc(concat(embed(t), f))`` with ``fc`` *without* a bias; ours has one. Write ``fc.weight = [W_e | W_f]``:

    W_e e + W_f f + b = W_e (e + W_e⁻¹ b) + W_f f

so the bias folds into a drafter-owned embedding ``embed' = embed + W_e⁻¹ b`` (every row shifted by the same
vector), exactly, whenever W_e is invertible (:func:`fold_fc_bias` checks its condition number). vLLM keeps a
drafter embedding that differs from the target's and shares the target's LM head when the drafter has none.
The rest of the layer is the same math (no input norm; post-attention norm, MLP; no final norm), and the
feature both read is the target's last hidden state after its final norm. :func:`convert_drafter` writes
the converted folder (float32) under ``<outputs>/vllm_drafters/<hash of the inputs>/`` once and reuses it.

**The EAGLE-3 head** (``spec.method=eagle3``, ``model.drafter_kind=eagle3``) needs no conversion: vLLM reads
speculators' layout itself (``SpeculatorsConfig``: ``transformer_layer_config`` becomes its
``Eagle3LlamaForCausalLM`` config, ``eagle_aux_hidden_state_layer_ids`` the target layers whose entering
states it fuses), so the worker is given the head's folder as it is. :func:`check_eagle3_head` refuses, in
one line, what vLLM would refuse later: another layout, or an identity ``d2t`` shipped with a full draft
vocabulary (``Eagle3Drafter.save_pretrained`` no longer writes one).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

FORMAT = "vllm-eagle1-llama/1"  # bump when the converted layout changes: the cache key includes it
MAX_CONDITION = 1e6  # W_e's condition number above which the fold would lose float32 precision
WORKER = Path(__file__).with_name("vllm_worker.py")


# ---- the drafter, converted ------------------------------------------------------------------------------

def fold_fc_bias(state: dict[str, torch.Tensor], embedding: torch.Tensor | None = None,
                 max_condition: float = MAX_CONDITION) -> dict[str, torch.Tensor]:
    """An EAGLE-1 state dict with ``fc.bias`` folded into the drafter's own embedding (float32, no
    ``fc.bias``): ``embed_tokens.weight + W_e⁻¹ b`` with W_e = ``fc.weight[:, :d]``, solved in float64.
    ``embedding``: the embedding to start from when the state has none (the target's, which it ties).
    Raises ValueError when W_e is singular or too ill-conditioned for the fold to hold in float32."""
    out = {k: v.detach().to(torch.float32).clone() for k, v in state.items()}
    emb = out.get("embed_tokens.weight")
    if emb is None:
        if embedding is None:
            raise ValueError("the drafter has no embed_tokens.weight and no embedding was given to fold into")
        emb = embedding.detach().to(torch.float32).clone()
    out["embed_tokens.weight"] = emb
    bias = out.pop("fc.bias", None)
    if bias is None or not bool(bias.any()):
        return out
    d = emb.shape[1]
    w = out["fc.weight"]
    if tuple(w.shape) != (d, 2 * d):
        raise ValueError(f"fc.weight is {tuple(w.shape)}; an EAGLE-1 drafter's is ({d}, {2 * d})")
    w_e = w[:, :d].double()
    cond = float(torch.linalg.cond(w_e))
    if not cond < max_condition:  # also catches inf and nan (singular)
        raise ValueError(f"fc's embedding half W_e has condition number {cond:.3g} (limit {max_condition:.0g}): "
                         "its bias cannot be folded into the embedding for vLLM's bias-free EAGLE-1 drafter")
    shift = torch.linalg.solve(w_e, bias.double())
    out["embed_tokens.weight"] = (emb.double() + shift[None]).to(torch.float32)
    return out


def _file_hash(path: Path, h) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


def convert_drafter(drafter_dir: str | Path, target_dir: str | Path, cache_root: str | Path) -> Path:
    """The drafter at ``drafter_dir`` in vLLM's EAGLE-1 Llama layout, under ``cache_root/<hash>/`` (made once:
    the hash covers the drafter's files, the target's weights when the drafter ties its embedding, and
    :data:`FORMAT`). Returns the folder (``config.json`` + ``model.safetensors``, float32)."""
    from safetensors.torch import load_file, save_file

    from eagle_backbone.drafter import load_state_dict
    from eagle_backbone.io import atomic_path, atomic_write_json

    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    state = load_state_dict(drafter_dir)
    h = hashlib.sha256(FORMAT.encode())
    for f in sorted(drafter_dir.iterdir()):
        if f.name == "config.json" or f.suffix in (".safetensors", ".bin"):
            h.update(f.name.encode())
            _file_hash(f, h)
    target_embedding = None
    if "embed_tokens.weight" not in state:
        tw = target_dir / "model.safetensors"
        _file_hash(tw, h)
        target_embedding = load_file(str(tw))["model.embed_tokens.weight"]
    out = Path(cache_root) / h.hexdigest()[:16]
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    folded = fold_fc_bias(state, target_embedding)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, bias=False,
               torch_dtype="float32", dtype="float32", tie_word_embeddings=False)
    for k in ("_name_or_path", "id2label", "label2id", "transformers_version"):
        cfg.pop(k, None)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in folded.items()}, str(tmp), metadata={"format": "pt"})
    atomic_write_json(out / "config.json", cfg, indent=2)
    atomic_write_json(out / "converted_from.json", {"drafter": str(drafter_dir), "format": FORMAT,
                                                    "fc_bias_folded": "fc.bias" in state})
    return out


# ---- the worker, from the benchmark's side ---------------------------------------------------------------

METHODS = ("eagle", "eagle3")  # vLLM's speculative method -> the model.drafter_kind it serves (the same name)


def parse_contender(spec: str) -> dict | None:
    """``"engine=vllm"`` -> {"k": None, "method": None}; ``"engine=vllm spec.k=3"`` -> {"k": 3, "method":
    "eagle"}; ``"engine=vllm spec.method=eagle3 spec.k=3"`` -> {"k": 3, "method": "eagle3"}; None for any other
    contender (a policy string). A ValueError for an engine other than vllm, a bad k or method, or a method
    without k."""
    words = str(spec).split()
    kv = dict(w.split("=", 1) for w in words if "=" in w)
    if "engine" not in kv:
        return None
    if kv["engine"] != "vllm":
        raise ValueError(f"contender {spec!r}: engine must be vllm (the only peer engine), got {kv['engine']!r}")
    unknown = sorted(set(kv) - {"engine", "spec.k", "spec.method"})
    if unknown or len(kv) != len(words):
        raise ValueError(f"contender {spec!r}: takes engine=vllm and optionally spec.k=K and spec.method="
                         f"{'|'.join(METHODS)}, not {unknown or words}")
    k = kv.get("spec.k")
    if k is not None:
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"contender {spec!r}: spec.k must be an integer >= 1, got {k!r}")
        k = int(k)
    method = kv.get("spec.method")
    if method is not None and method not in METHODS:
        raise ValueError(f"contender {spec!r}: spec.method must be one of {'|'.join(METHODS)}, got {method!r}")
    if method is not None and k is None:
        raise ValueError(f"contender {spec!r}: spec.method needs spec.k=K (the drafted tokens per step)")
    return {"k": k, "method": None if k is None else (method or "eagle")}


def contender_label(k: int | None, method: str | None = "eagle") -> str:
    return "vllm ar" if k is None else f"vllm {method or 'eagle'} k={k}"


def check_eagle3_head(folder: str | Path) -> None:
    """Raise a one-line ValueError unless vLLM can serve the EAGLE-3 head at ``folder`` as it is: speculators'
    layout (``speculators_model_type: eagle3``) and, with a full draft vocabulary, no ``d2t`` in the weights
    (vLLM's model then has no map to load it into and stops)."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"vLLM EAGLE-3: {folder} has no config.json")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("speculators_model_type") != "eagle3":
        raise ValueError(f"vLLM EAGLE-3: {cfg_path} is not in speculators' layout (speculators_model_type "
                         f"{cfg.get('speculators_model_type')!r}); write it with Eagle3Drafter.save_pretrained("
                         "layout='speculators') (docs/eagle3.md)")
    vocab = (cfg.get("transformer_layer_config") or {}).get("vocab_size")
    if cfg.get("draft_vocab_size") in (None, vocab) and (folder / "model.safetensors").exists():
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            if "d2t" in f.keys():
                raise ValueError(f"vLLM EAGLE-3: {folder / 'model.safetensors'} ships d2t with a full draft "
                                 "vocabulary, which vLLM refuses; rewrite it with Eagle3Drafter.save_pretrained "
                                 "(it leaves the identity map out)")


class VllmWorker:
    """One worker process: vLLM's ``LLM`` on the target (and the converted drafter with k), for one C."""

    def __init__(self, python: str, settings: dict, log_path: str | Path | None = None, timeout_s: float = 900):
        env = dict(os.environ)
        threads = str(settings.get("threads", 1))
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
                   VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)  # the worker's Python is vLLM's: none of this environment's packages
        self.log = open(log_path, "a") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([python, "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, text=True, bufsize=1)
        self.timeout_s = timeout_s
        self.ready = self.call(settings)

    def call(self, msg: dict) -> dict:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the vLLM worker exited with status {self.proc.returncode}; see its log")
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"the vLLM worker exited with status {code} without answering; see its log "
                               f"({getattr(self.log, 'name', 'none')})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"vLLM worker: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()


def vllm_available(python: str | None = None) -> bool:
    """Whether ``python`` (default: this interpreter) can import vllm, without importing it here."""
    python = python or sys.executable
    try:
        return subprocess.run([python, "-I", "-c", "import importlib.util as u, sys; "
                               "sys.exit(0 if u.find_spec('vllm') else 1)"],
                              capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class VllmRunner:
    """A contender's runs on vLLM: :meth:`run` decodes one block of prompts with at most C in flight and
    returns the token ids per prompt and a summary with the keys of
    :meth:`~ldlp.bench.workload.WorkloadResult.summary` (token-gap p90 excepted: vLLM reports
    each request's first and last token times, so the mean gap is exact and the p90 is not measured)."""

    def __init__(self, k: int | None, target_dir: str | Path, drafter_dir: str | Path | None, cache_root: str | Path,
                 python: str | None = None, threads: int = 1, dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 2048, log_dir: str | Path | None = None, log=print, method: str = "eagle"):
        if method not in METHODS:
            raise ValueError(f"vLLM speculative method must be one of {METHODS}, got {method!r}")
        if k is not None and drafter_dir is None:
            raise ValueError(f"vLLM's {method} needs the pair's {method} drafter (model.drafter_kind={method})")
        self.k, self.method, self.python, self.log_fn = k, method, python or sys.executable, log
        self.base = {"target": str(Path(target_dir).resolve()), "dtype": dtype, "threads": int(threads),
                     "seed": int(seed), "max_model_len": int(max_model_len), "k": k}
        if k is not None and method == "eagle3":  # speculators' folder, read by vLLM as it is
            check_eagle3_head(drafter_dir)
            self.base.update(drafter=str(Path(drafter_dir).resolve()), method="eagle3")
        elif k is not None:
            self.base.update(drafter=str(convert_drafter(drafter_dir, target_dir, cache_root).resolve()), method="eagle")
        tag = "ar" if k is None else (f"k{k}" if method == "eagle" else f"{method}_k{k}")
        self.log_path = Path(log_dir) / f"vllm_worker_{tag}.log" if log_dir else None
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.worker: VllmWorker | None = None
        self.C = None
        self.info: dict = {}

    def _start(self, C: int) -> None:
        self.close()
        t0 = time.perf_counter()
        # an explicit KV cache (vLLM's CPU default reserves a share of the machine's memory): room for C
        # sequences of max_model_len, twice over for block rounding, target layers and the drafter's one
        cfg = json.loads((Path(self.base["target"]) / "config.json").read_text())
        heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = (cfg["num_hidden_layers"] + 1) * 2 * heads * head_dim * 4
        kv = 2 * C * self.base["max_model_len"] * per_token + (64 << 20)
        self.worker = VllmWorker(self.python, {**self.base, "max_num_seqs": int(C), "kv_cache_bytes": kv},
                                 self.log_path)
        self.C, self.info = C, self.worker.ready
        self.log_fn(f"{contender_label(self.k, self.method)}: vLLM {self.info.get('vllm')} worker for C={C} ready in "
                    f"{time.perf_counter() - t0:.0f} s ({self.info.get('torch_threads')} torch thread(s))")

    def warm_up(self, prompts: list[list[int]], C: int, max_new_tokens: int, stop_ids) -> None:
        if self.C != C:
            self._start(C)
        self.worker.call({"cmd": "generate", "prompts": prompts[:max(2, C)], "max_new_tokens": max_new_tokens,
                          "stop_token_ids": sorted(stop_ids), "temperature": 0.0, "seeds": None})

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def run(self, prompts: list[list[int]], C: int, max_new_tokens: int, seeds: list[int], sampling=None,
            stop_ids=()) -> tuple[list, dict]:
        """Decode ``prompts`` with at most C in flight (a worker for this C is started and warmed up first,
        untimed); ``sampling``: a :class:`~eagle_backbone.sampling.SamplingConfig` (None: greedy), each
        sequence seeded with its seed at T > 0; ``stop_ids``: the target's stop tokens (kept in the output,
        as the engine keeps them)."""
        if self.C != C:
            self._start(C)
            self.warm_up(prompts, C, min(8, max_new_tokens), stop_ids)
        T = float(getattr(sampling, "temperature", 0.0) or 0.0)
        r = self.worker.call({"cmd": "generate", "prompts": prompts, "max_new_tokens": int(max_new_tokens),
                              "stop_token_ids": sorted(stop_ids), "temperature": T,
                              "top_k": getattr(sampling, "top_k", 0), "top_p": getattr(sampling, "top_p", 1.0),
                              "seeds": list(seeds)})
        outs = r["outputs"]
        tok = sum(len(o) for o in outs)
        # a target forward per sequence: its prefill, then one per decode step (one per draft with EAGLE)
        forwards = len(prompts) + r["num_drafts"] if self.k is not None else tok
        ms = 1e3
        req, first = r["request_s"], r["first_token_s"]
        gaps_n = sum(max(len(o) - 1, 0) for o in outs)
        summ = {"new_tokens": tok, "wall_s": r["wall_s"], "tokens_per_s": tok / r["wall_s"] if r["wall_s"] else 0.0,
                "cpu_s": r["cpu_s"], "tokens_per_cpu_s": tok / r["cpu_s"] if r["cpu_s"] else 0.0,
                "tau": tok / forwards if forwards else 0.0, "steps": None,
                "drafted_tokens": r.get("num_draft_tokens", 0), "accepted_tokens": r.get("num_accepted_tokens", 0),
                "token_latency_ms_mean": ms * r["token_gap_sum_s"] / gaps_n if gaps_n else 0.0,
                "token_latency_ms_p90": None,
                "request_latency_ms_mean": ms * sum(req) / len(req) if req else 0.0,
                "request_latency_ms_p90": ms * _p90(req) if req else 0.0,
                "first_token_ms_mean": ms * sum(first) / len(first) if first else 0.0,
                "engine": "vllm", "vllm": self.info.get("vllm")}
        return outs, summ

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.worker, self.C = None, None


def _p90(xs: list[float]) -> float:
    from ldlp.bench.workload import percentile

    return percentile(xs, 0.9)


def make_contender(spec: dict, model_cfg, prompts: list[list[int]], max_new_tokens: int, vllm_cfg, outputs: str | Path,
                   threads: int = 1, seed: int = 0, log=print):
    """The batched benchmark's contender for ``parse_contender``'s ``spec``: label ``vllm ar``, ``vllm eagle
    k=K`` or ``vllm eagle3 k=K``, policy ``vllm``, gamma 0 or K, and a :class:`VllmRunner` on the pair's target
    (and its drafter: EAGLE-1's converted under ``outputs/vllm_peer/drafters``, EAGLE-3's speculators folder as
    it is; worker logs in ``outputs/vllm_peer/logs``). ``vllm_cfg``: ``python`` (None: this interpreter),
    ``dtype`` (float32). Refuses, in one line and before anything loads, a method that does not match
    ``model.drafter_kind`` (``spec.method=eagle3`` needs ``eagle3``, plain ``spec.k`` needs ``eagle``)."""
    from ldlp.bench.load_sweep import Contender

    k, method = spec["k"], spec.get("method") or "eagle"
    kind = str(model_cfg.get("drafter_kind", "eagle"))
    if k is not None and kind != method:
        what = "spec.k" if method == "eagle" else f"spec.method={method} spec.k"
        raise ValueError(f"engine=vllm {what}={k}: vLLM's {'EAGLE' if method == 'eagle' else 'EAGLE-3'} needs the "
                         f"pair's {method} drafter (model.drafter_kind={method}), and model.drafter_kind is {kind}"
                         + (" (model=embedded_eagle3 for the embedded pair)" if method == "eagle3" else
                            " (spec.method=eagle3 for an EAGLE-3 head)" if kind == "eagle3" else ""))
    if k is not None and method == "eagle3":
        check_eagle3_head(model_cfg.drafter)
    python = (vllm_cfg or {}).get("python") or sys.executable
    if not vllm_available(python):
        raise ValueError(f"engine=vllm: {python} cannot import vllm; install it (pip install -e '.[vllm]') or "
                         "point vllm.python at a Python that has it (docs/batched.md)")
    target_max = json.loads((Path(model_cfg.target) / "config.json").read_text()).get("max_position_embeddings", 2048)
    max_len = min(int(target_max), max(len(p) for p in prompts) + int(max_new_tokens) + (k or 0) + 8)
    root = Path(outputs) / "vllm_peer"
    runner = VllmRunner(k, model_cfg.target, model_cfg.drafter if k is not None else None, root / "drafters",
                        python=python, threads=threads, dtype=str((vllm_cfg or {}).get("dtype") or "float32"),
                        seed=seed, max_model_len=max_len, log_dir=root / "logs", log=log, method=method)
    return Contender(contender_label(k, method), "vllm", 0 if k is None else k, None, runner)
