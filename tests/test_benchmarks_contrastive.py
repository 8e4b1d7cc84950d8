"""Smoke tests of the contrastive benchmark suite (benchmarks/suites/contrastive.py) on CPU.

Inputs, the chunked float64 reference, the materialized PyTorch losses, the inf-cl wrapper,
error handling and results files are checked with tiny sizes; the end-to-end
run uses ``--quick`` with fusedloss's torch backend. Timing through ``do_bench`` and memory
figures need CUDA and are tested only there.
"""

from __future__ import annotations

import importlib
import math
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import import_benchmarks, read_results, requires_cuda

from fusedloss import reference

common, inputs, providers, contrastive, run_module = import_benchmarks(
    "common", "inputs", "providers", "suites.contrastive", "run"
)

CPU = torch.device("cpu")


def clip_losses_float64(image, text, scale):
    """(image→text, text→image) mean CLIP losses in float64, via F.cross_entropy."""
    logits = scale * image.double() @ text.double().T
    labels = torch.arange(logits.shape[0])
    return float(F.cross_entropy(logits, labels)), float(F.cross_entropy(logits.T, labels))


# ----------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("regime", inputs.PAIR_REGIMES)
def test_pair_features_shapes_norms_and_seed(regime):
    image, text = inputs.make_pair_features(40, 24, regime, seed=3)
    assert image.shape == text.shape == (40, 24) and image.dtype == torch.bfloat16
    norms = torch.cat([image, text]).double().norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
    again = inputs.make_pair_features(40, 24, regime, seed=3)
    assert torch.equal(image, again[0]) and torch.equal(text, again[1])
    assert not torch.equal(image, inputs.make_pair_features(40, 24, regime, seed=4)[0])
    fp32 = inputs.make_pair_features(5, 8, regime, dtype=torch.float32)
    assert fp32[0].dtype == torch.float32


def test_pair_regimes_scales_and_errors():
    assert inputs.pair_logit_scale("random") == pytest.approx(1 / 0.07)
    assert inputs.pair_logit_scale("trained") == 100.0
    with pytest.raises(ValueError, match="regime"):
        inputs.make_pair_features(4, 4, "peaked")
    with pytest.raises(ValueError, match="regime"):
        inputs.pair_logit_scale("flat")


