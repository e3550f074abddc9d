"""The baseline: openvino_genai on the monolithic export users would pick (optimum-intel).

optimum-intel 2.2.0 caps transformers < 5.6 and requires torchvision (which drags in a CUDA
torch), so the export runs in a separate, cached venv (``ensure_baseline_venv``) holding a
pinned CPU torch and optimum/optimum-intel installed with ``--no-deps`` plus their real
runtime deps; torchvision is only needed by optimum's vision-language paths. The exported
directory is then run *in this environment* with openvino_genai, so benchmarks can
interleave it run by run with our shards under the same CPU hints:

- ``BaselinePipeline``: an LLMPipeline built once and timed many times (greedy), or
  streamed with every token stamped;
- ``ContinuousBatchingBaseline``: a ContinuousBatchingPipeline serving N requests at once,
  stepped here (``step_requests``), every step timestamped (``stream_throughput``);
- ``GenaiUsers``: N users served one after another by the LLMPipeline
  (``sequential_throughput``) and at once by continuous batching;
- ``GenaiServer``: continuous batching serving a request set to N concurrent clients,
  recorded as tools.harness.load records an HTTP stream.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.harness.load import LevelRun, RequestRecord, ServeRequest

if TYPE_CHECKING:
    from rich.console import Console

# Installed with dependencies. torch is pinned to the CPU build served locally; an unpinned
# torch (or one pulled by torchvision) is a multi-GB CUDA build.
BASELINE_SPEC: tuple[str, ...] = (
    "torch==2.13.0",
    "transformers==5.5.4",
    "huggingface-hub>=0.23.2,<1.22",
    "nncf==3.4.0",
    "openvino==2026.4.1",
    "openvino-tokenizers==2026.4.1",
    "requests>=2.33,<3",
    "setuptools",
    "packaging",
    "numpy",
)
# Installed with --no-deps: their declared deps include torchvision.
BASELINE_NO_DEPS: tuple[str, ...] = ("optimum-intel==2.2.0", "optimum==2.3.0")
WEIGHT_FORMATS = ("int4", "int8", "fp16", "fp32")
MARKER = "zctl-baseline.json"
_WARMUP_TEXT = "The quick brown fox jumps over the lazy dog while the band plays on. "
_SMOKE = (
    "import importlib.util, json, torch, transformers, nncf, openvino, openvino_tokenizers\n"
    "import optimum.exporters.openvino, optimum.intel\n"
    "assert torch.version.cuda is None, 'CUDA torch installed: ' + torch.__version__\n"
    "assert importlib.util.find_spec('torchvision') is None, 'torchvision installed'\n"
    "print(json.dumps({m.__name__: m.__version__ for m in (torch, transformers, nncf)}))\n"
)


# -- the monolithic export, in the baseline venv ------------------------------------------------


def genai_greedy_config(genai: Any, max_new_tokens: int) -> Any:
    """An openvino_genai GenerationConfig for exactly ``max_new_tokens`` greedy tokens."""
    cfg = genai.GenerationConfig()
    cfg.max_new_tokens = max_new_tokens
    cfg.do_sample = False
    cfg.ignore_eos = True
    return cfg


def genai_token_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as an openvino_genai tokenizer makes them (no chat template)."""
    return [int(t) for t in tokenizer.encode(prompt).input_ids.data[0]]


