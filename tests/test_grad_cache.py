"""fusedloss.distributed.grad_cache_step: one Gradient Cache step equals one plain step.

Every test runs the same model twice, deep copies of one initialization: once through
``grad_cache_step`` in micro-batches, once as a plain step (the towers on the whole batch, the
loss, ``backward``), and compares the loss and every parameter's gradient. With dropout the
plain step runs its towers micro-batch by micro-batch, with grad, in the same order, so that
both draw the same masks; the helper's replay of each micro-batch's RNG state makes its second
pass draw them again. Over 2 processes (gloo, ``workers.py``) the loss is the ring's, each
rank encodes its half of the batch, and the ranks' gradients averaged (what DDP gives) equal one
process's on the whole batch; with DDP towers each module all-reduces once per step.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from workers import Workers, all_ok

import fusedloss
import fusedloss.distributed as fd
from fusedloss.distributed import GradCache, grad_cache_step
from fusedloss.distributed import grad_cache as gc_module

# Same float32 ops in both; only the order of the gradients' sums differs (and BLAS blocking
# between a micro-batch and the whole batch): a few ulps.
TOL = dict(rtol=1e-5, atol=1e-6)


class Tower(nn.Module):
    """A small encoder to unit-norm features (b, 8)."""

    def __init__(self, d_in: int, p: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Dropout(p), nn.Linear(16, 8))

    def forward(self, x):
        return F.normalize(self.net(x), dim=1)


class TextTower(nn.Module):
    """Token ids and a mask (b, L) to unit-norm features (b, 8): a tower of several inputs."""

    def __init__(self, vocab: int = 20, p: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, 12)
        self.drop = nn.Dropout(p)
        self.proj = nn.Linear(12, 8)

    def forward(self, input_ids, attention_mask, pool: str = "mean"):
        assert pool == "mean"
        h = self.drop(self.emb(input_ids))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return F.normalize(self.proj((h * m).sum(1) / m.sum(1).clamp_min(1)), dim=1)


class Clip(nn.Module):
    def __init__(self, p: float = 0.0, text: str = "tensor", ring: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.image = Tower(6, p)
        self.text = Tower(5, p) if text == "tensor" else TextTower(p=p)
        self.log_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.ring = ring

    def loss(self, img, txt):
        clip = fd.clip_loss if self.ring else fusedloss.clip_loss
        return clip(img, txt, self.log_scale.exp(), backend="torch")


class SimClr(nn.Module):
    def __init__(self, p: float = 0.0, ring: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Tower(6, p)
        self.log_temperature = nn.Parameter(torch.tensor(math.log(0.5)))
        self.ring = ring

    def loss(self, z):
        nt_xent = fd.nt_xent_loss if self.ring else fusedloss.nt_xent_loss
        return nt_xent(z, self.log_temperature.exp(), backend="torch")

    def loss_of_views(self, z1, z2):
        return self.loss(torch.cat([z1, z2]))


def _data(b: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (b, 7), generator=g)
    mask = (torch.rand(b, 7, generator=g) > 0.3).long()
    return dict(image=torch.randn(b, 6, generator=g), text=torch.randn(b, 5, generator=g),
                ids=ids, mask=mask, v1=torch.randn(b, 6, generator=g),
                v2=torch.randn(b, 6, generator=g))


def _call(tower, x):
    if isinstance(x, dict):
        return tower(**x)
    return tower(*x) if isinstance(x, (tuple, list)) else tower(x)


def _rows(x, start, stop):
    if isinstance(x, dict):
        return {k: v[start:stop] if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return tuple(v[start:stop] for v in x)
    return x[start:stop]


def _batch_size(x):
    if isinstance(x, dict):
        return next(v for v in x.values() if isinstance(v, torch.Tensor)).shape[0]
    return (x[0] if isinstance(x, (tuple, list)) else x).shape[0]


def _plain_step(towers, inputs, loss_fn, chunk=None):
    """The reference: towers with grad (in micro-batches of ``chunk`` rows when given, to draw
    the same dropout masks as the helper), the loss, backward."""
    feats = []
    for tower, x in zip(towers, inputs, strict=True):
        b = _batch_size(x)
        step = chunk or b
        feats.append(torch.cat([_call(tower, _rows(x, s, s + step)) for s in range(0, b, step)]))
    loss = loss_fn(*feats)
    loss.backward()
    return loss.detach()


def _assert_same(model, ref, loss, ref_loss, tol=TOL):
    torch.testing.assert_close(loss, ref_loss, **tol)
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    for name, p in want.items():
        if p.grad is None:
            assert got[name].grad is None, name
            continue
        assert got[name].grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(got[name].grad, p.grad, **tol,
                                   msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------
# one process: equal to the plain step


@pytest.mark.parametrize("micro_batch_size", [1, 3, 4, 10, 16])
def test_clip_two_towers(micro_batch_size):
    """CLIP, learnable logit_scale; micro-batches that do and do not divide b = 10."""
    d = _data(10)
    model = Clip()
    ref = copy.deepcopy(model)
    loss = grad_cache_step([model.image, model.text], [d["image"], d["text"]], model.loss,
                           micro_batch_size=micro_batch_size)
    ref_loss = _plain_step([ref.image, ref.text], [d["image"], d["text"]], ref.loss)
    assert not loss.requires_grad
    assert model.log_scale.grad is not None and model.log_scale.grad.abs() > 0
    _assert_same(model, ref, loss, ref_loss)


@pytest.mark.parametrize("micro_batch_size", [2, 5, 7])
def test_simclr_two_views_of_one_tower(micro_batch_size):
    """One encoder for both views: the same module is towers[0] and towers[1]."""
    d = _data(6)
    model = SimClr()
    ref = copy.deepcopy(model)
    loss = grad_cache_step([model.encoder, model.encoder], [d["v1"], d["v2"]],
                           model.loss_of_views, micro_batch_size=micro_batch_size)
    ref_loss = _plain_step([ref.encoder, ref.encoder], [d["v1"], d["v2"]], ref.loss_of_views)
    _assert_same(model, ref, loss, ref_loss)


def test_simclr_one_feature_matrix():
    """One tower on the stacked views; micro-batches of 5 straddle the two views."""
    d = _data(6)
    model = SimClr()
    ref = copy.deepcopy(model)
    views = torch.cat([d["v1"], d["v2"]])
    loss = grad_cache_step([model.encoder], [views], model.loss, micro_batch_size=5)
    ref_loss = _plain_step([ref.encoder], [views], ref.loss)
    _assert_same(model, ref, loss, ref_loss)


@pytest.mark.parametrize("form", ["tuple", "list", "dict"])
def test_inputs_of_several_tensors(form):
    """A text tower taking (input_ids, attention_mask): as a tuple, a list or a dict (keyword
    arguments, with a non-tensor value passed through); per-tower micro-batch sizes."""
    d = _data(9)
    text = {"tuple": (d["ids"], d["mask"]), "list": [d["ids"], d["mask"]],
            "dict": dict(input_ids=d["ids"], attention_mask=d["mask"], pool="mean")}[form]
    model = Clip(text="ids")
    ref = copy.deepcopy(model)
    loss = grad_cache_step([model.image, model.text], [d["image"], text], model.loss,
                           micro_batch_size=[4, 2])
    ref_loss = _plain_step([ref.image, ref.text], [d["image"], text], ref.loss)
    _assert_same(model, ref, loss, ref_loss)


@pytest.mark.parametrize("text", ["tensor", "ids"])
def test_dropout_is_replayed_exactly(text):
    """Dropout in every tower: the re-encode pass draws the masks of the no-grad pass."""
    d = _data(10)
    inputs = [d["image"], d["text"] if text == "tensor" else dict(input_ids=d["ids"],
                                                                   attention_mask=d["mask"])]
    model = Clip(p=0.3, text=text)
    ref = copy.deepcopy(model)
    torch.manual_seed(123)
    loss = grad_cache_step([model.image, model.text], inputs, model.loss, micro_batch_size=3)
    rng_after = torch.get_rng_state()
    torch.manual_seed(123)
    ref_loss = _plain_step([ref.image, ref.text], inputs, ref.loss, chunk=3)
    # Bit-equal features (same ops, same masks): only the order of the sums of the parameters'
    # gradients differs.
    _assert_same(model, ref, loss, ref_loss)
    # The RNG is left where the first passes left it, as by one forward pass.
    assert torch.equal(rng_after, torch.get_rng_state())


def test_dropout_without_replay_differs(monkeypatch):
    """The test above can fail: without the RNG replay the gradients are wrong."""
    monkeypatch.setattr(gc_module._RngState, "replay", lambda self: contextlib.nullcontext())
    d = _data(10)
    model = Clip(p=0.3)
    ref = copy.deepcopy(model)
    torch.manual_seed(123)
    grad_cache_step([model.image, model.text], [d["image"], d["text"]], model.loss,
                    micro_batch_size=3)
    torch.manual_seed(123)
    _plain_step([ref.image, ref.text], [d["image"], d["text"]], ref.loss, chunk=3)
    diff = (model.image.net[0].weight.grad - ref.image.net[0].weight.grad).abs().max()
    assert diff > 1e-4


class _Recorder(nn.Module):
    """Records (grad enabled, rows, device) of each call of the wrapped tower."""

    def __init__(self, tower):
        super().__init__()
        self.tower, self.calls = tower, []

    def forward(self, x):
        self.calls.append((torch.is_grad_enabled(), x.shape[0], x.device.type))
        return self.tower(x)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_cpu_inputs_moved_per_micro_batch(device):
    """Inputs on the CPU with device="cpu": the tower sees micro-batches of at most m rows,
    first without grad, then with; class form equals the function."""
    d = _data(10)
    model = Clip()
    ref = copy.deepcopy(model)
    image, text = _Recorder(model.image), _Recorder(model.text)
    step = GradCache([image, text], model.loss, micro_batch_size=4, device=device)
    loss = step(d["image"], d["text"])
    ref_loss = _plain_step([ref.image, ref.text], [d["image"], d["text"]], ref.loss)
    _assert_same(model, ref, loss, ref_loss)
    want = [(False, 4, "cpu"), (False, 4, "cpu"), (False, 2, "cpu"),
            (True, 4, "cpu"), (True, 4, "cpu"), (True, 2, "cpu")]
    assert image.calls == want and text.calls == want


def test_accumulates_into_existing_grads():
    """Like backward, the step adds to .grad: two steps equal two plain steps."""
    d = _data(8)
    model = Clip()
    ref = copy.deepcopy(model)
    for _ in range(2):
        grad_cache_step([model.image, model.text], [d["image"], d["text"]], model.loss,
                        micro_batch_size=3)
        _plain_step([ref.image, ref.text], [d["image"], d["text"]], ref.loss)
    _assert_same(model, ref, torch.tensor(0.0), torch.tensor(0.0))


def test_frozen_and_unused_towers():
    """A frozen tower (no parameter requires grad) and a tower the loss ignores: their
    parameters' .grad stay None, as after a plain step; the others' are right."""
    d = _data(6)
    model = Clip()
    for p in model.text.parameters():
        p.requires_grad_(False)
    extra = Tower(6)
    ref, ref_extra = copy.deepcopy(model), copy.deepcopy(extra)

    def loss_fn(m):
        return lambda img, txt, unused: m.loss(img, txt)

    loss = grad_cache_step([model.image, model.text, extra], [d["image"], d["text"], d["v1"]],
                           loss_fn(model), micro_batch_size=4)
    ref_loss = _plain_step([ref.image, ref.text, ref_extra], [d["image"], d["text"], d["v1"]],
                           loss_fn(ref))
    _assert_same(model, ref, loss, ref_loss)
    assert all(p.grad is None for p in extra.parameters())
    assert all(p.grad is None for p in model.text.parameters())


# ---------------------------------------------------------------------------------------------
# errors: they name the argument


def _tower(x):
    return x


@pytest.mark.parametrize("make,error,message", [
    (lambda: dict(towers=Tower(6)), TypeError, "got a single Tower"),
    (lambda: dict(towers=[]), ValueError, "towers is empty"),
    (lambda: dict(towers=[_tower, 3]), TypeError, r"towers\[1\] must be a module or callable"),
    (lambda: dict(inputs=torch.randn(4, 3)), TypeError, "inputs must be a list or tuple"),
    (lambda: dict(inputs=[torch.randn(4, 3)]), ValueError, "inputs has 1 entries but towers "
                                                           "has 2"),
    (lambda: dict(inputs=[torch.randn(4, 3), (torch.randn(4, 3), torch.randn(5, 3))]),
     ValueError, r"inputs\[1\]\[1\] has batch size 5 but inputs\[1\]\[0\] has 4"),
    (lambda: dict(inputs=[torch.randn(4, 3), dict(a=torch.randn(4, 3), b=torch.randn(3))]),
     ValueError, r"inputs\[1\]\['b'\] has batch size 3 but inputs\[1\]\['a'\] has 4"),
    (lambda: dict(inputs=[torch.randn(4, 3), "text"]), TypeError, r"inputs\[1\] must be a "
                                                                  "tensor"),
    (lambda: dict(inputs=[torch.randn(4, 3), (1, "a")]), ValueError, r"inputs\[1\] holds no "
                                                                     "tensor"),
    (lambda: dict(inputs=[torch.randn(4, 3), torch.tensor(1.0)]), ValueError,
     r"inputs\[1\] is a 0-dim tensor"),
    (lambda: dict(inputs=[torch.randn(4, 3), torch.randn(0, 3)]), ValueError,
     r"inputs\[1\] has an empty batch"),
    (lambda: dict(micro_batch_size=0), ValueError, "micro_batch_size must be >= 1, got 0"),
    (lambda: dict(micro_batch_size=[2, -1]), ValueError, "micro_batch_size must be >= 1"),
    (lambda: dict(micro_batch_size=2.0), TypeError, "micro_batch_size must be an int"),
    (lambda: dict(micro_batch_size=True), TypeError, "micro_batch_size must be an int"),
    (lambda: dict(micro_batch_size=[2]), ValueError, "micro_batch_size has 1 entries but "
                                                     "towers has 2"),
    (lambda: dict(device="nowhere"), ValueError, "device must be None or a torch.device"),
    (lambda: dict(loss_fn=None), TypeError, "loss_fn must be callable"),
    (lambda: dict(loss_fn=lambda a, b: 1.0), TypeError, "loss_fn must return a scalar tensor, "
                                                        "got float"),
    (lambda: dict(loss_fn=lambda a, b: (a * b).sum(1)), ValueError,
     r"loss_fn must return a scalar tensor, got shape \(4,\)"),
    (lambda: dict(loss_fn=lambda a, b: (a * b).sum().detach()), ValueError,
     "does not require grad"),
    (lambda: dict(towers=[_tower, lambda x: (x, x)]), TypeError,
     r"towers\[1\] must return a tensor of features"),
    (lambda: dict(towers=[_tower, lambda x: x[:1]]), ValueError,
     r"towers\[1\] returned features of shape \(1, 3\) for a micro-batch of 2 rows"),
    (lambda: dict(towers=[_tower, lambda x: x.sum()]), ValueError,
     r"towers\[1\] returned features of shape \(\)"),
])
def test_errors_name_the_argument(make, error, message):
    lin = nn.Linear(3, 3)
    args = dict(towers=[lin, lin], inputs=[torch.randn(4, 3), torch.randn(4, 3)],
                loss_fn=lambda a, b: (a * b).sum(), micro_batch_size=2, device=None)
    args.update(make())
    with pytest.raises(error, match=message):
        grad_cache_step(args.pop("towers"), args.pop("inputs"), args.pop("loss_fn"), **args)
    # Every check runs before any backward: no gradient was touched.
    assert lin.weight.grad is None


def test_tower_changing_between_passes():
    calls = []

    def tower(x):
        calls.append(1)
        return x if len(calls) <= 2 else x[:, :2]

    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"towers\[0\] returned features of shape \(2, 2\) "
                                           r"when re-encoding rows 0:2"):
        grad_cache_step([tower], [x], lambda f: f.sum(), micro_batch_size=2)


def test_class_form_checks_at_construction():
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        GradCache([Tower(6)], lambda f: f.sum(), micro_batch_size=0)
    with pytest.raises(ValueError, match="inputs has 2 entries but towers has 1"):
        GradCache([Tower(6)], lambda f: f.sum(), micro_batch_size=2)(torch.randn(3, 6),
                                                                      torch.randn(3, 6))


# ---------------------------------------------------------------------------------------------
# over 2 processes: the ring loss inside, plain towers and DDP towers


@pytest.fixture(scope="module")
def workers():
    w = Workers(2)
    yield w
    w.close()



def _counting_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state["all-reduces"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def _ring_step(rank, world, kind, rows, micro_batch_size, ddp):
    """This rank's grad_cache_step on its slice of the global batch with the ring loss:
    (loss, parameter gradients, all-reduces per DDP module)."""
    d = _data(sum(rows))
    lo, hi = sum(rows[:rank]), sum(rows[:rank + 1])
    counts = []

    def wrap(module):
        if not ddp:
            return module
        wrapped = nn.parallel.DistributedDataParallel(module)
        counts.append({"all-reduces": 0})
        wrapped.register_comm_hook(counts[-1], _counting_hook)
        return wrapped

    if kind == "clip":
        model = Clip(ring=True)
        towers = [wrap(model.image), wrap(model.text)]
        inputs, loss_fn = [d["image"][lo:hi], d["text"][lo:hi]], model.loss
    else:  # SimCLR, one encoder for both views
        model = SimClr(ring=True)
        encoder = wrap(model.encoder)
        towers, inputs = [encoder, encoder], [d["v1"][lo:hi], d["v2"][lo:hi]]
        loss_fn = model.loss_of_views
    loss = grad_cache_step(towers, inputs, loss_fn, micro_batch_size=micro_batch_size)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss, grads, [c["all-reduces"] for c in counts]


@pytest.mark.parametrize("kind,rows,micro_batch_size,ddp", [
    ("clip", [6, 4], 4, False),  # uneven halves, micro-batches not dividing them
    ("clip", [5, 5], 2, True),
    ("nt_xent", [4, 3], 3, False),
    ("nt_xent", [4, 4], 3, True),
])
def test_ring_loss_over_two_processes(workers, kind, rows, micro_batch_size, ddp):
    """Every rank encodes its slice; the ranks' gradients averaged (DDP's all-reduce, or summed
    here / W for what DDP does not hold: the logit_scale and a plain tower) equal one process's
    plain step on the whole batch. A DDP module all-reduces once per step, even when one
    encoder is both towers."""
    world = 2
    results = all_ok(workers.run(_ring_step, kind, rows, micro_batch_size, ddp))
    d = _data(sum(rows))
    if kind == "clip":
        ref = Clip()
        ref_loss = _plain_step([ref.image, ref.text], [d["image"], d["text"]], ref.loss)
    else:
        ref = SimClr()
        ref_loss = _plain_step([ref.encoder, ref.encoder], [d["v1"], d["v2"]],
                               ref.loss_of_views)
    # Each rank returns W × its rows' share: the mean over the ranks is the global loss.
    torch.testing.assert_close(torch.stack([r[0] for r in results]).mean(), ref_loss, **TOL)
    for name, p in ref.named_parameters():
        in_ddp = ddp and not name.startswith("log_")
        if in_ddp:  # DDP averaged them already: every rank holds dL/dθ
            for rank, (_, grads, _) in enumerate(results):
                torch.testing.assert_close(grads[name], p.grad, **TOL,
                                           msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        else:  # each rank's share of W·dL/dθ
            got = sum(grads[name] for _, grads, _ in results) / world
            torch.testing.assert_close(got, p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # One all-reduce per DDP module and step (no_sync in all its other passes).
    want_counts = ([1, 1] if kind == "clip" else [1]) if ddp else []
    assert [counts for _, _, counts in results] == [want_counts] * world
