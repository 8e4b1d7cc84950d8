"""What every suite shares: timing, memory, errors, environment, options, statuses, report
pieces, results files. Timing is ``do_bench(..., return_mode="median")`` on CUDA, else a
wall-clock median, labelled as such."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fusedloss.core.engine import pad_classes

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIB = float(1 << 20)

# A provider's status on a case; "wrong" failed the sanity check but was timed (measured).
OK, WRONG = "ok", "wrong"
NOT_INSTALLED, UNAVAILABLE = "not installed", "unavailable"
FAILED, OUT_OF_MEMORY = "failed", "out of memory"
Column = tuple[str, Callable[[Any], Any]]  # a table column: header, cell of one row item
Row = dict[str, Any]  # one provider (or method) on one case: new_row()'s keys, the suite's figures
Gather = Callable[[Any], list[Any]]  # every rank's value of its argument, in rank order


# ----------------------------------------------------------------------------- timing, memory
@dataclass(frozen=True)
class TimingSettings:
    warmup_ms: float = 100.0
    rep_ms: float = 1000.0


QUICK_TIMING = TimingSettings(warmup_ms=5.0, rep_ms=20.0)
MATMUL_SIZE, QUICK_MATMUL_SIZE = 8192, 256
PRODUCTS_CHUNK_ROWS = 16384
PRODUCTS_MEMORY_SHARE = 0.5  # Z and G whole while they take at most this share of free memory
WALL_CLOCK_TIMING = "wall-clock median (no CUDA: not comparable with GPU figures)"


def timing_settings(warmup_ms: float | None, rep_ms: float | None, quick: bool,
                    default: TimingSettings | None = None) -> TimingSettings:
    """``--warmup-ms`` / ``--rep-ms`` where given, else ``default`` (or QUICK_TIMING)."""
    default = QUICK_TIMING if quick else default or TimingSettings()
    return TimingSettings(default.warmup_ms if warmup_ms is None else warmup_ms,
                          default.rep_ms if rep_ms is None else rep_ms)


def timing_text(device: torch.device | str, timing: TimingSettings) -> str:
    """How :func:`median_ms` timed on ``device``, for a report."""
    if not uses_cuda(device):
        return WALL_CLOCK_TIMING
    return (f"triton.testing.do_bench(fn, warmup={timing.warmup_ms:g}, rep={timing.rep_ms:g}, "
            'return_mode="median")')


def uses_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def median_ms(fn: Callable[[], Any], device: torch.device | str, timing: TimingSettings) -> float:
    """Median ms of ``fn()``: ``do_bench`` on CUDA, else a wall-clock median of ~rep_ms."""
    if uses_cuda(device):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms, return_mode="median"))
    first_ms = timed(fn, device)[0]
    if first_ms >= timing.rep_ms:
        return first_ms
    estimate_ms = max(first_ms, 1e-3)
    for _ in range(min(100, int(timing.warmup_ms / estimate_ms))):
        fn()
    reps = max(1, min(1000, int(timing.rep_ms / estimate_ms)))
    return statistics.median(timed(fn, device)[0] for _ in range(reps))


def time_products(e: Tensor, c: Tensor, timing: TimingSettings, *, backward: bool = True,
                  logit_products: int = 1, rows_per_chunk: int | None = None) -> dict[str, Any]:
    """Median ms of the cuBLAS products an exact method cannot avoid (Z = E Cᵀ, and dE = G C,
    dC = Gᵀ E for a random G), in chunks of rows where whole they would not fit; over C's rows
    padded with zeros to a multiple of 16 (``pad_classes``), as the library forms them: an odd
    number of classes otherwise takes cuBLAS's align-1 kernels, several times slower."""
    e, c = e.detach(), pad_classes(c.detach(), None)[0]
    n, cols, device = e.shape[0], c.shape[0], e.device
    rows = min(n, rows_per_chunk or n)
    if rows_per_chunk is None and n > PRODUCTS_CHUNK_ROWS and uses_cuda(device):
        needed = (2 if backward else 1) * n * cols * e.element_size()
        if needed > PRODUCTS_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0]:
            rows = PRODUCTS_CHUNK_ROWS
    chunks = -(-n // rows)
    result = {"ms": None, "rows_per_chunk": rows, "logit_products": logit_products,
              "method": "whole" if chunks == 1 else f"{chunks} chunks of {rows} rows", "note": ""}

    def products() -> None:
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            for _ in range(logit_products):
                torch.mm(e[start:stop], c.T, out=z[: stop - start])
            if backward:
                torch.mm(g[: stop - start], c, out=grad_e[start:stop])
                beta = 0 if start == 0 else 1  # dC accumulated over the chunks
                grad_c.addmm_(g[: stop - start].T, e[start:stop], beta=beta)

    try:
        z = e.new_empty(rows, cols)
        if backward:
            generator = torch.Generator(device=device).manual_seed(0)
            g = e.new_empty(rows, cols).normal_(generator=generator)  # dense: no zeros
            grad_e, grad_c = torch.empty_like(e), torch.empty_like(c)
        result["ms"] = median_ms(products, device, timing)
    except Exception as error:  # an OOM here must not end the run
        result["note"] = f"products not timed: {describe_error(error)}"
    finally:
        z = g = grad_e = grad_c = None
    release_memory(device)
    return result


def call_ms(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Wall-clock ms of one synchronized call of ``fn``."""
    synchronize(device)
    begin = time.perf_counter()
    output = fn()
    synchronize(device)
    elapsed = (time.perf_counter() - begin) * 1e3
    del output
    return elapsed


def timed(fn: Callable[..., Any], device: torch.device | str, *args: Any) -> tuple[float, Any]:
    """(ms, result) of ``fn(*args)``: CUDA events around it (wall clock without CUDA)."""
    if uses_cuda(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        value = fn(*args)
        end.record()
        torch.cuda.synchronize(device)
        return float(start.elapsed_time(end)), value
    begin = time.perf_counter()
    value = fn(*args)
    return (time.perf_counter() - begin) * 1e3, value


def synchronize(device: torch.device | str) -> None:
    if uses_cuda(device):
        torch.cuda.synchronize(device)


def capture_graph(step: Callable[[], Any], device: torch.device, calls: int) -> tuple[Any, Any]:
    """(graph, static outputs) of ``step`` captured after ``calls`` calls on a side stream."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(calls):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def release_memory(device: torch.device | str) -> None:
    gc.collect()
    if uses_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def peak_extra_mib(fn: Callable[[], Any], device: torch.device | str,
                   accounted_bytes: int = 0) -> float | None:
    """MiB of the peak during one ``fn()`` above the memory before it, less ``accounted_bytes``
    (e.g. gradient buffers); ``None`` without CUDA."""
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


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def probe_matmul(device: torch.device | str, quick: bool, timing: TimingSettings,
                 dtype: torch.dtype, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The matmul rate R every cost floor divides by: a random product of MATMUL_SIZE³ (with
    ``quick``: QUICK_MATMUL_SIZE³), logged."""
    size = QUICK_MATMUL_SIZE if quick else MATMUL_SIZE
    generator = torch.Generator(device=device)
    generator.manual_seed(1234)
    a = torch.randn(size, size, generator=generator, device=device).to(dtype)
    b = torch.randn(size, size, generator=generator, device=device).to(dtype)
    ms = median_ms(lambda: torch.mm(a, b), device, timing)
    matmul = {"size": size, "dtype": dtype_name(dtype), "ms": ms,
              "tflops": 2.0 * size**3 / (ms * 1e-3) / 1e12}
    log(f"matmul {matmul['dtype']} {size}³: {ms:.3f} ms → "
        f"{format_tflops(matmul['tflops'])} TFLOP/s")
    return matmul


# ----------------------------------------------------------------------------- statuses, checks
class Unavailable(Exception):
    """The provider cannot run here (package or API missing); the message says why."""


def new_row(provider: str, label: str, **figures: Any) -> Row:
    """A result row (written to the JSON as it is): the provider's key, its title, status,
    note, the exact call measured, the median ms, then the suite's own ``figures``."""
    return {"provider": provider, "label": label, "status": OK, "note": "", "call": "",
            "ms": None, **figures}


def measured(row: Row) -> bool:
    return row["status"] in (OK, WRONG) and row.get("ms") is not None


def describe_error(error: BaseException) -> str:
    """The exception's type and first line, short enough for a table cell."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:300]}"


def failure(error: BaseException) -> tuple[str, str]:
    """The status and note an exception gives: a missing import (or an Unavailable raised from
    one) is "not installed", another Unavailable "unavailable", else out of memory or failed."""
    missing = isinstance(error, ImportError) or isinstance(error.__cause__, ImportError)
    if isinstance(error, Unavailable):
        return (NOT_INSTALLED if missing else UNAVAILABLE), str(error)
    out_of_memory = (isinstance(error, torch.cuda.OutOfMemoryError)
                     or "out of memory" in str(error).lower())
    status = NOT_INSTALLED if missing else OUT_OF_MEMORY if out_of_memory else FAILED
    return status, describe_error(error)


@contextlib.contextmanager
def failures_recorded(row: Row, device: torch.device | str) -> Iterator[None]:
    """An exception in the block becomes ``row``'s status and note; memory is released."""
    try:
        yield
    except Exception as error:  # report and go on with the next provider
        row["status"], row["note"] = failure(error)
    finally:
        release_memory(device)


def stage(row: Row, action: Callable[[], Any], device: torch.device | str,
          gather: Gather | None = None) -> tuple[bool, Any]:
    """(True, ``action()``) where it succeeded (with ``gather``: on every rank), else (False,
    None) with the failure in ``row`` (an out-of-memory first, the rank named if they differ)."""
    value, error = None, None
    try:
        value = action()
    except Exception as exc:  # reported; the run goes on
        error = failure(exc)
    errors = gather(error) if gather else [error]
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return True, value
    rank, (row["status"], row["note"]) = next((f for f in failed if f[1][0] == OUT_OF_MEMORY),
                                              failed[0])
    if len(set(errors)) > 1:  # not the same failure on every rank
        row["note"] = f"rank {rank}: {row['note']}"
    value = None
    release_memory(device)
    return False, None


def check_and_time(row: Row, device: torch.device | str, check: Callable[[], list[str] | None],
                   step: Callable[[], Any], accounted_bytes: int,
                   timer: Callable[[Callable[[], Any], float], Mapping[str, Any]],
                   gather: Gather | None = None) -> bool:
    """What every provider goes through: ``check()``, the untimed first call (it fills ``row``
    and returns the problems that mark it wrong; None if it failed), on CUDA the peak MiB of one
    ``step`` above ``accounted_bytes``, then ``timer(step, ms of the call before)``'s figures.
    With ``gather`` every stage is agreed by the ranks. False after a failure."""
    begin = time.perf_counter()
    ok, problems = stage(row, check, device, gather)
    if not ok or problems is None:
        return False
    mark_wrong(row, problems)
    synchronize(device)
    last_ms = (time.perf_counter() - begin) * 1e3
    release_memory(device)
    if uses_cuda(device):
        begin = time.perf_counter()
        ok, peak = stage(row, lambda: peak_extra_mib(step, device, accounted_bytes), device,
                         gather)
        if not ok:
            return False
        last_ms = (time.perf_counter() - begin) * 1e3
        if gather:
            row["peak_per_rank"] = peaks = gather(peak)
            peak = max(peaks)
        row["peak_extra_mib"] = peak
    ok, figures = stage(row, lambda: timer(step, last_ms), device, gather)
    release_memory(device)
    row.update(figures or {})
    return ok


def check_loss(loss: float, reference: float, tolerance: float) -> tuple[float, list[str]]:
    """``|loss − reference|``, and a problem if above ``tolerance · max(1, |reference|)``."""
    error = abs(loss - reference)
    if error <= tolerance * max(1.0, abs(reference)):
        return error, []
    return error, [f"loss {loss:.6g} vs reference {reference:.6g}"]


def bound_problems(errors: Mapping[str, float], bound: Callable[[str], float]) -> list[str]:
    """A problem for each relative error above its bound (NaN fails too)."""
    return [f"{name} relative error {value:.2e} > {bound(name)}"
            for name, value in errors.items() if not value <= bound(name)]


def mark_wrong(row: Row, problems: Sequence[str]) -> None:
    if problems:
        row["status"], row["note"] = WRONG, "; ".join(problems)


def progress_line(row: Row, figures_text: Callable[[Row], str]) -> str:
    """A provider's progress-log line: its figures (flagged when wrong), else its status."""
    if not measured(row):
        return f"{row['status']}: {row['note']}"
    text = figures_text(row)
    if row["status"] != OK:
        text += f"  [{row['status']}: {row['note']}]"
    return text


def note_problem(notes: list[str], case_key: str, row: Row) -> None:
    """Notes, once, a provider that was skipped, failed or wrong."""
    label, status, note = row["label"], row["status"], row["note"]
    if status == OK:
        return
    text = f"{case_key}: {label} {status}: {note}"
    if status in (NOT_INSTALLED, UNAVAILABLE):
        text = f"{label} skipped ({status}): {note}"
    if text not in notes:
        notes.append(text)


def relative_l2_error(actual: Tensor, reference: Tensor, rows_per_chunk: int = 0) -> float:
    """``‖actual − reference‖₂ / ‖reference‖₂`` in float64, a block of rows at a time."""
    if actual.shape != reference.shape:
        raise ValueError(f"shape mismatch: {tuple(actual.shape)} vs {tuple(reference.shape)}")
    actual2d = actual.reshape(actual.shape[0], -1) if actual.dim() else actual.reshape(1, 1)
    reference2d = reference.reshape(actual2d.shape)
    if rows_per_chunk <= 0:
        rows_per_chunk = max(1, (32 << 20) // max(1, actual2d.shape[1]))
    diff_sq = ref_sq = 0.0
    for start in range(0, actual2d.shape[0], rows_per_chunk):
        a = actual2d[start : start + rows_per_chunk].to(torch.float64)
        r = reference2d[start : start + rows_per_chunk].to(torch.float64)
        diff_sq += float(torch.sum((a - r) ** 2))
        ref_sq += float(torch.sum(r**2))
    if ref_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else math.inf
    return math.sqrt(diff_sq / ref_sq)


# ----------------------------------------------------------------------------- environment
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    names = {value: key for key, value in DTYPES.items()}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def slugify(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` → ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def package_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def git_revision() -> str | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        revision = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return (revision + ("+dirty" if dirty else "")) if revision else None


def collect_environment(device: torch.device | str) -> dict[str, Any]:
    """Device, versions, ``Tuning`` fields changed from their defaults, date: every header."""
    from fusedloss.core import config

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = uses_cuda(device)
    device_name = (torch.cuda.get_device_name(device) if cuda
                   else f"CPU ({platform.machine() or 'unknown'})")
    tuning, default = config.tuning(), config.Tuning()
    try:  # the version in fusedloss/__init__.py, read (importing builds kernels)
        text = (REPO_ROOT / "fusedloss" / "__init__.py").read_text(encoding="utf-8")
    except OSError:
        text = ""
    match = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", text, re.MULTILINE)
    now = _dt.datetime.now().astimezone()
    return {
        "device": str(device),
        "device_name": device_name,
        "device_slug": slugify(device_name) if cuda else "cpu",
        "compute_capability": (".".join(map(str, torch.cuda.get_device_capability(device)))
                               if cuda else None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "fusedloss_version": match.group(1) if match else package_version("fusedloss"),
        "fusedloss_revision": git_revision(),
        "fusedloss_environment": {f.name: str(getattr(tuning, f.name))
                                  for f in dataclasses.fields(tuning)
                                  if getattr(tuning, f.name) != getattr(default, f.name)},
        "date": now.date().isoformat(),
        "timestamp": now.isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------- formatting
def _missing(value: float | None) -> bool:
    return value is None or not math.isfinite(value)


def format_ms(ms: float | None) -> str:
    if _missing(ms):
        return "—"
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def format_mib(mib: float | None) -> str:
    if _missing(mib):
        return "—"
    return f"{mib:.0f}" if abs(mib) >= 100 else f"{mib:.1f}" if abs(mib) >= 1 else f"{mib:.2f}"


def format_error(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def format_tflops(tflops: float) -> str:
    return f"{tflops:.0f}" if tflops >= 100 else f"{tflops:.3g}"


def format_ratio(value: float | None) -> str:
    return "—" if _missing(value) else f"{value:.2f}"


def count_text(value: float | None) -> str:
    """A rate (tokens/s, images/s): thousands separated, 3 significant digits below 100."""
    if _missing(value):
        return "—"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def loss_text(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def errors_text(row: Row | None) -> str:
    """A row's gradient errors (and their ratios where it has them): "dI 2.5e-03 (0.85×), …"."""
    if not (row or {}).get("errors"):
        return "—"
    ratios = row.get("ratios", {})
    return ", ".join(f"{name} {error:.1e}" + (f" ({ratios[name]:.2g}×)" if name in ratios else "")
                     for name, error in row["errors"].items())


def column(header: str, key: str, text: Callable[[Any], str] = str) -> Column:
    """A column of dict rows: ``text`` of the row's ``key`` ("—" where it has none)."""
    return header, lambda row: "—" if row.get(key) is None else text(row[key])


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |"]
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines.extend("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)
    return "\n".join(lines)


def _looks_numeric(text: str) -> bool:
    if text in ("", "—"):
        return True
    try:
        float(text.split(" / ")[0])
    except ValueError:
        return False
    return True


def text_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain fixed-width table for the terminal; numeric columns are right-aligned."""
    body = [[str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in [headers, *body]) for i in range(len(headers))]
    numeric = [all(_looks_numeric(row[i]) for row in body) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        cells = [value.rjust(width) if right else value.ljust(width)
                 for value, width, right in zip(values, widths, numeric, strict=True)]
        return "  ".join(cells).rstrip()

    return "\n".join(line(row) for row in [list(headers), ["-" * w for w in widths], *body])


def table(columns: Sequence[Column], items: Iterable[Any], text: bool = False) -> str:
    """A markdown (or with ``text`` a plain) table: one row per item, ``(header, cell)``."""
    render = text_table if text else markdown_table
    return render([h for h, _ in columns], [[cell(i) for _, cell in columns] for i in items])


def section(title: str, intro: str, columns: Sequence[Column], items: Iterable[Any]) -> list[str]:
    return [f"## {title}", "", *([intro, ""] if intro else []), table(columns, items), ""]


# ----------------------------------------------------------------------------- report pieces
def environment_rows(env: Mapping[str, Any], peer_versions: Mapping[str, str | None],
                     version_suffix: str = "") -> list[tuple[str, str]]:
    """The first rows of a report's settings table: device, versions, peers, date."""
    capability = env.get("compute_capability")
    peers = ", ".join(f"{name} {version}" if version else f"{name} not installed"
                      for name, version in peer_versions.items())
    settings = env.get("fusedloss_environment")
    return [
        ("GPU / device",
         env["device_name"] + (f" (compute capability {capability})" if capability else "")),
        ("torch / triton / CUDA", f"{env['torch']} / {env['triton']} / {env['cuda']}"),
        ("fusedloss version (git revision)", f"{env.get('fusedloss_version') or 'unknown'} "
         f"({env.get('fusedloss_revision') or 'unknown'}){version_suffix}"),
        *([("peers", peers)] if peers else []),
        *([("fusedloss tuning", ", ".join(f"{k}={v}" for k, v in settings.items()))]
          if settings else []),
        ("date", env["timestamp"]),
    ]


def matmul_row(matmul: Mapping[str, Any]) -> tuple[str, str]:
    return ("matmul rate R", f"{matmul['dtype']} {matmul['size']}³ random: "
            f"{matmul['ms']:.3f} ms median → {format_tflops(matmul['tflops'])} TFLOP/s")


def provider_columns(case_results: Iterable[Any]) -> list[tuple[str, str]]:
    """(key, label) of every provider that ran on some case, in order of first appearance."""
    columns: dict[str, str] = {}
    for case_result in case_results:
        for key, row in case_result.results.items():
            columns.setdefault(key, row["label"])
    return list(columns.items())


def time_and_memory_cell(row: Row | None, missing: str) -> str:
    """``ms / MB`` if measured, else its status; ``missing`` if it did not run."""
    if row is None:
        return missing
    if measured(row):
        text = f"{format_ms(row['ms'])} / {format_mib(row.get('peak_extra_mib'))}"
        return text + (" (wrong)" if row["status"] == WRONG else "")
    return row["status"]


# ----------------------------------------------------------------------------- plots
def add_speed_points(lines: dict[str, dict[int, float]], names: dict[str, str],
                     rows: Iterable[Row], size: int, products_ms: float | None,
                     products: str) -> None:
    """A case's points of a speed plot: each measured row's ms, and the products' ms."""
    for row in rows:
        if measured(row):
            names.setdefault(row["provider"], row["label"])
            lines.setdefault(row["provider"], {})[size] = row["ms"]
    if products_ms:
        lines.setdefault(products, {})[size] = products_ms


def speed_lines(lines: Mapping[str, Mapping[int, float]], names: Mapping[str, str],
                dashed: str) -> list[tuple[str, list, list, dict]]:
    """A panel's lines of ms against size (``lines``: {key: {size: ms}}) in ``names``' order,
    which fixes each key's colour; ``dashed``: the key drawn black and dashed (the products)."""
    out = []
    for i, (key, label) in enumerate(names.items()):
        if key in lines:
            xy = sorted(lines[key].items())
            style = ({"color": "black", "linestyle": "--", "linewidth": 1.2} if key == dashed
                     else {"color": f"C{i}", "marker": "o", "markersize": 4})
            out.append((label, [x for x, _ in xy], [ms for _, ms in xy], style))
    return out


def runs_text(files: Iterable[Mapping[str, Any]]) -> str:
    """One line per distinct run of these results files: GPU, torch, triton, dtype, date."""
    return "\n".join(dict.fromkeys(
        f"{d['environment']['device_name']} · torch {d['environment']['torch']} · triton "
        f"{d['environment']['triton']} · {d['settings']['dtype']} · {d['environment']['date']}"
        for d in files))


def plot_results_files(args: argparse.Namespace, default: str,
                       plot: Callable[[list[dict[str, Any]], Path], Path | None],
                       log: Callable[[str], None]) -> int:
    """``--plot RESULTS.json …``: ``plot(their data, --out or default)``; 2 if not drawn."""
    figure = args.out if args.out.suffix else Path(default)
    figure = plot([json.loads(p.read_text(encoding="utf-8")) for p in args.plot], figure)
    log(str(figure or "no plot: matplotlib is not installed"))
    return 0 if figure else 2


def save_plot(path: Path, panels: Sequence[tuple[str, str, str, list] | None], columns: int = 1,
              size: tuple[float, float] = (8, 5), title: str = "", log: str = "",
              **style: Any) -> Path | None:
    """Panels (title, xlabel, ylabel, [(label, xs, ys[, style])]) or None (empty), row-major;
    ``log``: the log axes ("x", "y", "xy"). ``None`` (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = max(1, math.ceil(len(panels) / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(size[0] * columns, size[1] * rows),
                                squeeze=False)
    for axis, panel in zip(axes.flat, [*panels, *[None] * (axes.size - len(panels))],
                           strict=True):
        if panel is None:
            axis.set_visible(False)
            continue
        panel_title, xlabel, ylabel, lines = panel
        for label, xs, ys, *own in lines:
            axis.plot(xs, ys, label=label, **{**style, **(own[0] if own else {})})
        if "x" in log:
            axis.set_xscale("log", base=2)
        if "y" in log:
            axis.set_yscale("log")
        axis.set(title=panel_title, xlabel=xlabel, ylabel=ylabel)
        axis.grid(True, which="both" if log else "major", alpha=0.3)
        if lines:
            axis.legend(fontsize="small")
    if title:
        figure.suptitle(title, fontsize="medium")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


# ----------------------------------------------------------------------------- results files
def json_safe(value: Any) -> Any:
    """Non-finite floats (not valid JSON) replaced by strings, recursively."""
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


def results_path(out_dir: Path | str, suite_slug: str, environment: Mapping[str, Any],
                 tag: str | None, suffix: str) -> Path:
    """``out_dir/<stem><suffix>`` (e.g. a plot beside the results files), ``out_dir`` made."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    stem = results_stem(suite_slug, environment["date"], environment["device_slug"], tag)
    return Path(out_dir) / f"{stem}{suffix}"


def markdown_report(environment: Mapping[str, Any], title: str,
                    settings: Sequence[tuple[str, Any]], body: Sequence[str],
                    calls: Mapping[str, str] | None = None, notes: Sequence[str] = (),
                    world: int | None = None) -> str:
    """The title, the settings table, ``body`` (markdown lines), the calls and the notes."""
    where = f" over {world} × " if world is not None else ": "
    lines = [f"# {title}{where}{environment['device_name']}, {environment['date']}", "",
             markdown_table(["setting", "value"], settings), "", *body]
    if calls:
        lines += ["## Calls measured", "", *(f"- **{k}**: `{c}`" for k, c in calls.items()), ""]
    if notes:
        lines += ["## Notes", "", *(f"- {note}" for note in notes), ""]
    return "\n".join(lines)


def write_report(out_dir: Path | str, suite_slug: str, tag: str | None,
                 environment: Mapping[str, Any], title: str, settings: Sequence[tuple[str, Any]],
                 body: Sequence[str], payload: dict[str, Any], tables: str, *,
                 calls: Mapping[str, str] | None = None, notes: Sequence[str] = (),
                 world: int | None = None, log: Callable[[str], None] = print) -> tuple[Path, Path]:
    """``<stem>.md`` and ``<stem>.json`` (``payload``), the stem's device ``_<K>gpu`` /
    ``_<K>proc`` with ``world``; then logs the notes, the paths and the ``tables`` (last)."""
    device = environment["device_slug"]
    if world is not None:
        device += f"_{world}{'gpu' if uses_cuda(environment['device']) else 'proc'}"
    stem = results_path(out_dir, suite_slug, {**environment, "device_slug": device}, tag, "")
    md_path, json_path = stem.with_name(stem.name + ".md"), stem.with_name(stem.name + ".json")
    json_path.write_text(json.dumps(json_safe(payload), indent=2, ensure_ascii=False) + "\n",
                         encoding="utf-8")
    markdown = markdown_report(environment, title, settings, body, calls, notes, world)
    md_path.write_text(markdown.rstrip() + "\n", encoding="utf-8")
    for line in ["", *(f"note: {note}" for note in notes), f"results: {md_path}",
                 f"         {json_path}", "", tables]:
        log(line)
    sys.stdout.flush()
    return md_path, json_path


# ----------------------------------------------------------------------------- command line
QUICK_NOTE = "--quick: shrunk shapes and short timing; figures are not representative"


def int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated positive integers, repeats dropped."""
    values = list(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers (4096,16384), got {text!r}")
    return values


def add_list(parser: argparse.ArgumentParser, flag: str, choices: Iterable[str],
             default: Iterable[str] | None = None, note: str | None = None) -> None:
    """A comma-list option of ``choices``; its help names them, then ``note`` (by default the
    default: "all" for every choice)."""
    choices, default = list(choices), None if default is None else list(default)
    if note is None:
        note = f"(default: {'all' if default in (None, choices) else ','.join(default)})"

    def parse(text: str) -> list[str]:  # at least one of the choices
        values = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [v for v in values if v not in choices]
        if unknown or not values:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(choices)}")
        return values

    parser.add_argument(flag, type=parse, default=default,
                        help=f"comma list of {', '.join(choices)} {note}".rstrip())


def add_common_arguments(parser: argparse.ArgumentParser, quick_help: str, *, dtype: bool = True,
                         seed: bool = True, timing: bool = True) -> None:
    """The options every suite takes (``--dtype``, ``--seed``, timing: where asked)."""
    add, default = parser.add_argument, TimingSettings()
    if dtype:
        add("--dtype", default="bf16", choices=list(DTYPES))
    if seed:
        add("--seed", type=int, default=0)
    add("--quick", action="store_true", help=quick_help)
    add("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    if timing:
        add("--warmup-ms", type=float, default=None, help=f"do_bench warmup in ms (default "
            f"{default.warmup_ms:g}; {QUICK_TIMING.warmup_ms:g} with --quick)")
        add("--rep-ms", type=float, default=None, help=f"do_bench rep in ms (default "
            f"{default.rep_ms:g}; {QUICK_TIMING.rep_ms:g} with --quick)")
    add("--out", type=Path, default=RESULTS_DIR,
        help="directory for the .md and .json results (default benchmarks/results)")
    add("--tag", default=None, help="suffix for the results file names (e.g. a subset's name)")


def pick_device(name: str | None) -> torch.device:
    """``--device``, else CUDA where there is one and the CPU otherwise."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def run_device(args: argparse.Namespace, suite: str,
               log: Callable[[str], None] = print) -> torch.device | None:
    """:func:`pick_device`; None (logged) for a full-size run without CUDA."""
    device = pick_device(args.device)
    if uses_cuda(device) or args.quick:
        return device
    log(f"the {suite} suite needs a CUDA device at full size; use --quick for a CPU smoke run")
    return None


def use_triton_interpreter() -> str:
    """Turns Triton's CPU interpreter on unless chosen; returns the note that says so."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return ("no CUDA: Triton kernels ran on the CPU interpreter "
            f"(TRITON_INTERPRET={os.environ['TRITON_INTERPRET']})")
