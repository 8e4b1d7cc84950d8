"""benchmarks/trained_lm.py: one ``--quick`` CPU run per module, its files checked against the
tokenizer, the trained model and float64 computations."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import import_benchmarks

pytest.importorskip("tokenizers")

trained_lm, inputs = import_benchmarks("trained_lm", "inputs")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(the output directory, the trained model) of one ``--quick`` run."""
    out = tmp_path_factory.mktemp("trained_lm")
    argv = ["--quick", "--out", str(out)]
    return out, trained_lm.build(trained_lm.parse_args(argv), argv)


@pytest.fixture(scope="module")
def run_dir(built) -> Path:
    return built[0]


@pytest.fixture(scope="module")
def saved(run_dir: Path) -> dict:
    return torch.load(run_dir / inputs.TRAINED_LM_FILE, map_location="cpu", weights_only=True)


def quick_settings(out: Path):
    return trained_lm.parse_args(["--quick", "--out", str(out)])


def test_saved_shapes_dtypes_and_metadata(run_dir, saved):
    settings = quick_settings(run_dir)
    meta = saved["metadata"]
    n, vocab, width = settings.n, settings.vocab, settings.width
    assert settings.steps == 20 and settings.device == "cpu"
    assert saved["E"].shape == (n, width) and saved["E"].dtype == torch.bfloat16
    assert saved["C"].shape == (vocab, width) and saved["C"].dtype == torch.bfloat16
    assert saved["y"].shape == (n,) and saved["y"].dtype == torch.int64
    assert saved["x"].shape == (n,) and saved["x"].dtype == torch.int64
    assert 0 <= int(saved["y"].min()) and int(saved["y"].max()) < vocab
    assert torch.isfinite(saved["E"].float()).all() and torch.isfinite(saved["C"].float()).all()

    assert json.loads((run_dir / trained_lm.METADATA_FILE).read_text(encoding="utf-8")) == meta
    assert meta["regime"] == "trained"
    assert meta["shapes"] == {"E": [n, width], "C": [vocab, width], "y": [n]}
    corpus = meta["corpus"]
    assert corpus["files"]["train"] > 0 and corpus["files"]["held_out"] > 0
    assert corpus["bytes"]["train"] > 0 and corpus["bytes"]["held_out"] > 0
    assert corpus["tokens"]["train"] > 0 and corpus["tokens"]["held_out"] > n
    assert 256 < meta["tokenizer_vocab_size"] <= vocab
    assert meta["model_parameters"] > vocab * width * 2  # embedding and head
    training = meta["training"]
    assert training["steps"] == settings.steps
    assert training["tokens"] == settings.steps * settings.batch_size * settings.seq_len
    # Untrained: ≈ log V; a few steps already learn the token frequencies.
    assert math.isfinite(training["final_train_loss"])
    assert meta["softmax"]["mean_loss"] < math.log(vocab) - 0.3
    assert meta["settings"]["vocab"] == vocab and meta["settings"]["out"] == str(run_dir)
    for key in ("torch", "tokenizers", "device_name", "timestamp", "python"):
        assert meta["environment"][key]
    assert meta["command"] == f"python -m benchmarks.trained_lm --quick --out {run_dir}"
    assert meta["environment"]["torch"] == torch.__version__
    assert (run_dir / trained_lm.TOKENIZER_FILE).is_file()


