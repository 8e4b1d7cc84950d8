"""What every suite shares: timing, peak memory, errors, environment, results files.

Timing is ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")`` on a CUDA
device. Without CUDA (``--quick`` smoke runs) a plain wall-clock median stands in; those
figures only show that the pipeline works and are labelled as such.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIB = float(1 << 20)

PASS = "✓"
FAIL = "✗"


# ----------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class TimingSettings:
    """How long to warm up and repeat each timed function (milliseconds of work)."""

    warmup_ms: float = 100.0
    rep_ms: float = 1000.0


def uses_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def median_ms(fn: Callable[[], Any], device: torch.device | str, timing: TimingSettings) -> float:
    """Median wall time of ``fn()`` in milliseconds.

    CUDA: ``triton.testing.do_bench(..., return_mode="median")`` (CUDA events, L2 flushed
    between calls). Elsewhere: a wall-clock median, good for smoke runs only.
    """
    if uses_cuda(device):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms, return_mode="median"))
    return _wall_clock_median_ms(fn, timing)


def _wall_clock_median_ms(fn: Callable[[], Any], timing: TimingSettings) -> float:
    """Median of ~rep_ms worth of calls; a call slower than rep_ms is timed once."""
    start = time.perf_counter()
    fn()
    first_ms = (time.perf_counter() - start) * 1e3
    if first_ms >= timing.rep_ms:
        return first_ms
    estimate_ms = max(first_ms, 1e-3)
    for _ in range(min(100, int(timing.warmup_ms / estimate_ms))):
        fn()
    samples = []
    for _ in range(max(1, min(1000, int(timing.rep_ms / estimate_ms)))):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def median_ms_fixed(fn: Callable[[], Any], device: torch.device | str, reps: int) -> float:
    """Median of exactly ``reps`` timed calls of ``fn`` in milliseconds, for slow functions.

    ``do_bench`` runs a function at least eight times (one call, five for its estimate, then
    warm-up and repetitions): too many for calls of seconds. Here each call is timed on its
    own, between CUDA events with the device synchronized before it (wall clock without
    CUDA); no L2 flush, which a call of ≥ 100 ms does not notice. The caller warms up.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    samples = []
    for _ in range(reps):
        if uses_cuda(device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(float(start.elapsed_time(end)))
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def call_ms(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Wall time of one synchronized call of ``fn`` in ms (its result is dropped)."""
    synchronize(device)
    begin = time.perf_counter()
    output = fn()
    synchronize(device)
    elapsed = (time.perf_counter() - begin) * 1e3
    del output
    return elapsed


def synchronize(device: torch.device | str) -> None:
    if uses_cuda(device):
        torch.cuda.synchronize(device)


def release_memory(device: torch.device | str) -> None:
    """Drop garbage and cached blocks so the next measurement starts clean."""
    gc.collect()
    if uses_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def peak_extra_mib(
    fn: Callable[[], Any], device: torch.device | str, accounted_bytes: int = 0
) -> float | None:
    """Peak device memory of one ``fn()`` call above what was allocated before it, in MiB.

    ``(max_memory_allocated during the call − memory_allocated just before it −
    accounted_bytes) / 2^20``, where ``accounted_bytes`` is memory the caller counts as
    output (e.g. the gradient buffers a training step must hold anyway). Everything
    ``fn`` returns is kept alive until the peak is read. ``None`` without CUDA.
    """
    if not uses_cuda(device):
        return None
    release_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    output = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del output
    return (peak - before - accounted_bytes) / MIB


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return "out of memory" in str(error).lower()


def matmul_tflops(
    device: torch.device | str, size: int, timing: TimingSettings, dtype: torch.dtype
) -> dict[str, Any]:
    """Measured matmul rate: ``size``³ random ``dtype`` product, median time → TFLOP/s."""
    generator = torch.Generator(device=device)
    generator.manual_seed(1234)
    a = torch.randn(size, size, generator=generator, device=device).to(dtype)
    b = torch.randn(size, size, generator=generator, device=device).to(dtype)
    ms = median_ms(lambda: torch.mm(a, b), device, timing)
    return {
        "size": size,
        "dtype": dtype_name(dtype),
        "ms": ms,
        "tflops": 2.0 * size**3 / (ms * 1e-3) / 1e12,
    }


# ----------------------------------------------------------------------------- errors


def relative_l2_error(actual: Tensor, reference: Tensor, rows_per_chunk: int = 0) -> float:
    """``‖actual − reference‖₂ / ‖reference‖₂`` in float64, a block of rows at a time.

    Chunking keeps the float64 temporaries small (a 256000×2304 gradient would need
    4.7 GB per full-size float64 copy).
    """
    if actual.shape != reference.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(reference.shape)}")
    actual2d = actual.reshape(actual.shape[0], -1) if actual.dim() else actual.reshape(1, 1)
    reference2d = reference.reshape(actual2d.shape)
    if rows_per_chunk <= 0:
        rows_per_chunk = max(1, (32 << 20) // max(1, actual2d.shape[1]))
    diff_sq = 0.0
    ref_sq = 0.0
    for start in range(0, actual2d.shape[0], rows_per_chunk):
        a = actual2d[start : start + rows_per_chunk].to(torch.float64)
        r = reference2d[start : start + rows_per_chunk].to(torch.float64)
        diff_sq += float(torch.sum((a - r) ** 2))
        ref_sq += float(torch.sum(r**2))
    if ref_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else math.inf
    return math.sqrt(diff_sq / ref_sq)


# ----------------------------------------------------------------------------- environment


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def parse_dtype(name: str) -> torch.dtype:
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(table)}")
    return table[name]


def slugify(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` → ``"nvidia-h100-80gb-hbm3"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug or "unknown"


def package_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    revision = out.stdout.strip()
    if out.returncode != 0 or not revision:
        return None
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout.strip()
    return revision + ("+dirty" if dirty else "")


def fusedloss_version() -> str | None:
    """The version in fusedloss/__init__.py (read, not imported: importing builds kernels)."""
    try:
        text = (REPO_ROOT / "fusedloss" / "__init__.py").read_text(encoding="utf-8")
    except OSError:
        return package_version("fusedloss")
    match = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", text, re.MULTILINE)
    return match.group(1) if match else package_version("fusedloss")


def collect_environment(device: torch.device | str) -> dict[str, Any]:
    """Device name and slug, library versions, date: the header of every results file."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if uses_cuda(device):
        device_name = torch.cuda.get_device_name(device)
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        device_name = f"CPU ({platform.machine() or 'unknown'})"
        capability = None
    now = _dt.datetime.now().astimezone()
    return {
        "device": str(device),
        "device_name": device_name,
        "device_slug": slugify(device_name) if uses_cuda(device) else "cpu",
        "compute_capability": capability,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "fusedloss_version": fusedloss_version(),
        "fusedloss_revision": git_revision(),
        "date": now.date().isoformat(),
        "timestamp": now.isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------- formatting


def format_ms(ms: float | None) -> str:
    if ms is None or not math.isfinite(ms):
        return "—"
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def format_mib(mib: float | None) -> str:
    if mib is None or not math.isfinite(mib):
        return "—"
    if abs(mib) >= 100:
        return f"{mib:.0f}"
    if abs(mib) >= 1:
        return f"{mib:.1f}"
    return f"{mib:.2f}"


def format_error(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1e}"


def format_tflops(tflops: float) -> str:
    return f"{tflops:.0f}" if tflops >= 100 else f"{tflops:.3g}"


def format_ratio(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.2f}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |"]
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines.extend("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain fixed-width table for the terminal; numeric columns are right-aligned."""
    body = [[str(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in body:
        for i, value in enumerate(row):
            widths[i] = max(widths[i], len(value))
    numeric = [all(_looks_numeric(row[i]) for row in body) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [
            values[i].rjust(widths[i]) if numeric[i] else values[i].ljust(widths[i])
            for i in range(len(values))
        ]
        return "  ".join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(row) for row in body)
    return "\n".join(out)


def _looks_numeric(text: str) -> bool:
    if text in ("", "—"):
        return True
    try:
        float(text.split(" / ")[0])
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------- results files


def json_safe(value: Any) -> Any:
    """Recursively replace non-finite floats (not valid JSON) with strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def results_stem(suite_slug: str, date: str, device_slug: str, tag: str | None = None) -> str:
    """``lm_head_2026-11-22_nvidia-h100-80gb-hbm3`` (``_TAG`` appended when given)."""
    stem = f"{suite_slug}_{date}_{device_slug}"
    return f"{stem}_{slugify(tag)}" if tag else stem


def write_results(
    out_dir: Path | str, stem: str, markdown: str, data: dict[str, Any]
) -> tuple[Path, Path]:
    """Write ``<stem>.md`` and ``<stem>.json`` under ``out_dir``; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path = out_dir / f"{stem}.md"
    json_path = out_dir / f"{stem}.json"
    md_path.write_text(markdown.rstrip() + "\n", encoding="utf-8")
    json_path.write_text(
        json.dumps(json_safe(data), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return md_path, json_path


def report_results(out, stem: str, markdown: str, payload, notes, tables: str,
                   log=print) -> None:
    """Writes a suite's results files, then logs its notes, their paths and the short tables."""
    md_path, json_path = write_results(out, stem, markdown, payload)
    log("")
    for note in notes:
        log(f"note: {note}")
    log(f"results: {md_path}")
    log(f"         {json_path}")
    log("")
    log(tables)
    sys.stdout.flush()
