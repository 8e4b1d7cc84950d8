"""The demo (``python -m fusedloss demo``) on tiny configurations: both heads train alike; and
at the CPU preset's size, one step of each head: fusedloss's step peaks well below PyTorch's."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import pytest
import torch

from fusedloss import demo
from fusedloss.__main__ import main as cli_main

TINY = demo.LM_SIZES["tiny"]
TINY_CLIP = demo.CLIP_SIZES["tiny"]
EXPERIMENTS = ["lm", "clip"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_comparisons() -> dict[str, demo.Comparison]:
    """One tiny CPU run of each experiment, shared by the tests below."""
    cpu = torch.device("cpu")
    return {
        "lm": demo.lm_experiment(TINY, cpu, verbose=False),
        "clip": demo.clip_experiment(TINY_CLIP, cpu, verbose=False),
    }


@pytest.fixture
def tiny_comparison(tiny_comparisons) -> demo.Comparison:
    """The tiny LM comparison."""
    return tiny_comparisons["lm"]


def test_source_is_deterministic_and_zipf_markov():
    source = demo.ZipfMarkovSource(vocab_size=512, support_size=8, seed=3)
    again = demo.ZipfMarkovSource(vocab_size=512, support_size=8, seed=3)
    batch = source.batch(step=5, batch_size=4, seq_len=32)
    assert batch.shape == (4, 32) and batch.dtype == torch.int64
    assert torch.equal(batch, again.batch(step=5, batch_size=4, seq_len=32))
    assert not torch.equal(batch, source.batch(step=6, batch_size=4, seq_len=32))
    # Every transition is one of the current token's successors.
    allowed = source.successors[batch[:, :-1]]  # (4, 31, K)
    assert (allowed == batch[:, 1:, None]).any(-1).all()
    assert 0 < source.optimal_loss(seq_len=32) < math.log(8)  # at most K successors


def test_pair_source_is_deterministic_with_unit_signal_and_noise():
    source = demo.PairedLatentSource(latent_dim=4, image_dim=12, text_dim=8, noise=0.5, seed=3)
    again = demo.PairedLatentSource(latent_dim=4, image_dim=12, text_dim=8, noise=0.5, seed=3)
    images, texts = source.batch(step=5, batch_size=4096)
    assert images.shape == (4096, 12) and texts.shape == (4096, 8)
    assert images.dtype == texts.dtype == torch.float32
    for x, y in zip((images, texts), again.batch(step=5, batch_size=4096), strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(images, source.batch(step=6, batch_size=4096)[0])
    # The same latents without noise: unit-variance views, and the noise is of the stated size.
    clean = demo.PairedLatentSource(latent_dim=4, image_dim=12, text_dim=8, noise=0.0, seed=3)
    clean_views = clean.batch(step=5, batch_size=4096)
    for noisy_view, clean_view in zip((images, texts), clean_views, strict=True):
        variance = clean_view.var(dim=0)
        torch.testing.assert_close(variance, torch.ones_like(variance), atol=0.15, rtol=0)
        assert (noisy_view - clean_view).std().item() == pytest.approx(0.5, rel=0.05)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_both_heads_trace_the_same_curve(tiny_comparisons, experiment):
    tiny_comparison = tiny_comparisons[experiment]
    steps = {"lm": TINY, "clip": TINY_CLIP}[experiment].steps
    reference, candidate = tiny_comparison.reference, tiny_comparison.candidate
    assert (reference.name, candidate.name) == ("pytorch", "fusedloss")
    assert len(reference.losses) == len(candidate.losses) == steps
    assert all(math.isfinite(loss) for loss in reference.losses + candidate.losses)
    assert max(abs(d) for d in tiny_comparison.differences()) < 1e-4
    assert tiny_comparison.agrees()
    assert reference.losses[-1] < reference.losses[0] - 0.5  # it does learn
    # lm: the loss is inside the Hugging Face model's forward, so the whole step is measured.
    assert tiny_comparison.measured == {"lm": "training step", "clip": "loss layer"}[experiment]
    for run in (reference, candidate):
        assert run.loss_layer_peak_bytes is not None and run.loss_layer_peak_bytes > 0
        assert run.mean_loss_layer_ms(skip=3) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_compute_the_same_loss(dtype):
    """The lm heads are the Hugging Face model, unpatched and patched with apply_fusedloss: the
    same loss (autocast to ``dtype``), and the patched one builds no logits."""
    tokens = demo.lm_source(TINY).batch(step=0, batch_size=2, seq_len=TINY.seq_len)
    outputs = {}
    for name, head in demo.LM_HEADS.items():
        torch.manual_seed(0)
        model = head(demo.build_lm(TINY))
        autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
        with autocast:
            outputs[name] = model(input_ids=tokens, labels=tokens)
    fused, reference = outputs["fusedloss"], outputs["pytorch"]
    assert type(fused.loss) is torch.Tensor and fused.loss.dtype == torch.float32
    assert fused.logits is None and reference.logits is not None
    # bf16: PyTorch rounds the logits to bf16 before its fp32 softmax; fusedloss does not.
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused.loss, reference.loss, rtol=tolerance, atol=tolerance)


def test_fusedloss_step_holds_less_memory_at_the_cpu_preset():
    """One measured step of each head at the size ``make demo`` trains on the CPU: PyTorch's
    step holds the B·T×V fp32 logits (and more of that size), fusedloss's well under half."""
    config = replace(demo.LM_SIZES["small"], steps=1)  # memory_step is clamped to step 0
    assert config == replace(demo.config_from_args(demo.build_parser().parse_args([]),
                                                   torch.device("cpu")), steps=1)
    source = demo.lm_source(config)
    peaks = {
        name: demo.train_lm(config, name, torch.device("cpu"), source).loss_layer_peak_bytes
        for name in ("pytorch", "fusedloss")
    }
    logits_bytes = config.logit_rows * config.vocab_size * 4
    assert peaks["pytorch"] > 2 * logits_bytes
    assert peaks["fusedloss"] < 0.5 * peaks["pytorch"]
    assert peaks["fusedloss"] < 1.5 * logits_bytes


