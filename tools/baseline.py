"""The monolithic baseline users would pick: optimum-intel export + openvino_genai.LLMPipeline.

optimum-intel 2.2.0 caps transformers < 5.6 and requires torchvision (which drags in a CUDA
torch), so the export runs in a separate, cached venv (``ensure_baseline_venv``) holding a
pinned CPU torch and optimum/optimum-intel installed with ``--no-deps`` plus their real
runtime deps; torchvision is only needed by optimum's vision-language paths. The exported
directory is then run *in this environment* with openvino_genai (``BaselinePipeline``), so
benchmarks can interleave it run by run with our shards under the same CPU hints.

``GenaiUsers`` serves N users with one LLMPipeline taking them in turn and a
ContinuousBatchingPipeline (``tools.baseline_batching``) serving them at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.baseline_batching import (
    STREAM_PROMPTS,
    ContinuousBatchingBaseline,
    sequential_throughput,
)
from tools.bench_common import genai_greedy_config, genai_token_ids

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
