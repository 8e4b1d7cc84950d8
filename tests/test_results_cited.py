"""``benchmarks/results/`` keeps what the docs cite and the latest run of each suite per GPU."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# suite_date_device[_tag].ext, e.g. lm_head_2026-11-28_nvidia-h200_softcap.md
NAME = re.compile(r"(?P<suite>.+?)_(?P<date>20\d\d-\d\d-\d\d)_(?P<device>nvidia-[a-z0-9-]+?|cpu)"
                  r"(?:_|\.|$)")
CITATION = re.compile(r"[A-Za-z0-9_*-]*_20\d\d-\d\d-\d\d[A-Za-z0-9_.*{},-]*")
EXTENSION = re.compile(r"\.(md|json|png|svg|log|csv|txt|\*)$")


def _expand(token: str) -> list[str]:
    """``a_{x,y}.md`` → ``a_x.md``, ``a_y.md`` (nested groups too)."""
    group = re.search(r"\{([^{}]*)\}", token)
    if group is None:
        return [token]
    return [name for part in group.group(1).split(",")
            for name in _expand(token[:group.start()] + part + token[group.end():])]


def cited_patterns(texts: list[str]) -> set[str]:
    """The result stems (fnmatch patterns: ``*`` as the docs write it) that ``texts`` name, in
    any of the forms the docs use: whole names, ``{a,b}`` groups (line breaks inside them
    allowed) and globs; an extension cites every file of the stem."""
    text = re.sub(r"\{[^{}]*\}", lambda m: re.sub(r"\s+", "", m.group()), "\n".join(texts))
    patterns = set()
    for token in CITATION.findall(text):
        for name in _expand(token):
            patterns.add(EXTENSION.sub("", name.rstrip(".,")))
    return patterns


def uncited(files: list[str], patterns: set[str]) -> list[str]:
    """The files of ``files`` that no pattern cites and that are not of their suite's latest
    date on their device."""
    latest: dict[tuple[str, str], str] = {}
    for name in files:
        if match := NAME.match(name):
            key = (match["suite"], match["device"])
            latest[key] = max(latest.get(key, ""), match["date"])
    left = []
    for name in files:
        stem = name.split(".")[0]
        if any(fnmatch.fnmatchcase(stem, p) for p in patterns):
            continue
        match = NAME.match(name)
        if match is None or latest[(match["suite"], match["device"])] != match["date"]:
            left.append(name)
    return left


def test_patterns_read_every_citation_form():
    patterns = cited_patterns(["`lm_head_2026-11-26_nvidia-h200_{pooled-2e-8,\n  block}.md`, "
                               "`ring_2026-11-26_nvidia-h200_n256k*`, and "
                               "train_2026-11-28_nvidia-h200_syncfree.md."])
    assert uncited(["lm_head_2026-11-26_nvidia-h200_pooled-2e-8.json",
                    "lm_head_2026-11-26_nvidia-h200_block.md",
                    "ring_2026-11-26_nvidia-h200_n256k-oneblock.md",
                    "train_2026-11-28_nvidia-h200_syncfree.png",
                    "train_2026-11-29_nvidia-h200.md",  # the latest train run: kept
                    "lm_head_2026-11-27_nvidia-h200_x.md",  # the latest lm_head run: kept
                    "lm_head_2026-11-26_nvidia-h200_other.md"], patterns) == [
        "lm_head_2026-11-26_nvidia-h200_other.md"]


def test_every_result_is_cited_or_the_latest_of_its_suite():
    docs = [ROOT / "README.md", RESULTS.parent / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    patterns = cited_patterns([p.read_text() for p in docs])
    files = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")
    assert uncited(files, patterns) == []


def test_every_citation_names_a_kept_file():
    """A doc that cites a results file by its whole name (suite, date, device) finds it."""
    docs = [ROOT / "README.md", RESULTS.parent / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    stems = {p.name.split(".")[0] for p in RESULTS.iterdir()}
    missing = sorted(p for p in cited_patterns([d.read_text() for d in docs])
                     if NAME.match(p) and not any(fnmatch.fnmatchcase(s, p) for s in stems))
    assert missing == []