def documented_trained_pairs(b, c, generator):
    """The "trained" regime as ``make_pair_features`` documents it, written anew on a random
    stream of its own: unit cluster centres c_k (b // cluster_size of them), a cluster per
    pair, image_i = normalize(c_k + a·w_i + s·n_i), text_i = normalize(c_k + a·w_i + s·n'_i)
    with unit w_i, n_i, n'_i (float32: its rounding is far below the statistics' spread)."""

    def unit(rows):
        return F.normalize(torch.randn(rows, c, generator=generator), dim=1)

    clusters = max(1, b // inputs.TRAINED_CLUSTER_SIZE)
    base = unit(clusters)[torch.randint(0, clusters, (b,), generator=generator)]
    base = base + inputs.TRAINED_LATENT * unit(b)
    image = F.normalize(base + inputs.TRAINED_NOISE * unit(b), dim=1)
    return image, F.normalize(base + inputs.TRAINED_NOISE * unit(b), dim=1)


def trained_statistics(image, text):
    """The positive pairs' mean cosine, the mean of each row's three largest off-diagonal
    cosines (its cluster mates: about 8 per row), the median cosine of the other pairs and the
    two CLIP losses at the trained logit scale."""
    cosine = image.float() @ text.float().T
    eye = torch.eye(len(cosine), dtype=torch.bool)
    logits, labels = inputs.TRAINED_LOGIT_SCALE * cosine, torch.arange(len(cosine))
    i2t, t2i = F.cross_entropy(logits, labels), F.cross_entropy(logits.T, labels)
    return dict(positive=float(cosine.diagonal().mean()),
                mates=float(cosine.masked_fill(eye, -2.0).topk(3, dim=1).values.mean()),
                median=float(cosine[~eye].median()), i2t=float(i2t), t2i=float(t2i))


def test_trained_regime_structure_and_loss():
    b, c = 1024, 512
    a, s = inputs.TRAINED_LATENT, inputs.TRAINED_NOISE
    image, text = inputs.make_pair_features(b, c, "trained")
    got = trained_statistics(image, text)
    # Positive pairs, analytically: inner products of independent random unit vectors in R^c
    # have mean 0 and variance 1/c, so <image_i, text_i> -> (1 + a²) / (1 + a² + s²) (0.348);
    # the ratio's second-order terms move its expectation by -0.26/c (within 1/c), and the mean
    # of b pairs lies within 5 standard errors of that.
    positive = (image.double() * text.double()).sum(1)
    expected = (1 + a * a) / (1 + a * a + s * s)
    assert abs(got["positive"] - expected) <= 1 / c + 5 * float(positive.std()) / math.sqrt(b)
    # The rest has no closed form: 16 batches of the documented model give each statistic's
    # mean and spread, and the benchmark's batch must lie within 5 of those standard deviations
    # (a t-test with 15 degrees of freedom: a chance failure below 2e-4). It checks the
    # generator against its docstring: cluster mates (cosine 1 / (1 + a² + s²) ≈ 0.29 each)
    # far above unrelated pairs (0 ± 1/√c, median ≈ 0 by symmetry), and the loss they give.
    generator = torch.Generator().manual_seed(12345)
    model = [trained_statistics(*documented_trained_pairs(b, c, generator)) for _ in range(16)]
    for key in ("mates", "median", "i2t", "t2i"):
        values = torch.tensor([m[key] for m in model], dtype=torch.float64)
        mean, spread = float(values.mean()), float(values.std())
        assert abs(got[key] - mean) <= 5 * spread * math.sqrt(1 + 1 / len(model)), (key, got)
    # Random pairs at logit scale σ = 1/0.07: each cos_ij has mean 0 and variance 1/c (nearly
    # normal), so E log Σ_j exp(σ cos_ij) = log b + σ²/(2c) up to O(1/b) (a sum of b
    # independent terms), and E[-σ cos_ii] = 0; each row's loss spreads by about σ/√c, and the
    # mean of b rows lies within 5 standard errors of that.
    random_image, random_text = inputs.make_pair_features(b, c, "random")
    sigma = inputs.RANDOM_LOGIT_SCALE
    rows = F.cross_entropy(sigma * random_image.double() @ random_text.double().T,
                           torch.arange(b), reduction="none")
    expected = math.log(b) + sigma**2 / (2 * c)
    assert abs(float(rows.mean()) - expected) <= 1 / b + 5 * float(rows.std()) / math.sqrt(b)


# ----------------------------------------------------------------------------- reference


def _leaves(*tensors):
    return [t.detach().double().requires_grad_(True) for t in tensors]


def _clip_args(b=23, c=16, regime="trained", scale=30.0):
    image, text = inputs.make_pair_features(b, c, regime, seed=1)
    return image, text, torch.tensor(scale, requires_grad=True)


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 0])
def test_reference_clip_matches_autograd(rows_per_chunk):
    args = _clip_args()
    ref = contrastive.contrastive_reference(
        "clip", args, with_grads=True, rows_per_chunk=rows_per_chunk
    )
    i, t, s = _leaves(*args)
    loss = reference.clip_loss_ref(i, t, s)
    grads = torch.autograd.grad(loss, (i, t, s))
    assert ref.loss == pytest.approx(float(loss.detach()), rel=1e-12)
    assert ref.directions == pytest.approx(clip_losses_float64(args[0], args[1], 30.0), rel=1e-10)
    for name, expected in zip(("dI", "dT", "ds"), grads, strict=True):
        assert torch.allclose(ref.grads[name], expected, rtol=1e-9, atol=1e-13), name
    assert ref.dtype == "float64"


