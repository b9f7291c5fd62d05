"""The profiled cost table of one batched speculative step (:class:`CostTable`): what a step costs on this setup,
profiled once per setup and cached.

It is the prior, not the price the policies plan with: the engine's online step-cost model
(:class:`~eagle_backbone.step_cost.OnlineCostModel`) starts from it and refits itself to the engine's own timed
steps, and the cost-driven policies, the batched oracle, replay and tuning price steps by that model (or by one
fitted in hindsight, ``policy.cost_model``; ``policy.online_costs=false`` plans on the table as it is).
:meth:`CostTable.linear` is a synthetic linear price (replay's ``fit_costs`` fits one to timed generations);
vLLM's steps have a model of their own (``ldlp.bench.peers.vllm_schedule.StepModel``, the Dynamic-SD tuner's).

What a step costs depends on the load: the target's verification forward for R slots scoring N tokens
in all (nearly free while the target is memory-bound, linear once it is compute-bound), a drafter
forward per draft depth for the rows still drafting, the drafter's catch-up forward over the tokens
accepted last step, and the engine's own bookkeeping. :func:`profile_costs` measures these once per
machine, model, dtype and thread count, on the engine's own forwards (packed ragged verification, the
slot caches, a realistic cached context), interleaved and repeated, medians kept; :class:`CostTable`
interpolates them. ``python scripts/profile_cost.py`` writes the table; policies that find none for
their key profile on first use and cache it (docs/batched.md gives the time it takes: minutes in bfloat16
on a CPU without bf16 matmuls, and it grows with the slot counts profiled, so a run profiles only those it
needs: :func:`load_or_profile`'s ``slots``, extended later when a run needs more).

Keys (:func:`cost_key`, :func:`setup_key`): everything that changes what a step costs: ``model`` (its name),
``dtype``, ``device`` type, ``threads`` (torch intra-op threads), torch version, the processor (``cpu``: the
CPU's model name; the GPU's name on CUDA) and what its name does not tell (``cpu_caps``: bf16 matmuls,
AVX-512, family and model numbers; the GPU's compute capability), the drafter's kind and a SHA-256 of its weights
(``drafter_kind``, ``drafter_sha256``) and the batched forward's attention math (``attn``). The file name
carries the readable parts and a digest of the whole key, so two setups never share a file; the table stores
its key, and every result that planned with it records the key and the file (``meta["path"]``). Each cell
also stores its dispersion over the repetitions (``dispersion``: interquartile range over median).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle_backbone.ragged import RaggedBatch
from eagle_backbone.errors import ConfigError
from eagle_backbone.io import atomic_write_json

SLOTS = (1, 2, 4, 8, 16, 32)
TOKENS_PER_SLOT = (1, 2, 3, 5, 9, 17, 25)  # scored tokens a slot: the last token plus γ drafts (or tree nodes)


def processor_name(device) -> str:
    """What runs the forwards: the GPU's name on CUDA, else the CPU's model name from /proc/cpuinfo (the
    platform's processor string where there is none)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def processor_caps(device) -> dict:
    """What of the processor changes a step's cost besides its name: on a CPU its vendor family and model numbers,
    whether it has bf16 matmuls (AVX-512 BF16 or AMX) and AVX-512 (two machines sold under one name can differ in
    both), and the routes this process takes (torch's vector ISA, oneDNN's packed bfloat16); on CUDA the compute
    capability."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return {"capability": ".".join(str(x) for x in torch.cuda.get_device_capability(dev))}
    from eagle_backbone.runtime import BF16_CPU_FLAGS, cpu_flags, cpu_isa, packed_matmul

    flags = cpu_flags() or set()
    # the flags, and what this process's kernels run: the vector ISA of torch's kernels and whether oneDNN packs
    # bfloat16 (the linear route, eagle_backbone/linear.py); ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA change both
    caps = {"bf16": bool(flags & BF16_CPU_FLAGS), "avx512": "avx512f" in flags, "isa": cpu_isa(),
            "packed_bf16": packed_matmul(torch.bfloat16)}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, sep, value = line.partition(":")
            name = name.strip()
            if sep and name in ("cpu family", "model") and name.replace(" ", "_") not in caps:
                caps[name.replace(" ", "_")] = value.strip()
            if name == "" and "model" in caps:  # the first processor's block is enough
                break
    except OSError:
        pass
    return caps


def weights_sha256(module) -> str | None:
    """SHA-256 over a module's state (names, dtypes, shapes and bytes, in name order): the same weights
    file loaded in the same dtype gives the same digest, any other drafter another. None for no module."""
    if module is None or not hasattr(module, "state_dict"):
        return None
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def setup_key(engine) -> dict:
    """The key fields an engine adds (:func:`cost_key`): its candidate generator's kind, a digest of the
    drafter's weights (the EAGLE head or the draft LM; None for a generator without one) and the attention
    math of its batched forwards."""
    return {"drafter_kind": engine.kind, "drafter_sha256": drafter_sha256(engine.candidates), "attn": str(engine.attn)}


def drafter_sha256(candidates) -> str | None:
    """:func:`weights_sha256` of a candidate generator's drafter (the EAGLE head or the draft LM); None without one."""
    module = None if candidates is None else (getattr(candidates, "drafter", None) or getattr(candidates, "model", None))
    return weights_sha256(module)


def cost_key(model_name: str, dtype: torch.dtype, device, threads: int, setup: dict | None = None) -> dict:
    """The cost table's key: model, dtype, device type, threads, torch version and processor, plus
    ``setup`` (:func:`setup_key` of an engine: drafter kind and weights, attention) when given;
    :func:`load_or_profile` completes a key without it from the engines it profiles with."""
    key = {"model": str(model_name), "dtype": str(dtype).replace("torch.", ""), "device": torch.device(device).type,
           "threads": int(threads), "torch": torch.__version__.split("+")[0], "cpu": processor_name(device),
           "cpu_caps": processor_caps(device)}
    return {**key, **(setup or {})}


def table_path(cost_dir: str | Path, key: dict) -> Path:
    """``<dtype>-<device>-t<threads>[-avx512][-bf16]-<drafter kind>-<attn>-<digest of the whole key>.json`` under
    ``cost_dir`` (avx512, bf16: the CPU's capabilities of :func:`processor_caps`)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    caps = key.get("cpu_caps") or {}
    isa = "-".join(k for k in ("avx512", "bf16") if caps.get(k))  # in the name: tables of CPUs that differ look it
    parts = [key["dtype"], key["device"], f"t{key['threads']}"] + ([isa] if isa else []) + \
        [str(key[k]) for k in ("drafter_kind", "attn") if key.get(k) is not None]
    return Path(cost_dir) / f"{'-'.join(parts)}-{digest}.json"


def _interp(xs, ys, x: float) -> float:
    """Piecewise-linear interpolation in a sorted grid, extrapolating linearly past its ends."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostTable:
    """Milliseconds, measured: ``target[r][t]`` the verification forward (with LM head) of ``slots[r]``
    rows scoring ``tokens[t]`` tokens each; ``draft[r]`` one draft depth (forward, LM head, softmax) over
    ``slots[r]`` rows; ``feed[r][t]`` the drafter's catch-up forward of ``tokens[t]`` tokens a row;
    ``overhead[r]`` the engine's bookkeeping a step (a measured plain decoding step minus its forward);
    ``depth_overhead[r]`` the bookkeeping a draft depth adds (measured speculative steps minus their
    forwards and ``overhead``, per depth)."""

    key: dict
    slots: list[int]
    tokens: list[int]
    target: list[list[float]]
    draft: list[float]
    feed: list[list[float]]
    overhead: list[float]
    depth_overhead: list[float] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    # per cell, the interquartile range of its repetitions over their median (same layout as the cell's list)
    dispersion: dict = field(default_factory=dict)

    @classmethod
    def linear(cls, step_ms: float, draft_ms: float, accepted_ms: float = 0.0) -> CostTable:
        """A synthetic table whose :meth:`step_ms` is ``step_ms + draft_ms * γ + accepted_ms * accepted`` at one
        slot (``step_ms(1, [1] * γ, γ + 1, accepted + 1)``): a flat verification forward, one draft depth
        ``draft_ms`` and a catch-up forward ``accepted_ms`` a token beyond the first. It has one slot column,
        so it prices a step the same at any slot count. For a linear fit to timed generations and for synthetic
        prices in tests; ``meta["linear"]`` keeps the three terms."""
        step_ms, draft_ms, accepted_ms = float(step_ms), float(draft_ms), float(accepted_ms)
        if min(step_ms, draft_ms, accepted_ms) < 0:
            raise ValueError(f"a linear cost table needs costs >= 0, got {step_ms}, {draft_ms}, {accepted_ms}")
        return cls({"source": "linear"}, [1], [1, 2], [[step_ms, step_ms]], [draft_ms], [[0.0, accepted_ms]], [0.0],
                   meta={"linear": {"step_ms": step_ms, "draft_ms": draft_ms, "accepted_ms": accepted_ms}})

    def _by_slots(self, R: float, per_row: list[float]) -> float:
        return max(0.0, _interp(self.slots, per_row, R))

    def _memo(self, key, fn):
        """Lookups repeat every step with the same few arguments: computed once (not saved with the table)."""
        memo = self.__dict__.setdefault("_memo_", {})
        if key not in memo:
            memo[key] = fn()
        return memo[key]

    def target_ms(self, R: int, N: float) -> float:
        """The verification forward of R rows scoring N tokens in all (packed: the cost follows N)."""
        row = self._memo(("target", R), lambda: [self._by_slots(R, [r[t] for r in self.target])
                                                 for t in range(len(self.tokens))])
        return max(0.0, _interp(self.tokens, row, N / R))

    def draft_ms(self, A: int, R: int | None = None) -> float:
        """One draft depth over A rows (0 rows: no forward), with the engine's bookkeeping for a depth
        in a step of R running rows (default A)."""
        if A <= 0:
            return 0.0
        R = R or A

        def compute():
            extra = self._by_slots(R, self.depth_overhead) if self.depth_overhead else 0.0
            return self._by_slots(A, self.draft) + extra
        return self._memo(("draft", A, R), compute)

    def feed_ms(self, R: int, tokens_per_row: float) -> float:
        return self._by_slots(R, [_interp(self.tokens, row, tokens_per_row) for row in self.feed])

    def overhead_ms(self, R: int) -> float:
        return self._memo(("overhead", R), lambda: self._by_slots(R, self.overhead))

    def step_ms(self, R: int, depth_rows, scored: float, fed_per_row: float) -> float:
        """One speculative step of R running rows, the formula every reader of the table shares (the
        load-aware policies, :func:`check_costs`, replay at R = 1): the engine's bookkeeping, the target's
        verification forward scoring ``scored`` tokens in all, and, when any row drafts, the drafter's
        catch-up forward over ``fed_per_row`` tokens a row plus one draft depth per entry of ``depth_rows``
        (the rows still drafting at that depth). Plain decoding (no depth) pays no drafter forward."""
        ms = self.overhead_ms(R) + self.target_ms(R, scored)
        depths = [int(a) for a in depth_rows if a > 0]
        if depths:
            ms += self.feed_ms(R, fed_per_row) + sum(self.draft_ms(a, R) for a in depths)
        return ms

    def save(self, path: str | Path) -> Path:
        self.meta["path"] = str(path)
        atomic_write_json(path, {k: v for k, v in asdict(self).items() if k != "_memo_"})
        return Path(path)

    def merged(self, other: CostTable) -> CostTable:
        """This table with ``other``'s slot counts added (the same key and token grid; ``other`` wins a tie)."""
        if other.key != self.key or other.tokens != self.tokens:
            raise ValueError(f"cost tables of different keys or token grids cannot merge: {self.key} / {other.key}")
        rows = {R: (self, i) for i, R in enumerate(self.slots)}
        rows.update({R: (other, i) for i, R in enumerate(other.slots)})
        order = sorted(rows)

        def col(name):
            return [getattr(rows[R][0], name)[rows[R][1]] if getattr(rows[R][0], name) else 0.0 for R in order]

        disp = {}
        for name in ("target", "draft", "feed", "overhead", "step"):
            if all(name in t.dispersion for t in (self, other)):
                disp[name] = [rows[R][0].dispersion[name][rows[R][1]] for R in order]
        meta = {**self.meta, "seconds": round(self.meta.get("seconds", 0) + other.meta.get("seconds", 0), 1),
                "profiled": self.meta.get("profiled", []) + other.meta.get("profiled", [])}
        return CostTable(self.key, order, list(self.tokens), col("target"), col("draft"), col("feed"), col("overhead"),
                         col("depth_overhead") if self.depth_overhead and other.depth_overhead else [], meta, disp)

    @classmethod
    def load(cls, path: str | Path, key: dict | None = None) -> CostTable:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable cost table ({type(e).__name__}: {e})") from None
        missing = [k for k in cls.__dataclass_fields__ if k not in ("meta", "depth_overhead", "dispersion")
                   and k not in raw]
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if missing or unknown:
            raise ValueError(f"{path}: cost table with missing keys {missing} / unknown keys {unknown}")
        table = cls(**raw)
        if key is not None and {k: table.key.get(k) for k in key} != key:
            differ = sorted(k for k in key if table.key.get(k) != key[k])
            raise ConfigError(f"{path}: a cost table profiled for another setup ({', '.join(differ)}: "
                              f"{ {k: table.key.get(k) for k in differ} }, this run: { {k: key[k] for k in differ} }); "
                              "profile this one: python scripts/profile_cost.py, or drop cost_table= to use the "
                              "table of this setup")
        table.meta["path"] = str(path)
        return table


def dispersion(xs: list[float]) -> float:
    """Interquartile range over median of repeated timings (0 for fewer than two)."""
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    med = statistics.median(xs)
    return round((q[2] - q[0]) / med, 4) if med > 0 else 0.0


def _median_ms(fns: dict, reps: int, spread: dict | None = None) -> dict:
    """Each callable ``reps`` times, interleaved (cell order rotating), median milliseconds (``spread``
    gets each cell's :func:`dispersion`)."""
    names = list(fns)
    times: dict = {n: [] for n in names}
    for r in range(reps + 1):  # the first pass warms up
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            fns[n]()
            if fns[n].__dict__.get("cuda"):
                torch.cuda.synchronize()
            if r:
                times[n].append(1e3 * (time.perf_counter() - t0))
    if spread is not None:
        spread.update({n: dispersion(v) for n, v in times.items()})
    return {n: statistics.median(v) for n, v in times.items()}


@torch.inference_mode()
def profile_costs(engine_factory, key: dict, slots=SLOTS, tokens=TOKENS_PER_SLOT, context: int = 128,
                  reps: int = 7, seed: int = 0, log=print) -> CostTable:
    """Measure a :class:`CostTable` with engines from ``engine_factory(slots, policy)`` (a
    :class:`~eagle_backbone.batched_engine.BatchedSpeculativeEngine` with a drafter)."""
    from eagle_backbone.policy import StaticPolicy

    import os

    g = torch.Generator().manual_seed(seed)
    target_ms, draft_ms, feed_ms, overhead_ms, depth_ms = [], [], [], [], []
    disp: dict = {"target": [], "draft": [], "feed": [], "overhead": [], "step": []}
    t_start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    slot_counts = [int(R) for R in slots]  # (the loop below reuses the name ``slots`` for a row list)
    for R in slot_counts:
        eng = engine_factory(R)
        dev, V = eng.device, eng.target.vocab_size
        cuda = dev.type == "cuda"
        ctx = torch.randint(4, V, (R, context), generator=g).to(dev)
        every = list(range(R))
        prefill = RaggedBatch(every, [0] * R, [context] * R, dev)
        ctx = ctx.reshape(-1)
        eng.tm(ctx, prefill, eng.tcache)
        cand = eng.cand  # the drafter kind's bound generator: it says what to run (None: no drafter)
        if cand is not None and not cand.profiles():
            raise ValueError(f"cost profile: candidate generator kind {eng.kind!r} gives the profiler no forwards "
                             "(profile_feed, profile_draft: eagle_backbone/candidates.py); give the policy a cost "
                             "table (cost_table_path=)")
        if cand is not None:
            cand.profile_context(ctx, prefill, g)
        fns = {}

        def target_fn(t):
            tok = torch.randint(4, V, (R * t,), generator=g).to(dev)
            p = RaggedBatch(every, [context] * R, [t] * R, dev)

            def run():
                eng.tm.logits(eng.tm(tok, p, eng.tcache))
            return run

        def feed_fn(t):
            tok = torch.randint(4, V, (R * t,), generator=g).to(dev)
            return cand.profile_feed(tok, RaggedBatch(every, [context] * R, [t] * R, dev), g)

        def draft_fn():
            tok = torch.randint(4, V, (R,), generator=g).to(dev)
            return cand.profile_draft(tok, RaggedBatch(every, [context] * R, [1] * R, dev), g)

        for t in tokens:
            fns[("target", t)] = target_fn(t)
            if cand is not None:
                fns[("feed", t)] = feed_fn(t)
        if cand is not None:
            fns[("draft",)] = draft_fn()
        for f in fns.values():
            f.cuda = cuda
        spread: dict = {}
        med = _median_ms(fns, reps, spread)
        disp["target"].append([spread[("target", t)] for t in tokens])
        disp["feed"].append([spread.get(("feed", t), 0.0) for t in tokens])
        disp["draft"].append(spread.get(("draft",), 0.0))
        target_ms.append([med[("target", t)] for t in tokens])
        feed_ms.append([med.get(("feed", t), 0.0) for t in tokens])
        draft_ms.append(med.get(("draft",), 0.0))
        # the engine's own bookkeeping: measured steps of R slots minus their forwards, plain decoding
        # (gamma 0) and speculative (gamma = depth: the extra a depth adds, drafts and accepts counted)
        prompts = torch.randint(4, V, (R, context), generator=g).tolist()
        spent = {}
        for gamma in (0, 4) if cand is not None else (0,):
            e = engine_factory(R, StaticPolicy(gamma))
            for b in range(R):
                e.admit(b, prompts[b], 5 * (reps + 3), seed=b)
            e.step()
            steps, accepted = [], []
            for _ in range(reps):
                before = [len(e.state[b].new) for b in range(R)]
                t0 = time.perf_counter()
                e.step()
                steps.append(1e3 * (time.perf_counter() - t0))
                accepted.append(sum(len(e.state[b].new) - n for b, n in zip(range(R), before)) / R)
            spent[gamma] = (statistics.median(steps), statistics.mean(accepted))
            spread[("step", gamma)] = dispersion(steps)
        disp["overhead"].append(spread[("step", 0)])
        disp["step"].append(spread.get(("step", 4), 0.0))
        ar_ms = spent[0][0]
        overhead_ms.append(max(0.0, ar_ms - med[("target", 1)]))
        if 4 in spent:
            step_ms, per_row = spent[4]
            t_feed = _interp(list(tokens), feed_ms[-1], per_row)
            forwards = t_feed + 4 * draft_ms[-1] + _interp(list(tokens), target_ms[-1], 5)
            depth_ms.append(max(0.0, (step_ms - forwards - overhead_ms[-1]) / 4))
        log(f"cost profile: {R} slots: target {target_ms[-1][0]:.2f}..{target_ms[-1][-1]:.2f} ms, "
            f"draft depth {draft_ms[-1]:.2f} ms, overhead {overhead_ms[-1]:.2f} ms a step"
            + (f" + {depth_ms[-1]:.2f} ms a depth" if depth_ms else ""))
    seconds = round(time.perf_counter() - t_start, 1)
    meta = {"context": context, "reps": reps, "seconds": seconds,
            "profiled": [{"slots": slot_counts, "seconds": seconds, "load_average_1min": load,
                          "cpu_count": os.cpu_count()}]}
    return CostTable(key, slot_counts, list(tokens), target_ms, draft_ms, feed_ms, overhead_ms, depth_ms, meta, disp)


def table_record(pricing) -> dict | None:
    """The key and file of the costs a policy planned with (``policy.pricing`` of a cost-driven policy after
    binding), for the results that used it; None for a policy without any."""
    from eagle_backbone.step_cost import OnlineCostModel

    costs = None if pricing is None else pricing.costs
    if isinstance(costs, OnlineCostModel):  # the online model: its prior table, and what it has learned
        prior = costs.prior_meta or {}
        return {"key": prior.get("key"), "path": prior.get("path"), "online": True, "records": costs.seen,
                "costs_ms": {k: round(v, 5) for k, v in costs.costs.items()}}
    if not isinstance(costs, CostTable):
        return None
    return {"key": costs.key, "path": (costs.meta or {}).get("path")}


def slots_for(concurrency: int) -> list[int]:
    """The slot counts a run of at most ``concurrency`` sequences in flight needs: the grid's below it, and it."""
    c = int(concurrency)
    return [s for s in SLOTS if s < c] + [c]


def full_key(key: dict, engine_factory) -> dict:
    """``key`` completed with :func:`setup_key` of an engine from ``engine_factory`` (drafter kind and
    weights, attention), where ``key`` lacks them."""
    if engine_factory is None or all(k in key for k in ("drafter_kind", "drafter_sha256", "attn")):
        return dict(key)
    return {**key, **setup_key(engine_factory(1))}


def load_or_profile(cost_dir: str | Path, key: dict, engine_factory, profile_if_missing: bool = True,
                    log=print, slots: list[int] | None = None) -> CostTable:
    """The cached table for ``key`` (completed by :func:`full_key`) under ``cost_dir``, profiling (and caching)
    it when missing: ``slots`` (default the whole grid, :data:`SLOTS`) when given; a cached table that stops
    below the largest of ``slots`` gets the larger ones profiled and merged in (it would extrapolate)."""
    key = full_key(key, engine_factory)
    path = table_path(cost_dir, key)
    want = sorted(set(int(s) for s in (slots or SLOTS)))
    if path.is_file():
        table = CostTable.load(path, key)
        missing = [s for s in want if s > max(table.slots)]  # between grid points the table interpolates
        if slots is None or not missing:
            return table
        if not profile_if_missing:
            raise ConfigError(f"{path}: the cost table has slot counts {table.slots}, this run needs {missing} too: "
                              "run python scripts/profile_cost.py slots=[...] (or profile_if_missing=true)")
        log(f"cost table {path}: profiling the slot counts {missing} this run needs too")
        table = table.merged(profile_costs(engine_factory, key, slots=missing, log=log))
        table.save(path)
        return table
    if not profile_if_missing:
        raise ConfigError(f"no cost table at {path} for {key}: run python scripts/profile_cost.py "
                          "(or let the policy profile it: profile_if_missing=true)")
    log(f"no cost table at {path}: profiling this setup once for slot counts {want} "
        "(python scripts/profile_cost.py does the same)")
    table = profile_costs(engine_factory, key, slots=want, log=log)
    table.save(path)
    return table


@torch.inference_mode()
def check_costs(table: CostTable, engine_factory, prompts: list[list[int]], slots=(1, 4, 16, 32), gammas=(0, 1, 2, 4),
                steps: int = 12, max_new_tokens: int = 48) -> list[dict]:
    """The table's predicted step times against measured ones: for each R in ``slots`` and static γ in
    ``gammas``, real prompts decode R at a time (a finished one's slot takes the next) and ``steps`` steps with
    all R running and none prefilling are timed (median). Predicted: :meth:`CostTable.step_ms` (overhead +
    target(R, R(γ+1)) + (feed(R, tokens a row emitted) + γ draft depths when γ > 0)). Returns rows with both
    and the tokens per millisecond each implies, so that a reader sees whether the table ranks the γs as
    the machine does."""
    from eagle_backbone.policy import StaticPolicy

    rows = []
    for R in slots:
        if R > len(prompts):
            continue
        for g in gammas:
            eng = engine_factory(R, StaticPolicy(g))
            for b in range(R):
                eng.admit(b, prompts[b], max_new_tokens, seed=b)
            eng.step()
            times, emitted, nxt = [], [], R
            for _ in range(4 * steps):
                if len(times) >= steps:
                    break
                free = eng.free_slots()
                if free:  # a sequence ended: its slot takes the next prompt; the step that prefills it is not timed
                    if nxt + len(free) > len(prompts):
                        break
                    for b in free:
                        eng.admit(b, prompts[nxt], max_new_tokens, seed=nxt)
                        nxt += 1
                    eng.step()
                    continue
                run = eng.running()
                before = sum(len(eng.state[b].new) for b in run)
                t0 = time.perf_counter()
                eng.step()
                times.append(1e3 * (time.perf_counter() - t0))
                emitted.append((sum(len(eng.state[b].new) for b in run) - before) / R)
            if not times:
                continue
            ms, per_row = statistics.median(times), statistics.mean(emitted)
            pred = table.step_ms(R, [R] * g, R * (g + 1), per_row)
            rows.append({"slots": R, "gamma": g, "measured_ms": ms, "predicted_ms": pred, "tokens_per_row": per_row,
                         "measured_tokens_per_ms": R * per_row / ms, "predicted_tokens_per_ms": R * per_row / pred})
    return rows