def cache_root(cache_dir: Path | None = None) -> Path:
    """``cache_dir``, else $ZCTL_CACHE_DIR, else ~/.cache/zctl."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("ZCTL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "zctl"


def _say(console: Console | None, msg: str) -> None:
    if console is not None:
        console.print(f"[bold cyan]baseline[/] {msg}")


def _spec_record() -> dict[str, Any]:
    return {"spec": list(BASELINE_SPEC), "no_deps": list(BASELINE_NO_DEPS),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def _clean_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def _run(cmd: list[str], env: dict[str, str], what: str) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if "is ignored: it is neither" not in ln]
        # Start at the last raised exception if any (its message may be followed by a long list)
        errs = [i for i, ln in enumerate(lines) if re.match(r"[\w.]+(Error|Exception)\b", ln)]
        start = errs[-1] if errs else max(0, len(lines) - 30)
        tail = "\n".join(lines[start : start + 30]) or proc.stdout[-3000:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def ensure_baseline_venv(cache_dir: Path | None = None, console: Console | None = None) -> Path:
    """Create (once) the optimum-intel venv and return its directory.

    A marker file records the installed spec; a changed spec or Python rebuilds the venv.
    """
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    venv = root / "baseline-venv"
    want = _spec_record()
    with open(root / "baseline-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time
        try:
            if json.loads((venv / MARKER).read_text())["spec_record"] == want:
                return venv
        except (OSError, ValueError, KeyError):
            pass
        start = time.perf_counter()
        if venv.exists():
            _say(console, f"spec changed or build incomplete: removing {venv}")
            shutil.rmtree(venv)
        _say(console, f"creating venv {venv}")
        _run([sys.executable, "-m", "venv", str(venv)], _clean_env(venv), "python -m venv")
        env = _clean_env(venv)
        py = str(venv / "bin" / "python")
        constraints = venv / "zctl-constraints.txt"
        # nothing may move torch off the CPU pin (--no-compile: ~1 min less CPU)
        constraints.write_text("".join(f"{s}\n" for s in BASELINE_SPEC if s.startswith("torch")))
        pip = [py, "-m", "pip", "install", "--no-input", "--disable-pip-version-check",
               "--no-compile", "-c", str(constraints)]
        _say(console, "installing torch (CPU), transformers<5.6, nncf, openvino (~2 min)")
        _run([*pip, *BASELINE_SPEC], env, "pip install of the baseline stack")
        _say(console, f"installing {' '.join(BASELINE_NO_DEPS)} with --no-deps")
        _run([*pip, "--no-deps", *BASELINE_NO_DEPS], env, "pip install of optimum-intel")
        versions = json.loads(_run([py, "-c", _SMOKE], env, "baseline venv smoke test"))
        took = time.perf_counter() - start
        record = {"spec_record": want, "versions": versions, "build_s": round(took, 1)}
        (venv / MARKER).write_text(json.dumps(record, indent=1))
        _say(console, f"venv ready in {took:.0f} s: {versions}")
        return venv


def default_group_size(hf_dir: Path) -> int:
    """optimum's default INT4 group (128), or the largest of 64/32 dividing the layer widths."""
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    dims = [cfg.get(k) for k in ("hidden_size", "intermediate_size")]
    for g in (128, 64, 32):
        if all(isinstance(d, int) and d % g == 0 for d in dims):
            return g
    return -1  # per-channel