def saved_windows(saved: dict) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(start in the held-out stream, x, y) of each window the rows were cut from."""
    rows = saved["metadata"]["rows"]
    seq_len, starts = rows["seq_len"], rows["window_starts"]
    assert len(starts) == math.ceil(saved["x"].numel() / seq_len)
    return [(start, saved["x"][w * seq_len : (w + 1) * seq_len],
             saved["y"][w * seq_len : (w + 1) * seq_len]) for w, start in enumerate(starts)]


def test_targets_are_next_tokens_of_held_out_text(run_dir, saved):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(run_dir / trained_lm.TOKENIZER_FILE))
    train, held_out, _ = trained_lm.collect_corpus(quick_settings(run_dir))
    assert not set(held_out) & set(train)
    held_out_text = "".join(text + trained_lm.END_OF_TEXT for text in held_out)
    stream = trained_lm.token_stream(tokenizer, held_out).long()
    pieces = saved_windows(saved)
    assert len(pieces) == 2 and pieces[1][0] > pieces[0][0] == 0  # spread over the stream
    for start, x, y in pieces:
        assert torch.equal(x[1:], y[:-1])  # within a window, row j + 1 reads row j's target
        assert torch.equal(x, stream[start : start + x.numel()])
        assert torch.equal(y, stream[start + 1 : start + 1 + y.numel()])
        decoded = tokenizer.decode([*x.tolist(), int(y[-1])], skip_special_tokens=False)
        decoded = decoded.strip("\ufffd")  # a window may cut a multi-byte character
        assert len(decoded) > 20 and decoded in held_out_text


def test_cross_entropy_of_e_and_c_equals_the_models_loss(built, saved):
    model = built[1]
    with torch.no_grad():
        hidden = torch.cat([model.hidden(x[None])[0] for _, x, _ in saved_windows(saved)])
        model_loss = F.cross_entropy(model.head(hidden).double(), saved["y"], reduction="none")
    torch.testing.assert_close(saved["E"].float(), hidden, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(saved["C"].float(), model.head.weight, rtol=2**-7, atol=1e-3)
    stored_loss = F.cross_entropy(saved["E"].double() @ saved["C"].double().T, saved["y"],
                                  reduction="none")
    torch.testing.assert_close(stored_loss, model_loss, rtol=0, atol=3e-2)
    assert abs(float(stored_loss.mean()) - float(model_loss.mean())) < 5e-3
    softmax = saved["metadata"]["softmax"]
    assert softmax["mean_loss"] == pytest.approx(float(stored_loss.mean()), abs=1e-4)


def softmax_shape_float64(hidden, classifier, labels) -> dict:
    p = torch.softmax(hidden.double() @ classifier.double().T, dim=1)
    counts = (p > trained_lm.SOFTMAX_THRESHOLD).sum(dim=1).tolist()
    vocab = classifier.shape[0]
    top = p.sort(dim=1, descending=True).values
    outside = {str(k): float((1.0 - top[:, :k].sum(dim=1)).mean()) if k < vocab else 0.0
               for k in trained_lm.SOFTMAX_TOP}
    p_target = p.gather(1, labels[:, None]).squeeze(1)
    return {"mean": statistics.mean(counts), "median": statistics.median(counts),
            "outside": outside, "loss": float(-p_target.log().mean()),
            "p_target": float(p_target.mean())}


def assert_softmax_shape(stats: dict, ref: dict, n: int) -> None:
    # A float32 probability at the threshold may land on the other side of it: a row or two.
    assert stats["entries_above_threshold_mean"] == pytest.approx(ref["mean"], abs=2 / n)
    assert stats["entries_above_threshold_median"] == pytest.approx(ref["median"], abs=1)
    for k, value in ref["outside"].items():
        assert stats["mass_outside_top"][k] == pytest.approx(value, abs=1e-5), k
    assert stats["mean_loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-5)
    assert stats["mean_p_target"] == pytest.approx(ref["p_target"], rel=1e-5, abs=1e-7)


def test_saved_softmax_statistics_match_a_direct_computation(saved):
    stats = saved["metadata"]["softmax"]
    ref = softmax_shape_float64(saved["E"], saved["C"], saved["y"])
    assert stats["rows"] == saved["E"].shape[0] and stats["vocab"] == saved["C"].shape[0]
    assert_softmax_shape(stats, ref, saved["E"].shape[0])


@pytest.mark.parametrize("rows_per_block", [0, 3])
def test_softmax_shape_peaked_rows(rows_per_block):
    """V between the top-k sizes (50, 1000 < V < 10000), peaked rows, ragged row blocks."""
    generator = torch.Generator().manual_seed(0)
    n, vocab, width = 11, 2003, 24
    classifier = torch.randn(vocab, width, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), generator=generator)
    hidden = 1.5 * classifier[labels].float() + torch.randn(n, width, generator=generator)
    hidden = hidden.to(torch.bfloat16)
    stats = trained_lm.softmax_shape(hidden, classifier, labels, rows_per_block)
    ref = softmax_shape_float64(hidden, classifier, labels)
    assert 0 < ref["outside"]["1000"] < ref["outside"]["50"] < 1 and ref["outside"]["10000"] == 0
    assert_softmax_shape(stats, ref, n)


def test_load_trained_regime(run_dir, saved, monkeypatch):
    hidden, classifier, labels, meta = inputs.load_trained_regime(run_dir, "cpu", torch.float32)
    assert hidden.dtype == classifier.dtype == torch.float32 and labels.dtype == torch.int64
    assert torch.equal(hidden, saved["E"].float()) and torch.equal(labels, saved["y"])
    assert meta == saved["metadata"]

    monkeypatch.setenv(inputs.TRAINED_LM_ENV, str(run_dir / inputs.TRAINED_LM_FILE))
    hidden, classifier, labels, _ = inputs.load_trained_regime(n=5)
    assert hidden.shape == (5, saved["E"].shape[1]) and hidden.dtype == torch.bfloat16
    assert torch.equal(hidden, saved["E"][:5]) and torch.equal(classifier, saved["C"])
    with pytest.raises(ValueError, match="n must be"):
        inputs.load_trained_regime(n=saved["E"].shape[0] + 1)

    monkeypatch.delenv(inputs.TRAINED_LM_ENV)
    with pytest.raises(FileNotFoundError, match="python -m benchmarks.trained_lm"):
        inputs.load_trained_regime()
    with pytest.raises(FileNotFoundError, match="python -m benchmarks.trained_lm"):
        inputs.load_trained_regime(run_dir / "missing")


def test_corpus_split_order_and_skips(tmp_path):
    root = tmp_path / "site-packages"
    for i in range(40):
        package = root / f"pkg{i % 4}"
        package.mkdir(parents=True, exist_ok=True)
        (package / f"module{i}.py").write_text(f"def f{i}():\n    return {i}\n")
    (root / "pkg0" / "copy.py").write_text("def f0():\n    return 0\n")  # a duplicate
    (root / "pkg0" / "latin1.py").write_bytes(b"# caf\xe9\n")
    (root / "pkg0" / "empty.py").write_text("\n")
    (root / "pkg0" / "notes.txt").write_text("not python\n")

    def collect(seed: int):
        return trained_lm.collect_corpus(trained_lm.Settings(
            out=tmp_path, roots=(str(root),), corpus_mb=1.0, held_out_fraction=0.25, seed=seed))

    train, held_out, info = collect(0)
    assert info["python_files_found"] == 43
    assert info["skipped_files"] == {"duplicate": 1, "not_utf8": 1, "empty": 1}
    assert info["files"] == {"train": len(train), "held_out": len(held_out)}
    assert info["bytes"]["train"] == sum(len(text.encode()) for text in train)
    assert len(train) + len(held_out) == 40
    duplicated = {(root / "pkg0" / "copy.py").read_text()}  # either copy may be the one kept
    expected_held_out = {path.read_text() for path in root.rglob("module*.py")
                         if trained_lm.is_held_out(str(path.relative_to(root)), 0.25)}
    assert set(held_out) - duplicated == expected_held_out - duplicated
    assert 0 < len(held_out) < len(train)
    other_train, other_held_out, _ = collect(1)
    assert set(other_held_out) == set(held_out)  # the split does not follow the seed
    assert other_train != train and sorted(other_train) == sorted(train)


def test_parse_args_quick_and_overrides(tmp_path):
    full = trained_lm.parse_args(["--out", str(tmp_path)])
    assert (full.vocab, full.width, full.layers, full.n, full.minutes) == (32768, 768, 4, 8192, 4)
    assert full.steps is None and full.device == "" and full.seed == 0
    quick = trained_lm.parse_args(["--out", str(tmp_path), "--quick", "--seed", "3"])
    assert (quick.vocab, quick.width, quick.device, quick.seed) == (512, 32, "cpu", 3)
    assert quick.steps == 20
    steps = trained_lm.parse_args(["--out", str(tmp_path), "--quick", "--steps", "5",
                                   "--device", "meta"])
    assert (steps.steps, steps.device) == (5, "meta")
    timed = trained_lm.parse_args(["--out", str(tmp_path), "--quick", "--minutes", "0.1"])
    assert timed.steps is None and timed.minutes == 0.1
    for bad in (["--steps", "0"], ["--minutes", "0"]):
        with pytest.raises(SystemExit):
            trained_lm.parse_args(["--out", str(tmp_path), *bad])


def test_learning_rate_schedule(tmp_path):
    settings = trained_lm.Settings(out=tmp_path, lr=1e-3, warmup=0.1, min_lr_ratio=0.1)
    assert trained_lm.learning_rate(settings, 0.0) == 0.0
    assert trained_lm.learning_rate(settings, 0.05) == pytest.approx(5e-4)
    assert trained_lm.learning_rate(settings, 0.1) == pytest.approx(1e-3)
    assert trained_lm.learning_rate(settings, 0.55) == pytest.approx(5.5e-4)
    assert trained_lm.learning_rate(settings, 1.0) == pytest.approx(1e-4)
    assert trained_lm.learning_rate(settings, 1.5) == pytest.approx(1e-4)  # stays at the floor


def test_lm_head_suite_runs_the_trained_regime(run_dir, saved, tmp_path):
    """``run.py lm-head --regimes trained``: one case at the trained model's own head and rows,
    whatever the shapes chosen, with the file's E, C and y as inputs."""
    (run_module,) = import_benchmarks("run")
    code = run_module.main(["lm-head", "--quick", "--device", "cpu", "--regimes", "trained",
                            "--shapes", "gemma2-2b", "--trained-lm", str(run_dir),
                            "--providers", "torch-eager", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads(next(tmp_path.glob("lm_head_*.json")).read_text(encoding="utf-8"))
    (case,) = data["cases"]
    vocab, width = saved["C"].shape
    assert (case["regime"], case["vocab_size"], case["hidden_size"]) == ("trained", vocab, width)
    assert case["n"] == min(saved["E"].shape[0], 128)
    logits = saved["E"][: case["n"]].double() @ saved["C"].double().T
    want = F.cross_entropy(logits, saved["y"][: case["n"]]).item()
    assert case["reference_loss"] == pytest.approx(want, rel=1e-6)


def test_lm_head_suite_without_trained_file_says_how_to_make_it(tmp_path, monkeypatch, capsys):
    (run_module,) = import_benchmarks("run")
    monkeypatch.delenv(inputs.TRAINED_LM_ENV, raising=False)
    code = run_module.main(["lm-head", "--quick", "--device", "cpu", "--regimes", "trained",
                            "--providers", "torch-eager", "--out", str(tmp_path)])
    assert code == 2
    assert "python -m benchmarks.trained_lm --out DIR" in capsys.readouterr().out
