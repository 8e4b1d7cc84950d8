"""Plot the lm-head suite's median ms against N from its JSON results (needs matplotlib).

    python -m benchmarks.plot_lm_head RESULTS.json [more.json ...] --out docs/lm_head_speed.svg

A panel per head, regime and mode (log-log), a line per provider and the products dashed;
later files replace earlier ones' points.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

MODE_TITLES = {"fwd+bwd": "forward+backward", "fwd": "forward only"}
PRODUCTS = "products (cuBLAS: Z = E·Cᵀ, dE, dC)"


def plot(files: list[dict[str, Any]], out: Path) -> Path:
    """Draw the cases of ``files`` into ``out`` (format from its suffix: .svg, .png, .pdf)."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogFormatter, NullLocator

    panels: dict[tuple[str, str, str], dict[str, Any]] = {}  # title, lines: {key: {N: ms}}
    names: dict[str, str] = {}  # the measured providers' labels by key, then the products
    for case in (case for data in files for case in data["cases"]):
        softcap = f", softcap {case['softcap']:g}" if case.get("softcap") else ""
        title = (f"{case['shape']} (V {case['vocab_size']}, D {case['hidden_size']}{softcap})\n"
                 f"{case['regime']}, {MODE_TITLES[case['mode']]}")
        lines = panels.setdefault((case["shape"], case["regime"], case["mode"]),
                                  {"title": title, "lines": {}})["lines"]
        for result in case["results"]:
            if result["status"] in ("ok", "wrong") and result.get("ms"):  # measured
                names.setdefault(result["provider"], result["label"])
                lines.setdefault(result["provider"], {})[case["n"]] = result["ms"]
        if (case.get("products") or {}).get("ms"):
            lines.setdefault(PRODUCTS, {})[case["n"]] = case["products"]["ms"]
    names[PRODUCTS] = PRODUCTS
    palette = matplotlib.colormaps["tab10"].colors
    styles = {key: {"color": palette[i % len(palette)], "marker": "o", "markersize": 4}
              for i, key in enumerate(names)}
    styles[PRODUCTS] = {"color": "black", "linestyle": "--", "linewidth": 1.2}

    heads = list(dict.fromkeys(key[:2] for key in panels))
    modes = list(dict.fromkeys(key[2] for key in panels))
    figure = Figure(figsize=(5.0 * len(modes), 3.3 * len(heads) + 1.2), layout="constrained")
    axes = figure.subplots(len(heads), len(modes), squeeze=False)
    for (row, head), (column, mode) in itertools.product(enumerate(heads), enumerate(modes)):
        axis, panel = axes[row][column], panels.get((*head, mode))
        if panel is None:
            axis.set_visible(False)
            continue
        for key in [key for key in names if key in panel["lines"]]:
            ns = sorted(panel["lines"][key])
            axis.plot(ns, [panel["lines"][key][n] for n in ns], **styles[key])
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        all_ns = sorted({n for line in panel["lines"].values() for n in line})
        axis.xaxis.set_major_locator(FixedLocator(all_ns))
        axis.xaxis.set_minor_locator(NullLocator())
        axis.xaxis.set_major_formatter(FuncFormatter(
            lambda n, _: f"{int(n) // 1024}k" if n >= 1024 and int(n) % 1024 == 0 else f"{int(n)}"))
        axis.yaxis.set_major_formatter(LogFormatter())  # plain numbers: 100, not 10²
        axis.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(1, 0.4)))
        axis.grid(True, which="both", alpha=0.3)
        axis.set(title=panel["title"], xlabel="tokens N", ylabel="median ms")
        axis.title.set_fontsize(10)
    figure.legend([Line2D([], [], **styles[key]) for key in names], list(names.values()),
                  loc="outside lower center", ncols=min(len(names), 4))
    runs = dict.fromkeys(f"{d['environment']['device_name']} · torch {d['environment']['torch']} · "
                         f"triton {d['environment']['triton']} · {d['settings']['dtype']} · "
                         f"{d['environment']['date']}" for d in files)
    figure.suptitle("LM-head linear cross-entropy, median ms against N\n" + "\n".join(runs),
                    fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plot_lm_head",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="lm-head JSON results files")
    parser.add_argument("--out", type=Path, default=Path("docs/lm_head_speed.svg"),
                        help="the figure to write (default docs/lm_head_speed.svg)")
    args = parser.parse_args(argv)
    print(plot([json.loads(path.read_text(encoding="utf-8")) for path in args.results], args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
