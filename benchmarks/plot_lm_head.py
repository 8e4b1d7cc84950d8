"""Plot the lm-head suite's times against N from its JSON results.

    python -m benchmarks.plot_lm_head RESULTS.json [more.json ...] --out docs/lm_head_speed.svg

A panel per head, regime and mode: median ms against N (log-log), a line per provider and the
products as a dashed line; later files replace earlier ones' points. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MEASURED = ("ok", "wrong")  # the statuses that carry a time (benchmarks.common.MEASURED)
MODE_TITLES = {"fwd+bwd": "forward+backward", "fwd": "forward only"}


@dataclass
class Panel:
    """The lines of one (head, regime, mode) panel: {N: ms} per provider and products."""

    title: str
    products: dict[int, float] = field(default_factory=dict)
    providers: dict[str, dict[int, float]] = field(default_factory=dict)  # key → {N: ms}


def collect(files: Sequence[dict[str, Any]]) -> tuple[dict[tuple[str, str, str], Panel],
                                                       dict[str, str]]:
    """The panels of the results ``files`` (the suite's JSON, loaded), keyed by (head,
    regime, mode) in order of appearance, and the providers' labels by key."""
    panels: dict[tuple[str, str, str], Panel] = {}
    labels: dict[str, str] = {}
    for data in files:
        for case in data["cases"]:
            softcap = f", softcap {case['softcap']:g}" if case.get("softcap") else ""
            title = (f"{case['shape']} (V {case['vocab_size']}, D {case['hidden_size']}"
                     f"{softcap})\n{case['regime']}, {MODE_TITLES.get(case['mode'], case['mode'])}")
            panel = panels.setdefault((case["shape"], case["regime"], case["mode"]), Panel(title))
            n = case["n"]
            if (case.get("products") or {}).get("ms"):
                panel.products[n] = case["products"]["ms"]
            for result in case["results"]:
                if result["status"] in MEASURED and result.get("ms"):
                    labels.setdefault(result["provider"], result["label"])
                    panel.providers.setdefault(result["provider"], {})[n] = result["ms"]
    return panels, labels


def run_description(files: Sequence[dict[str, Any]]) -> str:
    """``GPU · torch … · triton … · dtype · date``, a line per distinct run."""
    runs = []
    for data in files:
        env = data["environment"]
        runs.append(f"{env['device_name']} · torch {env['torch']} · triton {env['triton']} · "
                    f"{data['settings']['dtype']} · {env['date']}")
    return "\n".join(dict.fromkeys(runs))


def _tokens(n: float) -> str:
    return f"{int(n) // 1024}k" if n >= 1024 and int(n) % 1024 == 0 else f"{int(n)}"


def plot(files: Sequence[dict[str, Any]], out: Path) -> Path:
    """Draw the panels of ``files`` into ``out`` (format from its suffix: .svg, .png, .pdf)."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogFormatter, NullLocator

    panels, labels = collect(files)
    if not panels:
        raise ValueError("no lm-head cases in the results given")
    heads = list(dict.fromkeys((shape, regime) for shape, regime, _ in panels))
    modes = list(dict.fromkeys(mode for _, _, mode in panels))
    palette = matplotlib.colormaps["tab10"].colors
    colours = {key: palette[i % len(palette)] for i, key in enumerate(labels)}

    figure = Figure(figsize=(5.0 * len(modes), 3.3 * len(heads) + 1.2), layout="constrained")
    axes = figure.subplots(len(heads), len(modes), squeeze=False)
    for row, (shape, regime) in enumerate(heads):
        for column, mode in enumerate(modes):
            axis, panel = axes[row][column], panels.get((shape, regime, mode))
            if panel is None:
                axis.set_visible(False)
                continue
            for key, points in panel.providers.items():
                ns = sorted(points)
                axis.plot(ns, [points[n] for n in ns], marker="o", markersize=4,
                          color=colours[key])
            ns = sorted(panel.products)
            axis.plot(ns, [panel.products[n] for n in ns], "--", color="black", linewidth=1.2)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            all_ns = sorted({n for points in panel.providers.values() for n in points} | set(ns))
            axis.xaxis.set_major_locator(FixedLocator(all_ns))
            axis.xaxis.set_minor_locator(NullLocator())
            axis.xaxis.set_major_formatter(FuncFormatter(lambda n, _: _tokens(n)))
            axis.yaxis.set_major_formatter(LogFormatter())  # plain numbers: 100, not 10²
            axis.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(1, 0.4)))
            axis.grid(True, which="both", alpha=0.3)
            axis.set_title(panel.title, fontsize=10)
            axis.set(xlabel="tokens N", ylabel="median ms")
    handles = [Line2D([], [], color=colours[key], marker="o", markersize=4) for key in labels]
    handles.append(Line2D([], [], color="black", linestyle="--"))
    names = [*labels.values(), "products (cuBLAS: Z = E·Cᵀ, dE, dC)"]
    figure.legend(handles, names, loc="outside lower center", ncols=min(len(names), 4))
    figure.suptitle(f"LM-head linear cross-entropy, median ms against N\n{run_description(files)}",
                    fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plot_lm_head",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="lm-head JSON results files")
    parser.add_argument("--out", type=Path, default=Path("docs/lm_head_speed.svg"),
                        help="the figure to write (default docs/lm_head_speed.svg)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("matplotlib is not installed: pip install matplotlib")
    files = [json.loads(path.read_text(encoding="utf-8")) for path in args.results]
    others = [str(p) for p, data in zip(args.results, files, strict=True)
              if data.get("suite") != "lm-head"]
    if others:
        parser.error(f"not lm-head results: {', '.join(others)}")
    print(plot(files, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