def _hf_dir_key(hf_dir: Path) -> str:
    h = hashlib.sha256(str(hf_dir.resolve()).encode())
    for f in sorted(p for p in hf_dir.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(hf_dir)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def export_baseline(hf_dir: Path, weight_format: str = "int4", group_size: int | None = None,
                    out_dir: Path | None = None, *, sym: bool = False,
                    cache_dir: Path | None = None, console: Console | None = None) -> Path:
    """Export ``hf_dir`` with ``optimum-cli export openvino`` in the baseline venv (cached).

    INT4 is optimum's default asym (``sym=True`` for sym) with ``--ratio 1.0``; ``group_size``
    None picks :func:`default_group_size`. Without ``out_dir`` the export lands under
    <cache>/baseline-exports/. Returns the dir holding openvino_model.xml and the
    (de)tokenizer IRs; re-exports only when the HF dir (names, sizes, mtimes), the options
    or the venv spec changed.
    """
    hf_dir = Path(hf_dir)
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, not {weight_format!r}")
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    args = ["--task", "text-generation-with-past", "--weight-format", weight_format]
    if weight_format == "int4":
        group_size = default_group_size(hf_dir) if group_size is None else group_size
        args += ["--group-size", str(group_size), "--ratio", "1.0"] + (["--sym"] if sym else [])
    else:
        group_size = None
    key = hashlib.sha256(json.dumps([_hf_dir_key(hf_dir), args, _spec_record()]).encode())
    key_hex = key.hexdigest()[:16]
    if out_dir is None:
        tag = weight_format + (f"-g{group_size}" if group_size else "") + ("-sym" if sym else "")
        out_dir = cache_root(cache_dir) / "baseline-exports" / f"{hf_dir.name}-{tag}-{key_hex}"
    out_dir = Path(out_dir)
    stamp = out_dir / "zctl-baseline-export.json"
    if (out_dir / "openvino_model.xml").is_file() and stamp.is_file():
        if json.loads(stamp.read_text()).get("key") == key_hex:
            return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not stamp.is_file():
        raise RuntimeError(f"{out_dir} is not empty and not a baseline export: not overwriting")
    venv = ensure_baseline_venv(cache_dir, console)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(venv / "bin" / "optimum-cli"), "export", "openvino", "--model", str(hf_dir),
           *args, str(tmp)]
    _say(console, f"exporting {hf_dir.name} as {weight_format}: {' '.join(args)}")
    start = time.perf_counter()
    try:
        _run(cmd, _clean_env(venv), f"optimum-cli export of {hf_dir}")
        missing = [n for n in ("openvino_model.xml", "openvino_tokenizer.xml",
                               "openvino_detokenizer.xml") if not (tmp / n).is_file()]
        if missing:
            raise RuntimeError(f"optimum-cli export of {hf_dir} did not write {missing}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    took = time.perf_counter() - start
    (tmp / stamp.name).write_text(json.dumps({"key": key_hex, "hf_dir": str(hf_dir.resolve()),
                                              "args": args, "export_s": round(took, 1)}))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    _say(console, f"exported to {out_dir} in {took:.0f} s")
    return out_dir


# -- one user at a time: LLMPipeline -----------------------------------------------------------


class BaselinePipeline:
    """An openvino_genai.LLMPipeline built once and timed many times (greedy, ignore_eos).

    ``config`` is passed as plugin properties, e.g. ``{"INFERENCE_PRECISION_HINT": "f32",
    "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": 2}``; openvino_genai also reads
    ``ATTENTION_BACKEND`` ("PA" / "SDPA") from it.
    """

    def __init__(self, model_dir: Path, config: dict[str, Any] | None = None,
                 device: str = "CPU", warmup_tokens: int = 4, huge_pages: bool = False) -> None:
        """``huge_pages``: give the pipeline's memory (weights, and the KV cache its warm-up
        allocates) the huge pages zctl's stage runners get (dataplane.runtime.hugepages), for a
        like-for-like reading; users running openvino_genai get 4 KB pages."""
        import openvino_genai as ov_genai

        from dataplane.runtime.hugepages import HugePageScope

        self._genai = ov_genai
        with HugePageScope() if huge_pages else nullcontext() as scope:
            start = time.perf_counter()
            self.pipe = ov_genai.LLMPipeline(str(model_dir), device, **(config or {}))
            self.load_s = time.perf_counter() - start
            self.tokenizer = self.pipe.get_tokenizer()
            if warmup_tokens > 0:  # first prompts pay one-off kernel compilation (~0.6 s TTFT)
                ids = self.encode(_WARMUP_TEXT * 4)
                for n in (4, 32):  # a short and a longer prompt: each length class compiles once
                    self.generate_timed(ids[:n], warmup_tokens)
        self.huge_page_bytes = scope.collapsed if scope is not None else 0

    def encode(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` as the pipeline tokenizes it (no chat template)."""
        return genai_token_ids(self.tokenizer, prompt)

    def generate_timed(self, prompt: str | Sequence[int], max_new_tokens: int) -> dict[str, Any]:
        """Generate exactly ``max_new_tokens`` greedy tokens; returns timings and token ids.

        A str prompt is tokenized by the pipeline's tokenizer without a chat template; pass
        ids to feed the very same input as another system.
        """
        import numpy as np
        import openvino as ov

        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        cfg = genai_greedy_config(self._genai, max_new_tokens)
        arr = np.asarray([ids], dtype=np.int64)
        inputs = self._genai.TokenizedInputs(ov.Tensor(arr), ov.Tensor(np.ones_like(arr)))
        start = time.perf_counter()
        res = self.pipe.generate(inputs, cfg)
        wall = time.perf_counter() - start
        pm = res.perf_metrics
        return {"tok_s": float(pm.get_throughput().mean), "tpot_ms": float(pm.get_tpot().mean),
                "ttft_ms": float(pm.get_ttft().mean), "wall_ms": wall * 1000.0,
                "n_input": len(ids), "n_generated": int(pm.get_num_generated_tokens()),
                "tokens": [int(t) for t in res.tokens[0]]}

    def stream(self, ids: Sequence[int], max_new_tokens: int) -> tuple[RequestRecord, list[int]]:
        """Generate exactly ``max_new_tokens`` greedy tokens from ``ids``, each stamped as the
        pipeline's streamer receives it (a chunk of the record): the record and the
        generated ids. An error is recorded, not raised."""
        genai = self._genai
        record = RequestRecord(prompt_tokens=len(ids), usage=True)

        class Stamps(genai.StreamerBase):
            def write(self, token: Any) -> Any:
                record.chunk_times.append(time.perf_counter())
                return genai.StreamingStatus.RUNNING

            def end(self) -> None:
                pass

        inputs = genai.TokenizedInputs(_ids_tensor(ids), _ids_tensor([1] * len(ids)))
        out: list[int] = []
        record.start = time.perf_counter()
        try:
            result = self.pipe.generate(inputs, genai_greedy_config(genai, max_new_tokens),
                                        Stamps())
            out = [int(t) for t in result.tokens[0]]
            record.completion_tokens = len(out)
        except Exception as exc:  # noqa: BLE001 (recorded)
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.end = time.perf_counter()
        return record, out


def _ids_tensor(ids: Sequence[int]) -> Any:
    """``ids`` as the [1, N] int64 tensor openvino_genai takes."""
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.asarray([list(ids)], dtype=np.int64))


def export_baseline_like(hf_dir: Path, export_dir: Path, weights: str,
                         console: Console | None = None) -> Path:
    """The monolithic optimum-intel export of ``hf_dir`` in ``weights`` with the INT4 group
    size of zctl's export ``export_dir``: what the other side of a comparison runs."""
    from zctl.manifest import load_manifest

    return export_baseline(hf_dir, weights, load_manifest(export_dir).group_size,
                           console=console)


# -- N users: one after another, or at once by continuous batching -----------------------------

# Distinct openers, one per concurrent user (N streams take the first N).
STREAM_PROMPTS: tuple[str, ...] = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a steam engine turns heat into motion, step by step.",
    "The history of the printing press begins in fifteenth-century Mainz, where",
    "List the planets of the solar system and one surprising fact about each.",
    "Describe a busy morning market in a small coastal town.",
    "Give three tips for someone learning to play the violin as an adult.",
    "Why do leaves change colour in autumn? Answer for a ten-year-old.",
    "Draft a polite email asking a neighbour to move their bicycle.",
)


def stream_throughput(step_s: Sequence[float],
                      step_tokens: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Aggregate and per-stream throughput of N streams served by one stepped batch.

    ``step_s[i]`` is when step i ended (seconds since the requests were submitted, so
    wall = ``step_s[-1]``); ``step_tokens[i][j]`` is how many tokens stream j received in
    step i. Prefill is separated by time: ``prefill_s`` ends at the step in which the last
    stream received its first token, and the decode aggregate counts only tokens of later
    steps over ``decode_s = wall - prefill_s``. Per stream, decode tok/s is (tokens after its
    first) / (last token - first token) and ``ttft_ms`` is its first-token time.
    """
    if not step_s or len(step_s) != len(step_tokens):
        raise ValueError("need one token row per step, and at least one step")
    n = len(step_tokens[0])
    if n == 0 or any(len(row) != n for row in step_tokens):
        raise ValueError("every step row needs one count per stream")
    first: list[int | None] = [None] * n
    last = [0] * n
    for i, row in enumerate(step_tokens):
        for j, k in enumerate(row):
            if k:
                first[j] = i if first[j] is None else first[j]
                last[j] = i
    if any(f is None for f in first):
        raise ValueError("a stream received no token")
    firsts = [f for f in first if f is not None]
    per_stream = [sum(row[j] for row in step_tokens) for j in range(n)]
    wall = float(step_s[-1])
    prefill_end = max(firsts)
    prefill_s = float(step_s[prefill_end])
    decode_s = wall - prefill_s
    decode_tokens = sum(sum(row) for row in step_tokens[prefill_end + 1:])
    stream_tok_s = []
    for j, f in enumerate(firsts):
        span = float(step_s[last[j]] - step_s[f])
        after = per_stream[j] - step_tokens[f][j]
        stream_tok_s.append(after / span if span > 0 else 0.0)
    total = sum(per_stream)
    return {"streams": n, "tokens": total, "stream_tokens": per_stream, "wall_s": wall,
            "prefill_s": prefill_s, "decode_s": decode_s, "decode_tokens": decode_tokens,
            "aggregate_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "aggregate_incl_prefill_tok_s": total / wall if wall > 0 else 0.0,
            "per_stream_tok_s": stream_tok_s,
            "ttft_ms": [float(step_s[f]) * 1000.0 for f in firsts]}


def sequential_throughput(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The same summary for N users served one after another (one LLMPipeline).

    ``runs`` are ``tools.harness.baseline.BaselinePipeline.generate_timed`` results, one per user. Each run's
    prefill is its TTFT, so decode = wall - TTFT; the decode aggregate equals a single
    user's decode rate (aggregate throughput does not grow with N, latency does).
    """
    if not runs:
        raise ValueError("no runs")
    walls = [r["wall_ms"] / 1000.0 for r in runs]
    prefills = [r["ttft_ms"] / 1000.0 for r in runs]
    gen = [int(r["n_generated"]) for r in runs]
    decode_s = sum(w - p for w, p in zip(walls, prefills, strict=True))
    decode_tokens = sum(g - 1 for g in gen)  # the first token of each run comes from prefill
    wall = sum(walls)
    starts = [sum(walls[:j]) for j in range(len(runs))]  # user j waits for users < j
    return {"streams": len(runs), "tokens": sum(gen), "stream_tokens": gen, "wall_s": wall,
            "prefill_s": sum(prefills), "decode_s": decode_s, "decode_tokens": decode_tokens,
            "aggregate_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "aggregate_incl_prefill_tok_s": sum(gen) / wall if wall > 0 else 0.0,
            "per_stream_tok_s": [(g - 1) / (w - p) if w > p else 0.0
                                 for g, w, p in zip(gen, walls, prefills, strict=True)],
            "ttft_ms": [(s + p) * 1000.0 for s, p in zip(starts, prefills, strict=True)]}


class ContinuousBatchingBaseline:
    """openvino_genai.ContinuousBatchingPipeline serving N concurrent greedy requests.

    The micro-batching baseline: same export and plugin ``props`` as
    ``BaselinePipeline`` (``ATTENTION_BACKEND`` is dropped: continuous batching is always
    paged attention).
    The scheduler gets a fixed KV cache of ``cache_gb`` GB, no prefix caching unless
    ``prefix_caching`` (so repeated prompts pay their prefill every run) and the default
    256-token batch budget with dynamic split-fuse. :meth:`measure` drives ``step()``
    itself and timestamps every step, so prefill and decode are split by time (see
    :func:`stream_throughput`).
    """

    def __init__(self, model_dir: Path, props: dict[str, Any] | None = None, device: str = "CPU",
                 cache_gb: int = 1, max_num_seqs: int = 16, warmup_streams: int = 4,
                 prefix_caching: bool = False) -> None:
        import openvino_genai as ov_genai

        self._genai = ov_genai
        sched = ov_genai.SchedulerConfig()
        sched.cache_size = cache_gb
        sched.max_num_seqs = max_num_seqs
        sched.enable_prefix_caching = prefix_caching
        sched.dynamic_split_fuse = True
        self.props = {k: v for k, v in (props or {}).items() if k != "ATTENTION_BACKEND"}
        start = time.perf_counter()
        self.pipe = ov_genai.ContinuousBatchingPipeline(str(model_dir), sched, device, self.props)
        self.load_s = time.perf_counter() - start
        self.tokenizer = self.pipe.get_tokenizer()
        if warmup_streams > 0:  # first steps pay one-off kernel compilation (~0.5 s)
            prompts = [self.encode(p) for p in STREAM_PROMPTS[:warmup_streams]]
            self.measure(prompts, 8)
            self.measure(prompts[:1], 8)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` (no chat template), as ``BaselinePipeline.encode``."""
        return genai_token_ids(self.tokenizer, prompt)

    def submit(self, ids: Sequence[int], max_new_tokens: int, config: Any = None,
               index: int = 0) -> LiveRequest:
        """Add a request of ``ids`` for exactly ``max_new_tokens`` greedy tokens (or per
        ``config``, a GenerationConfig), sent now."""
        return submit(self.pipe, ids, config or genai_greedy_config(self._genai, max_new_tokens),
                      index)

    def measure(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                max_new_tokens: int) -> dict[str, Any]:
        """Submit one request per prompt at once, step until all finish, summarise.

        Every request generates exactly ``max_new_tokens`` greedy tokens (ignore_eos).
        Returns :func:`stream_throughput`'s dict plus ``token_ids`` (per stream) and
        ``n_input`` (prompt lengths); ``aggregate_tok_s`` is the decode-only aggregate.
        """
        ids = [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        if not ids:
            raise ValueError("no prompts")
        start = time.perf_counter()
        requests = [self.submit(x, max_new_tokens) for x in ids]
        live = list(requests)
        step_s: list[float] = []
        step_tokens: list[list[int]] = []
        while live:
            before = [len(r.ids) for r in requests]
            live = step_requests(self.pipe, live)
            step_s.append(time.perf_counter() - start)
            step_tokens.append([len(r.ids) - b for r, b in zip(requests, before, strict=True)])
        bad = [j for j, r in enumerate(requests) if len(r.ids) != max_new_tokens]
        if bad:
            raise RuntimeError(f"streams {bad} stopped early "
                               f"({[r.record.error for r in requests]}): KV cache too small?")
        return {**stream_throughput(step_s, step_tokens), "token_ids": [r.ids for r in requests],
                "n_input": [len(x) for x in ids]}


class GenaiUsers:
    """openvino_genai serving N users on one export: one LLMPipeline taking them in turn
    (:meth:`sequential`) and a ContinuousBatchingPipeline serving them at once
    (:meth:`concurrent`), the same prompts (as token ids of the LLMPipeline's tokenizer)
    on both; user j gets prompt j (cycled)."""

    def __init__(self, model_dir: Path, props: dict[str, Any] | None = None,
                 prompts: Sequence[str] = STREAM_PROMPTS, warmup_streams: int = 4) -> None:
        self.single = BaselinePipeline(model_dir, props)
        self.batched = ContinuousBatchingBaseline(model_dir, props, warmup_streams=warmup_streams)
        self.ids = [self.single.encode(p) for p in prompts]

    def _users(self, n: int) -> list[list[int]]:
        return [self.ids[i % len(self.ids)] for i in range(n)]

    def sequential(self, n: int, max_new_tokens: int) -> dict[str, Any]:
        """N users one after another on the LLMPipeline (``sequential_throughput``)."""
        return sequential_throughput([self.single.generate_timed(x, max_new_tokens)
                                      for x in self._users(n)])

    def concurrent(self, n: int, max_new_tokens: int) -> dict[str, Any]:
        """N concurrent requests on the ContinuousBatchingPipeline."""
        return self.batched.measure(self._users(n), max_new_tokens)


class GenaiServer:
    """A ContinuousBatchingPipeline on the monolithic export at ``model_dir`` serving
    :class:`ServeRequest` s to N concurrent clients, the baseline of tools.serving.serve.

    This thread drives ``add_request`` + ``step()`` (``serve_on``): N requests are in flight
    from the start, and as soon as a step ends one of them, the next request of the set is
    added (the client whose request ended sends its next one). Every token read after a
    step is stamped with that step's end, so TTFT, inter-token gaps and end-to-end latency
    are recorded per request as tools.harness.load records them from an HTTP stream (a
    step delivering several tokens to a request is one chunk). The pipeline is set up as
    ``ContinuousBatchingBaseline`` (same export, plugin properties, KV cache and
    scheduler); ``export_dir`` (a zctl export of the same model) gives the tokenizer and
    chat template, so both systems see the same input ids; generation is greedy with the
    same ``max_tokens``, stopping at the same EOS token. ``prefix_caching``: its scheduler
    keeps prompts' KV for later requests, as zctl's prefix cache does."""

    def __init__(self, model_dir: Path, export_dir: Path, props: dict[str, Any] | None = None,
                 max_num_seqs: int = 16, warmup_streams: int = 4,
                 prefix_caching: bool = False) -> None:
        from zctl.engine.tokenizer import ChatTokenizer

        self.baseline = ContinuousBatchingBaseline(model_dir, props, max_num_seqs=max_num_seqs,
                                                   warmup_streams=warmup_streams,
                                                   prefix_caching=prefix_caching)
        self.pipe = self.baseline.pipe
        self.tokenizer = ChatTokenizer(export_dir)
        self.eos_token_id = self.tokenizer.eos_token_id
        self._ids: dict[str, list[int]] = {}

    def prompt_ids(self, request: ServeRequest) -> list[int]:
        """The request's chat-templated token ids (cached by prompt)."""
        if request.prompt not in self._ids:
            self._ids[request.prompt] = self.tokenizer.encode(request.prompt, chat=True)
        return self._ids[request.prompt]

    def config(self, max_tokens: int) -> Any:
        """Greedy, at most ``max_tokens`` new tokens, stopping at the export's EOS."""
        import openvino_genai as ov_genai

        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = max_tokens
        cfg.do_sample = False
        if self.eos_token_id is not None:
            cfg.eos_token_id = self.eos_token_id
        return cfg

    def serve(self, requests: Sequence[ServeRequest], concurrency: int) -> LevelRun:
        """Serve ``requests`` with ``concurrency`` in flight (see the class's docstring)."""
        return serve_on(self.pipe, requests, concurrency, self.prompt_ids, self.config)


def serve_on(pipe: Any, requests: Sequence[ServeRequest], concurrency: int,
             prompt_ids: Callable[[ServeRequest], list[int]],
             config: Callable[[int], Any]) -> LevelRun:
    """Drive ``pipe`` (a ContinuousBatchingPipeline: add_request, step, handles) through
    ``requests`` with ``concurrency`` of them in flight; ``config(max_tokens)`` is each
    request's GenerationConfig. A failing step ends every live request with an error and
    leaves the rest unsent (errors too)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = deque(requests)

    def send(request: ServeRequest) -> LiveRequest:
        return submit(pipe, prompt_ids(request), config(request.max_tokens), request.index)

    start = time.perf_counter()
    live = [send(pending.popleft()) for _ in range(min(concurrency, len(pending)))]
    done: list[RequestRecord] = []
    while live:
        try:
            still = step_requests(pipe, live)
        except StepFailed:  # counted: every live request failed
            done += [r.record for r in live]
            break
        for request in live:
            if request not in still:
                done.append(request.record)
                if pending:  # its client sends the next request of the set
                    still.append(send(pending.popleft()))
        live = still
    for request in pending:  # never sent: the pipeline failed
        done.append(RequestRecord(request.index, start, end=start, error="not served"))
    end = max((r.end for r in done), default=start)
    return LevelRun(concurrency, sorted(done, key=lambda r: r.index), end - start)


# -- continuous batching, stepped here ---------------------------------------------------------

REQUEST_IDS = itertools.count()  # a ContinuousBatchingPipeline's request ids, never reused


class StepFailed(RuntimeError):
    """A ContinuousBatchingPipeline's step raised: every live request ended with an error."""


@dataclass(eq=False)
class LiveRequest:
    """A request in a ContinuousBatchingPipeline: its handle, its record (a chunk per step
    that gave it tokens, stamped with the step's end) and the token ids it got."""

    handle: Any
    record: RequestRecord
    ids: list[int] = field(default_factory=list)


def submit(pipe: Any, ids: Sequence[int], config: Any, index: int = 0) -> LiveRequest:
    """Add a request of ``ids`` with ``config`` (a GenerationConfig) to ``pipe``, sent now."""
    record = RequestRecord(index, time.perf_counter(), prompt_tokens=len(ids), usage=True)
    return LiveRequest(pipe.add_request(next(REQUEST_IDS), _ids_tensor(ids), config), record)


def step_requests(pipe: Any, live: Sequence[LiveRequest]) -> list[LiveRequest]:
    """One step of ``pipe``: the tokens each live request got are one chunk of its record,
    stamped with the step's end; a request that stopped running gets its end (and an error
    unless it FINISHED). The ones still running are returned. StepFailed, after every live
    request got the error, if the step raised."""
    import openvino_genai as ov_genai

    try:
        pipe.step()
    except Exception as exc:  # noqa: BLE001 (every live request failed)
        now = time.perf_counter()
        for request in live:
            request.record.error = f"step failed: {type(exc).__name__}: {exc}"[:300]
            request.record.end = now
        raise StepFailed(str(exc)) from exc
    now = time.perf_counter()
    still = []
    for request in live:
        got: list[int] = []
        while request.handle.can_read():  # settled: step() ran in this thread
            got += [int(t) for out in request.handle.read().values() for t in out.generated_ids]
        if got:
            request.record.chunk_times.append(now)
            request.record.completion_tokens += len(got)
            request.ids += got
        status = request.handle.get_status()
        if status == ov_genai.GenerationStatus.RUNNING:
            still.append(request)
            continue
        request.record.end = now
        if status != ov_genai.GenerationStatus.FINISHED:
            request.record.error = f"status {status.name}"
    return still