def test_lm_is_skipped_without_transformers(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    comparisons = demo.main(["--size", "tiny", "--steps", "4", "--out", str(tmp_path)])
    assert list(comparisons) == ["clip"]
    out = capsys.readouterr().out
    assert "lm experiment skipped" in out and "pip install 'fusedloss[demo]'" in out
    assert out.count("verdict:") == 1
    with pytest.raises(ImportError, match="needs transformers"):
        demo.build_lm(TINY)


def test_learned_logit_scales_agree(tiny_comparisons):
    reference, candidate = tiny_comparisons["clip"].reference, tiny_comparisons["clip"].candidate
    scales = reference.final_values["logit_scale"], candidate.final_values["logit_scale"]
    assert scales[0] != pytest.approx(1 / 0.07, abs=1e-3)  # it is learned
    assert scales[1] == pytest.approx(scales[0], rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_heads_compute_the_same_loss_and_gradients(dtype):
    generator = torch.Generator().manual_seed(0)
    features = [
        torch.nn.functional.normalize(torch.randn(24, 16, generator=generator), dim=1)
        .to(dtype)
        .requires_grad_()
        for _ in range(2)
    ]
    scale = torch.tensor(1 / 0.07, requires_grad=True)
    results = []
    for head in (demo.fusedloss_clip_head, demo.pytorch_clip_head):
        loss = head(*features, scale)
        results.append((loss, *torch.autograd.grad(loss, [*features, scale])))
    fused, reference = results
    assert fused[0].dtype == reference[0].dtype == torch.float32
    # bf16: PyTorch rounds the logits to bf16 before its fp32 softmax; fusedloss does not.
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for f, r in zip(fused, reference, strict=True):
        torch.testing.assert_close(f.float(), r.float(), rtol=tolerance, atol=tolerance)


def test_clip_train_step_clamps_logit_scale():
    torch.manual_seed(0)
    model = demo.TwoTower(TINY_CLIP)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step leaves it at 500
    images, texts = demo.clip_source(TINY_CLIP).batch(step=0, batch_size=8)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(500.0))
    demo.clip_train_step(model, optimizer, images, texts, demo.fusedloss_clip_head, torch.float32)
    assert model.logit_scale.item() == pytest.approx(math.log(100.0))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_report_writes_png(tiny_comparisons, experiment, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib")
    tiny_comparison = tiny_comparisons[experiment]
    path = demo.report(tiny_comparison, torch.device("cpu"), tmp_path, "curves.png", every=5)
    assert path == tmp_path / "curves.png"
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    out = capsys.readouterr().out
    assert f"plot written to {path}" in out
    assert "verdict: max |difference|" in out and "AGREE" in out
    assert f"{tiny_comparison.measured} peak memory" in out


def test_report_without_matplotlib_skips_plot(tiny_comparison, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert demo.report(tiny_comparison, torch.device("cpu"), tmp_path, "c.png", every=5) is None
    assert not (tmp_path / "c.png").exists()
    assert "plot skipped: matplotlib is not installed" in capsys.readouterr().out


def test_command_line_runs_the_demo(tmp_path, capsys):
    cli_main(["demo", "--size", "tiny", "--device", "cpu", "--steps", "8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "pytorch" in out and "fusedloss" in out
    assert "causal LM" in out and "CLIP-style two towers" in out
    assert out.count("verdict:") == 2
    assert out.rstrip().splitlines()[-1].startswith("verdict:")
    if "plot written to" in out:
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "clip_loss_curves.png",
            "lm_loss_curves.png",
        ]


def test_command_line_runs_one_experiment(tmp_path, capsys):
    comparisons = demo.main(
        ["--experiment", "clip", "--size", "tiny", "--steps", "4", "--out", str(tmp_path)]
    )
    assert list(comparisons) == ["clip"]
    assert len(comparisons["clip"].reference.losses) == 4
    out = capsys.readouterr().out
    assert "causal LM" not in out and out.count("verdict:") == 1


def test_config_from_args_applies_overrides():
    args = demo.build_parser().parse_args(
        ["--size", "large", "--steps", "7", "--dtype", "float32", "--seed", "4"]
    )
    config = demo.config_from_args(args, torch.device("cpu"))
    assert config == replace(demo.LM_SIZES["large"], steps=7, seed=4, head_dtype=torch.float32)
    auto = demo.config_from_args(demo.build_parser().parse_args([]), torch.device("cpu"))
    assert auto == demo.LM_SIZES["small"]
    clip = demo.config_from_args(args, torch.device("cpu"), demo.CLIP_SIZES)
    assert clip == replace(demo.CLIP_SIZES["large"], steps=7, seed=4, head_dtype=torch.float32)
    assert set(demo.CLIP_SIZES) == set(demo.LM_SIZES)  # --size picks from both


def test_optimizer_step_gives_the_gradient_of_one_backward():
    torch.manual_seed(0)
    body, weight = torch.nn.Linear(6, 4), torch.nn.Parameter(torch.randn(3, 4))
    x, labels = torch.randn(5, 6), torch.tensor([0, 2, 1, 1, 0])

    def loss_fn(hidden):
        return torch.nn.functional.cross_entropy(hidden @ weight.T, labels)

    parameters = [*body.parameters(), weight]
    expected = torch.autograd.grad(loss_fn(body(x)), parameters)
    optimizer = torch.optim.SGD(parameters, lr=0.0)  # keeps the gradients comparable
    loss, seconds, peak = demo.optimizer_step(optimizer, lambda: (body(x),), loss_fn)
    assert loss == pytest.approx(loss_fn(body(x)).item()) and seconds > 0 and peak is None
    for parameter, gradient in zip(parameters, expected, strict=True):
        torch.testing.assert_close(parameter.grad, gradient)


def test_run_training_measures_memory_at_one_step_only():
    measured = []
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    def train_step(step, measure_memory):
        measured.append(measure_memory)
        optimizer.step()  # the schedule expects it first
        return float(step), 1e-3, 64 if measure_memory else None

    result = demo.run_training("x", replace(TINY, steps=4), optimizer, train_step, memory_step=9)
    assert measured == [False, False, False, True]  # clamped to the last step
    assert result.losses == [0.0, 1.0, 2.0, 3.0] and result.loss_layer_peak_bytes == 64
    assert math.isnan(result.loss_layer_seconds[3])
    assert result.mean_loss_layer_ms(skip=0) == pytest.approx(1.0)