@pytest.mark.parametrize("rows_per_chunk", [1, 5, 0])
def test_reference_nt_xent_matches_autograd(rows_per_chunk):
    view1, view2 = inputs.make_pair_features(9, 16, "trained", seed=2)
    features = torch.cat([view1, view2])
    ref = contrastive.contrastive_reference(
        "nt-xent", (features, 0.5), with_grads=True, rows_per_chunk=rows_per_chunk
    )
    (z,) = _leaves(features)
    loss = reference.nt_xent_loss_ref(z, 0.5)
    (grad,) = torch.autograd.grad(loss, (z,))
    assert ref.loss == pytest.approx(float(loss.detach()), rel=1e-12)
    assert torch.allclose(ref.grads["dZ"], grad, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("rows_per_chunk", [1, 6, 0])
def test_reference_siglip_matches_autograd(rows_per_chunk):
    image, text = inputs.make_pair_features(17, 16, "random", seed=5)
    args = (image, text, torch.tensor(10.0), torch.tensor(-10.0))
    ref = contrastive.contrastive_reference(
        "siglip", args, with_grads=True, rows_per_chunk=rows_per_chunk
    )
    i, t, s, bias = _leaves(*args)
    loss = reference.siglip_loss_ref(i, t, s, bias)
    grads = torch.autograd.grad(loss, (i, t, s, bias))
    assert ref.loss == pytest.approx(float(loss.detach()), rel=1e-12)
    for name, expected in zip(("dI", "dT", "ds", "db"), grads, strict=True):
        assert torch.allclose(ref.grads[name], expected, rtol=1e-9, atol=1e-13), name


def test_reference_loss_only_in_float32():
    args = _clip_args(b=64, c=32)
    exact = contrastive.contrastive_reference("clip", args, with_grads=True)
    loss_only = contrastive.contrastive_reference(
        "clip", args, with_grads=False, dtype=torch.float32, rows_per_chunk=10
    )
    assert loss_only.grads is None and loss_only.dtype == "fp32 (TF32 products)"
    assert loss_only.loss == pytest.approx(exact.loss, rel=1e-5)


# ----------------------------------------------------------------------------- providers


def _case(loss, rows, width, regime="trained"):
    shape = {"clip": "clip-16k", "nt-xent": "nt-xent-64k", "siglip": "siglip-16k",
             "info-nce": "info-nce-16k"}[loss]
    providers_run = contrastive.SHAPES[shape][-1]
    return contrastive.Case(shape, loss, rows, width, regime, providers_run)


def _grad_leaves(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("loss", ["clip", "nt-xent", "siglip", "info-nce"])
def test_materialized_and_fusedloss_providers_agree_with_reference(loss):
    case = _case(loss, 32, 16)
    args = contrastive.make_case_inputs(case, dtype=torch.float32, device=CPU, seed=0)
    ref = contrastive.contrastive_reference(loss, args, with_grads=True)
    assert list(ref.grads) == list(contrastive.GRAD_NAMES[loss])
    for key in ("torch", "fusedloss"):
        provider = providers.contrastive_providers("torch")[key]
        assert provider.supports(loss) and provider.describe(loss)
        value = provider.build(CPU, loss)(*args)
        grads = torch.autograd.grad(value, _grad_leaves(args))
        assert float(value.detach()) == pytest.approx(ref.loss, rel=1e-4), key
        for name, grad in zip(contrastive.GRAD_NAMES[loss], grads, strict=True):
            assert common.relative_l2_error(grad, ref.grads[name]) < 1e-4, (key, name)


def test_provider_table_and_inf_cl_support():
    table = providers.contrastive_providers("torch")
    assert list(table) == list(contrastive.PROVIDER_KEYS)
    for key in ("fusedloss", "fusedloss-compile", "torch"):
        assert all(table[key].supports(loss) for loss in ("clip", "nt-xent", "siglip")), key
    assert table["inf-cl"].supports("clip") and not table["inf-cl"].supports("nt-xent")
    assert table["fusedloss-compile"].describe("clip").startswith("torch.compile(")
    assert [providers.inf_cl_head_dim(c) for c in (512, 768, 64, 96, 16)] == [256, 256, 64, 32, 16]
    with pytest.raises(providers.Unavailable):
        providers.inf_cl_head_dim(24)


def _fake_cal_inf_loss(q, k, labels=None, scale=None, head_dim=256):
    """inf-cl's semantics in plain torch: scale·q, one direction, mean CE (fp32)."""
    assert q.shape[1] % head_dim == 0
    scale = 1.0 if scale is None else scale
    logits = (scale * q).float() @ k.float().T
    return F.cross_entropy(logits, labels)


def test_inf_clip_wrapper_gives_the_clip_loss():
    image, text, scale = _clip_args(b=20, c=32)
    loss_fn = providers.inf_clip_loss(_fake_cal_inf_loss)
    value = loss_fn(image.float(), text.float(), scale)
    expected = reference.clip_loss_ref(image, text, 30.0)
    assert float(value.detach()) == pytest.approx(float(expected), rel=1e-5)
    (grad_scale,) = torch.autograd.grad(value, (scale,))
    assert torch.isfinite(grad_scale)


def test_inf_cl_missing_or_without_cuda(monkeypatch):
    provider = providers.contrastive_providers()["inf-cl"]
    real_import = importlib.import_module

    def no_inf_cl(name, *args):
        if name.startswith("inf_cl"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(providers.importlib, "import_module", no_inf_cl)
    with pytest.raises(providers.Unavailable, match="pip install inf-cl"):
        provider.build(CPU, "clip")
    fake = types.ModuleType("inf_cl")
    fake.cal_inf_loss = _fake_cal_inf_loss
    monkeypatch.setattr(providers.importlib, "import_module", lambda name, *a: fake)
    with pytest.raises(providers.Unavailable, match="CUDA"):
        provider.build(CPU, "clip")
    providers.destroy_benchmark_process_group()  # nothing created: a no-op


# ----------------------------------------------------------------------------- run_provider


class _FakeProvider(providers.Provider):
    def __init__(self, key, fn, is_peer=False):
        self.key, self.label, self.fn, self.is_peer = key, key, fn, is_peer

    def build(self, device, loss):
        if self.fn is None:
            raise providers.Unavailable("fake_peer not importable") from ImportError("no module")
        return self.fn

    def describe(self, loss):
        return f"{self.key}(...)"


def _raise(error):
    def fn(*args):
        raise error

    return fn


def _clip_case_inputs():
    case = _case("clip", 16, 16, "random")
    args = contrastive.make_case_inputs(case, dtype=torch.float32, device=CPU, seed=0)
    return case, args, contrastive.contrastive_reference("clip", args, with_grads=True)


def test_run_provider_reports_failures_and_goes_on():
    case, args, ref = _clip_case_inputs()
    timing = common.TimingSettings(0.0, 1.0)
    good = providers.materialized_clip_loss
    outcomes = {
        key: contrastive.run_provider(
            _FakeProvider(key, fn, is_peer), case, args, ref, timing=timing, floor_ms=1.0
        )
        for key, fn, is_peer in [
            ("oom", _raise(RuntimeError("CUDA out of memory. Tried to allocate 64 GiB")), False),
            ("broken", _raise(ValueError("bad shapes")), False),
            ("off", lambda i, t, s: good(i, t, s) + 1.0, False),
            ("absent", None, True),
            ("good", good, False),
        ]
    }
    assert outcomes["oom"]["status"] == common.OUT_OF_MEMORY and outcomes["oom"]["ms"] is None
    assert outcomes["broken"]["status"] == common.FAILED
    assert "ValueError: bad shapes" in outcomes["broken"]["note"]
    assert outcomes["off"]["status"] == common.WRONG and outcomes["off"]["ms"] > 0
    assert outcomes["absent"]["status"] == common.NOT_INSTALLED
    good = outcomes["good"]
    assert good["status"] == common.OK and good["ms"] > 0 and good["timing"] == "wall-clock median"
    assert good["times_floor"] == pytest.approx(good["ms"])
    assert set(good["errors"]) == {"dI", "dT", "ds"} and good["loss_error"] < 1e-5
    assert good["peak_extra_mib"] is None  # no memory figures without CUDA


@pytest.mark.parametrize("budget_ms, reps", [(1e9, 3), (0.0, 2)])
def test_slow_calls_are_timed_one_by_one(monkeypatch, budget_ms, reps):
    """Calls at or above SLOW_MS: clamp(SLOW_BUDGET_MS / call, 2, SLOW_MAX_REPS) timed calls."""
    monkeypatch.setattr(contrastive, "SLOW_MS", 0.0)
    monkeypatch.setattr(contrastive, "SLOW_BUDGET_MS", budget_ms)
    case, args, ref = _clip_case_inputs()
    calls = []

    def counted(*loss_args):
        calls.append(1)
        return providers.materialized_clip_loss(*loss_args)

    result = contrastive.run_provider(_FakeProvider("slow", counted), case, args, ref,
                                      timing=common.TimingSettings(), floor_ms=1.0)
    assert result["timing"] == f"median of {reps} timed calls" and result["ms"] > 0
    assert len(calls) == 1 + reps  # the check, then the timed calls


# ----------------------------------------------------------------------------- cases


def test_case_selection_quick_sizes_and_floors():
    cases = contrastive.select_cases(None, None, False)
    labels = [c.label for c in cases]
    assert labels[:2] == ["clip 16384×512 random", "clip 16384×512 trained"]
    assert "clip 1048576×512 random" in labels and "clip 1048576×512 trained" not in labels
    assert "siglip 16384×512 trained" not in labels
    quick = contrastive.select_cases(["clip-1m", "nt-xent-64k"], ["trained"], True)
    assert [(c.shape, c.rows, c.width) for c in quick] == [
        ("clip-1m", 4096, 64),
        ("nt-xent-64k", 256, 32),
    ]
    assert quick[1].label == "nt-xent 2×128×32 trained"
    clip16k = cases[0]
    assert clip16k.floor_ms(723.0) == pytest.approx(8 * 16384**2 * 512 / 723e12 * 1e3)
    by_label = {c.label: c for c in cases}
    reference_dtypes = {label: by_label[label].reference_dtype for label in (
        "clip 16384×512 random", "nt-xent 2×32768×256 random", "clip 65536×512 random",
        "clip 262144×512 random", "clip 1048576×512 random")}
    assert list(reference_dtypes.values()) == [
        torch.float64, torch.float64, torch.float32, torch.float32, None]
    assert by_label["clip 16384×512 trained"].parameters == {"logit_scale": 100.0}
    assert by_label["siglip 16384×512 random"].parameters == {
        "logit_scale": 10.0, "logit_bias": -10.0}
    assert {c.shape: c.providers for c in cases}["clip-256k"] == ("fusedloss", "fusedloss-compile")


# ----------------------------------------------------------------------------- files, CLI


def _result(key, ms=None, mib=None, floor=None):
    return common.new_row(key, key, ms=ms, peak_extra_mib=mib, times_floor=floor)


def test_report_tables():
    shape = contrastive.SHAPES["clip-16k"]
    case = contrastive.Case("clip-16k", shape[0], shape[1], shape[2], "random", shape[-1])
    ours = _result("fusedloss", 3.0, 10.0, floor=2.0)
    ours.update(errors={"dI": 2.5e-3}, ratios={"dI": 0.85})
    ours["times_products"] = 2.0
    case_results = [contrastive.CaseResult(
        case, case.floor_ms(723.0), contrastive.Reference(9.9, "float64", (9.8, 10.0)),
        {"fusedloss": ours, "torch": _result("torch", 13.1)}, {"ms": 1.5})]
    info = dict(environment=common.collect_environment("cpu"),
                settings=dict(dtype="bf16", seed=0, quick=False, warmup_ms=100, rep_ms=1000,
                              backend="triton", providers=["fusedloss", "torch", "inf-cl"]),
                matmul={"size": 8192, "dtype": "bf16", "ms": 1.52, "tflops": 723.0},
                peer_versions={"inf-cl": None}, calls={}, notes=["inf-cl skipped"])
    markdown = common.markdown_report(info["environment"], "Contrastive losses",
                                      *contrastive.report_sections(info, case_results),
                                      notes=info["notes"])
    for text in (
        "723 TFLOP/s",
        "max_memory_allocated",
        "| 9.9000 (i→t 9.8000, t→i 10.0000), float64 | dI 2.5e-03 (0.85×) | — |",
        "| floor 8r²c/R | 4r²c/R | fusedloss × floor | products | fusedloss × products |",
        "| 3.00 / 10.0 | 13.1 / — | 3.00 (fusedloss) | 1.52 | 0.76 | 2.00 | 1.50 | 2.00 |",
        "products: the median ms of the cuBLAS products",
        "inf-cl not installed",
        "## Notes",
    ):
        assert text in markdown, text
    text_tables = contrastive.result_tables(case_results, text=True)
    assert "|" not in text_tables["Time and memory"]


def test_cli_options_and_cpu_refusal(tmp_path):
    with pytest.raises(SystemExit):
        run_module.main(["contrastive", "--shapes", "clip-2m"])
    with pytest.raises(SystemExit):
        run_module.main(["contrastive", "--providers", "open-clip"])
    if not torch.cuda.is_available():
        assert run_module.main(["contrastive", "--out", str(tmp_path)]) == 2


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path, capsys):
    options = (
        "contrastive --quick --shapes clip-16k,siglip-16k,nt-xent-64k "
        "--providers fusedloss,torch,inf-cl --rep-ms 1 --warmup-ms 0"
    )
    if torch.cuda.is_available():
        options += " --device cpu"
    assert run_module.main([*options.split(), "--out", str(tmp_path), "--tag", "t"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("nt-xent 2×128×32 trained ")
    assert "reference loss" in printed and "mean loss (reference)" in printed
    data, markdown = read_results(tmp_path, "contrastive_*_t")
    assert [(c["case"]["shape"], c["case"]["regime"]) for c in data["cases"]] == [
        ("clip-16k", "random"),
        ("clip-16k", "trained"),
        ("siglip-16k", "random"),
        ("nt-xent-64k", "random"),
        ("nt-xent-64k", "trained"),
    ]
    for case in data["cases"]:
        results = case["results"]
        clip = case["case"]["loss"] == "clip"
        expected = {"fusedloss", "torch", "inf-cl"} if clip else {"fusedloss", "torch"}
        assert set(results) == expected
        for key in ("fusedloss", "torch"):
            assert results[key]["status"] == "ok" and results[key]["ms"] > 0, (case, key)
            assert results[key]["errors"], (case, key)
        assert results["torch"]["ratios"] and all(
            v == pytest.approx(1.0) for v in results["torch"]["ratios"].values()
        )
        if clip:
            assert results["inf-cl"]["status"] in ("not installed", "unavailable")
        assert case["reference"]["dtype"] == "float64" and case["reference"]["grads"] is None
    assert common.QUICK_NOTE in markdown and "## Losses and gradient accuracy" in markdown


@pytest.mark.slow  # ~18 s: make test-slow
def test_grid_run_times_the_products_and_plots(tmp_path, capsys):
    """``--losses/--rows/--widths``: every combination, each with its cuBLAS products (two
    logit products, SigLIP's one) and fusedloss's ratio to them; ``--plot`` draws ms against b
    from the results file, a panel per loss and width, the products dashed."""
    grid = contrastive.select_cases(None, None, True, (["info-nce", "siglip"], [16384], [512]))
    assert [(c.shape, c.loss, c.rows, c.width, c.logit_products) for c in grid] == [
        ("info-nce-16384x512", "info-nce", 64, 64, 2), ("siglip-16384x512", "siglip", 64, 64, 1)]
    assert grid[0].parameters == {"temperature": contrastive.INFO_NCE_TEMPERATURE}
    options = ("contrastive --quick --losses info-nce,siglip --rows 16384,32768 --widths 512 "
               "--providers fusedloss,torch --rep-ms 1 --warmup-ms 0 --device cpu")
    assert run_module.main([*options.split(), "--out", str(tmp_path), "--tag", "g"]) == 0
    capsys.readouterr()
    data, markdown = read_results(tmp_path, "contrastive_*_g")
    assert data["settings"]["grid"] == [["info-nce", "siglip"], [16384, 32768], [512]]
    assert len(data["cases"]) == 4 and "| products | fusedloss × products |" in markdown
    for case in data["cases"]:
        assert case["products"]["ms"] > 0 and case["products"]["logit_products"] == (
            1 if case["case"]["loss"] == "siglip" else 2)
        ours = case["results"]["fusedloss"]
        assert ours["status"] == "ok" and ours["times_products"] == pytest.approx(
            ours["ms"] / case["products"]["ms"])
    pytest.importorskip("matplotlib")
    out = tmp_path / "speed.svg"
    (results,) = tmp_path.glob("contrastive_*_g.json")
    assert run_module.main(["contrastive", "--plot", str(results), "--out", str(out)]) == 0
    svg = out.read_text(encoding="utf-8")
    for text in ("info-nce, c = 64", "siglip, c = 64", "products (cuBLAS", "torch materialized"):
        assert text in svg, text


@requires_cuda
def test_quick_run_times_with_do_bench_on_cuda(tmp_path, monkeypatch):
    # Under a loaded test run the first calls can pass the slow-call threshold.
    monkeypatch.setattr(contrastive, "SLOW_MS", 1e9)
    options = "contrastive --quick --shapes clip-16k --providers fusedloss,torch"
    assert run_module.main([*options.split(), "--out", str(tmp_path)]) == 0
    data, _ = read_results(tmp_path, "contrastive_*")
    for result in data["cases"][0]["results"].values():
        assert result["status"] == "ok" and result["timing"] == "do_bench"
        assert result["peak_extra_mib"] is not None
