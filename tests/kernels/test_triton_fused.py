"""The Triton RMSNorm (alone and with the residual adds), RoPE, SiLU-gate and GELU-tanh gate
ops (kernels/triton_fused.py) against the PyTorch paths of the layers, and their dispatch
(kernels/cuda_fused.py): on CUDA, or in Triton's CPU interpreter, which tests/conftest.py
turns on without a GPU; skipped, with the reason, without the `triton` package."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import kernel_device

from kvforge.kernels import cuda_fused
from kvforge.kernels.build import DISABLE_ENV
from kvforge.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm
from kvforge.rope import PositionedRope, rotate_half

DTYPES = [torch.float32, torch.bfloat16]




@pytest.fixture
def device(monkeypatch) -> str:
    """The test device, with the CPU ops off (so the modules' fallbacks are the PyTorch
    expressions) and the Triton ops serving that device."""
    found = kernel_device()
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", found)
    return found


def tolerance(dtype: torch.dtype) -> dict:
    # float32: summation order; bfloat16: a rounding of the normalised row may fall the other
    # way (another rsqrt), and the product's rounding after it: two units in the last place
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -6)


def reference(module: torch.nn.Module, *args, monkeypatch) -> torch.Tensor:
    """The module's PyTorch path: the Triton ops refused by their switch."""
    with monkeypatch.context() as patch:
        patch.setenv(cuda_fused.DISABLE_TRITON_FUSED_ENV, "1")
        return module(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("hidden", [64, 96, 13])
def test_rms_norms_match_their_pytorch_path(device, dtype, cls, hidden, monkeypatch):
    gen = torch.Generator().manual_seed(hidden)
    norm = cls(hidden, 1e-5, dtype=dtype, device=device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + (0 if cls is GemmaRMSNorm else 1))
        x = (torch.randn(3, 5, hidden, generator=gen) * 3).to(dtype).to(device)
        calls = []
        kernel = cuda_fused._kernels().rms_norm_triton
        monkeypatch.setattr(cuda_fused._kernels(), "rms_norm_triton",
                            lambda *a, **k: calls.append(1) or kernel(*a, **k))
        out = norm(x)
        ref = reference(norm, x, monkeypatch=monkeypatch)
    assert calls and out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))


def _norm(cls: type, hidden: int, dtype: torch.dtype, device: str, gen: torch.Generator, eps: float) -> torch.nn.Module:
    norm = cls(hidden, eps, dtype=dtype, device=device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + (0 if cls is GemmaRMSNorm else 1))
    return norm


# what a layer asks: the add and the norm after it (Llama), Gemma's sandwich (norm of the added
# branch, the add, the norm after it) and the add of a norm (Gemma's post-feedforward norm)
FORMS = {"add_and_norm": lambda norm, branch, x, d: norm.add_and_norm(x, d),
         "sandwich": lambda norm, branch, x, d: norm.add_and_norm(x, d, branch),
         "add_norm_of": lambda norm, branch, x, d: (branch.add_norm_of(x, d), None)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("hidden", [64, 13])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_residual_add_with_its_norms_matches_the_ops_apart(device, dtype, cls, hidden, form, monkeypatch):
    gen = torch.Generator().manual_seed(hidden + 1)
    norm, branch = _norm(cls, hidden, dtype, device, gen, 1e-5), _norm(cls, hidden, dtype, device, gen, 1e-3)
    with torch.no_grad():
        # a residual and a layer's output of unlike sizes: the sum's rounding matters in bfloat16
        x = (torch.randn(3, 5, hidden, generator=gen) * 8).to(dtype).to(device)
        delta = (torch.randn(3, 5, hidden, generator=gen) * 0.3).to(dtype).to(device)
        before, delta_before = x.clone(), delta.clone()
        calls = []
        for op in ("add_rms_norm_triton", "add_norm_of_triton"):
            kernel = getattr(cuda_fused._kernels(), op)
            monkeypatch.setattr(cuda_fused._kernels(), op, lambda *a, k=kernel, **kw: calls.append(1) or k(*a, **kw))
        total, normed = FORMS[form](norm, branch, x, delta)
        with monkeypatch.context() as patch:
            patch.setenv(cuda_fused.DISABLE_TRITON_FUSED_ENV, "1")
            ref_total, ref_normed = FORMS[form](norm, branch, x, delta)
        gemma = cls is GemmaRMSNorm
        added = delta if form == "add_and_norm" else branch(delta)  # the Triton norm: its own code
        lone = cuda_fused._kernels().rms_norm_triton(total, norm.weight, norm.eps, gemma)
    assert calls and total.dtype == dtype and total.shape == x.shape
    # neither the residual nor the branch is written in place
    torch.testing.assert_close(x, before, atol=0, rtol=0)
    torch.testing.assert_close(delta, delta_before, atol=0, rtol=0)
    if dtype == torch.bfloat16 and device == "cpu":
        # Triton's interpreter rounds float32 to bfloat16 by truncation (CUDA and torch: to
        # nearest even), so here the sum is held to one unit in the last place; bitwise on a GPU
        assert ((total.float() - (x + added).float()).abs() <= (x + added).float().abs() * 2 ** -7).all()
    else:  # the sum of x and the lone kernels' norm, rounded as `x + d` is
        torch.testing.assert_close(total, x + added, atol=0, rtol=0)
    # the ops apart in PyTorch: the branch's norm within its tolerance, and then the sum's
    # rounding may fall the other way (a unit in the last place of the larger operand)
    bound = tolerance(dtype)
    slack = bound["atol"] + 2 * bound["rtol"] * (x.float().abs() + added.float().abs())
    assert ((total.float() - ref_total.float()).abs() <= slack).all()
    if form != "add_norm_of":
        assert normed.shape == x.shape and normed.dtype == dtype
        torch.testing.assert_close(normed, lone, atol=0, rtol=0)  # the norm of the sum: the lone kernel's code
        torch.testing.assert_close(normed.float(), ref_normed.float(), **tolerance(dtype))


def test_a_branch_normed_another_way_runs_apart(device, monkeypatch):
    """The fused sandwich applies one kind of norm (Llama's or Gemma's) to both: a branch of
    the other kind runs the ops apart, and gives their result."""
    gen = torch.Generator().manual_seed(5)
    norm, branch = _norm(RMSNorm, 16, torch.float32, device, gen, 1e-5), _norm(GemmaRMSNorm, 16, torch.float32,
                                                                            device, gen, 1e-5)
    x, delta = torch.randn(4, 16, generator=gen).to(device), torch.randn(4, 16, generator=gen).to(device)
    monkeypatch.setattr(cuda_fused._kernels(), "add_rms_norm_triton", lambda *a, **k: pytest.fail("fused"))
    with torch.no_grad():
        total, normed = norm.add_and_norm(x, delta, branch)
        torch.testing.assert_close(total, x + branch(delta), atol=0, rtol=0)
        torch.testing.assert_close(normed, norm(x + branch(delta)), atol=0, rtol=0)


def test_residual_adds_refuse_what_they_cannot_take(device):
    x, w = torch.randn(4, 8, device=device), torch.ones(8, device=device)
    d = torch.randn(4, 8, device=device)
    assert cuda_fused.add_rms_norm(x, d, w, 1e-6, gemma=False) is not None
    assert cuda_fused.add_rms_norm(x, d, w, 1e-6, gemma=False, delta_weight=w, delta_eps=1e-6) is not None
    assert cuda_fused.add_norm_of(x, d, w, 1e-6, gemma=True) is not None
    for delta, why in ((torch.randn(1, 8, device=device), "broadcast"),
                       (torch.randn(8, 4, device=device).t(), "strided"),
                       (x.to(torch.bfloat16), "mixed dtypes"), (x.clone().requires_grad_(), "autograd")):
        assert cuda_fused.add_rms_norm(x, delta, w, 1e-6, gemma=False) is None, why
        assert cuda_fused.add_norm_of(x, delta, w, 1e-6, gemma=False) is None, why
    short = torch.ones(4, device=device)
    assert cuda_fused.add_rms_norm(x, d, w, 1e-6, gemma=False, delta_weight=short) is None  # the branch's weight
    assert cuda_fused.add_rms_norm(x, d, w, 1e-6, gemma=False, delta_weight=w.double()) is None
    assert cuda_fused.add_norm_of(x, d, short, 1e-6, gemma=False) is None
    for launch in (lambda bad: cuda_fused._kernels().add_rms_norm_triton(x, bad, w, 1e-6, False),
                   lambda bad: cuda_fused._kernels().add_norm_of_triton(x, bad, w, 1e-6, False)):
        with pytest.raises(ValueError, match="not shaped as x"):
            launch(torch.randn(2, 8, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dim", [(4, 32), (3, 48), (1, 8)])
def test_rope_matches_its_pytorch_path(device, dtype, heads, dim, monkeypatch):
    gen = torch.Generator().manual_seed(dim)
    rows = 7
    x = torch.randn(rows, heads, dim, generator=gen).to(dtype).to(device)
    angles = torch.rand(rows, dim // 2, generator=gen) * 100
    angles = torch.cat((angles, angles), dim=-1)
    rope = PositionedRope(cos=angles.cos().to(dtype).to(device), sin=angles.sin().to(dtype).to(device), rotary=None)
    out = rope.apply(x)
    with monkeypatch.context() as patch:
        patch.setenv(cuda_fused.DISABLE_TRITON_FUSED_ENV, "1")
        ref = rope.apply(x)
    assert cuda_fused.rope_rotate(x, rope.cos, rope.sin) is not None
    expected = x * rope.cos[:, None] + rotate_half(x) * rope.sin[:, None]
    torch.testing.assert_close(ref, expected, atol=0, rtol=0)  # the reference is the expression
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))


GATES = {"silu": (cuda_fused.silu_mul, F.silu),
         "gelu_pytorch_tanh": (cuda_fused.gelu_tanh_mul, lambda g: F.gelu(g, approximate="tanh"))}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(GATES))
def test_gates_over_their_whole_range(device, dtype, activation):
    """From far negative, through 0, to far positive (GELU's exp capped where tanh is 1)."""
    gate = torch.tensor([[-300.0, -20.0, -9.0, -3.0, -0.5, -1e-3, 0.0, 1e-3, 0.5, 3.0, 9.0, 20.0, 300.0, 1e4]])
    gate, up = gate.to(dtype).to(device), torch.linspace(-2, 2, gate.shape[1]).to(dtype).to(device)[None]
    op, act = GATES[activation]
    out = op(gate, up)
    assert out is not None and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), (act(gate) * up).float(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(GATES))
def test_gated_mlp_matches_its_pytorch_path(device, dtype, activation, monkeypatch):
    torch.manual_seed(0)
    mlp = GatedMLP(32, 1500, activation, bias=False, dtype=dtype, device=device)  # > one GATE_BLOCK per row
    x = torch.randn(3, 32).to(dtype).to(device)
    with torch.no_grad():
        wide = x * 4  # gates far out on both tails, where tanh saturates
        gate, up = F.linear(wide, mlp.gate_proj.weight), F.linear(wide, mlp.up_proj.weight)
        op, act = GATES[activation]
        fused = op(gate, up)
        assert fused is not None and gate.abs().max() > 6
        torch.testing.assert_close(fused.float(), (act(gate) * up).float(), **tolerance(dtype))
        torch.testing.assert_close(mlp(x).float(), reference(mlp, x, monkeypatch=monkeypatch).float(),
                                   **tolerance(dtype))


def test_dispatch_refuses_what_it_cannot_take(device, monkeypatch):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    assert cuda_fused.rms_norm(x, w, 1e-6, gemma=False) is not None
    assert cuda_fused.rms_norm(x.double(), w.double(), 1e-6, gemma=False) is None  # float64
    assert cuda_fused.rms_norm(x, w.to(torch.bfloat16), 1e-6, gemma=False) is None  # mixed dtypes
    assert cuda_fused.rms_norm(x.t(), torch.ones(4, device=device), 1e-6, gemma=False) is None  # strided
    assert cuda_fused.silu_mul(x.requires_grad_(), x) is None  # autograd
    assert cuda_fused.rope_rotate(torch.randn(2, 1, 5, device=device), torch.ones(2, 5), torch.ones(2, 5)) is None
    monkeypatch.setattr(cuda_fused, "triton_installed", lambda: False)
    assert cuda_fused.silu_mul(x.detach(), x.detach()) is None
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", "cuda")
    if device == "cpu":  # CPU tensors never reach the Triton ops outside the tests
        assert cuda_fused.silu_mul(x.detach(), x.detach()) is None


def test_operands_on_two_devices_are_refused(device, monkeypatch):
    """A launch runs on one device: operands on two (cuda:0 and cuda:1, or the served type
    and another) run the PyTorch expression, which raises torch's own error for them."""
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", "cuda")
    zero, one = torch.device("cuda", 0), torch.device("cuda", 1)  # devices, not tensors: no GPU needed
    assert cuda_fused.on_one_served_device([zero, zero, zero])
    assert not cuda_fused.on_one_served_device([zero, one])
    assert not cuda_fused.on_one_served_device([zero, zero, one])
    assert not cuda_fused.on_one_served_device([torch.device("cpu"), torch.device("cpu")])  # not the served type
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", device)
    x = torch.randn(4, 8, device=device)
    assert cuda_fused.silu_mul(x, x) is not None
    assert cuda_fused.silu_mul(x, torch.randn(4, 8, device="meta")) is None  # the second operand elsewhere


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3_hybrid"])
def test_model_logits_with_every_triton_op(device, name, monkeypatch):
    """The GPU layer path end to end (Triton norms, the residual add with its norm, RoPE,
    SiLU-gate and paged decode attention) gives the PyTorch path's logits through prefill and batched decode."""
    if device != "cpu":
        pytest.skip("runs the interpreter on the CPU")
    from conftest import decode_logits, make_pair, make_runner

    kernels = cuda_fused._kernels()
    used: set[str] = set()

    def counted(op: str):
        kernel = getattr(kernels, op)
        return lambda *args, **kwargs: used.add(op) or kernel(*args, **kwargs)

    for op in ("rms_norm_triton", "add_rms_norm_triton", "add_norm_of_triton", "rope_rotate_triton",
               "silu_mul_triton", "gelu_tanh_mul_triton"):
        monkeypatch.setattr(kernels, op, counted(op))
    _, model = make_pair(name)
    prompts = [list(range(3, 20)), [7, 8, 9]]
    fused = decode_logits(make_runner(model, cache="full:block_size=4,decode_kernel=triton"), prompts, steps=3)
    # gemma3: a GELU-gated MLP and the post-feedforward norm added in one launch
    own = {"silu_mul_triton"} if name == "llama_gqa" else {"gelu_tanh_mul_triton", "add_norm_of_triton"}
    assert used == {"rms_norm_triton", "add_rms_norm_triton", "rope_rotate_triton"} | own
    monkeypatch.setenv(cuda_fused.DISABLE_TRITON_FUSED_ENV, "1")
    plain = decode_logits(make_runner(model, cache="full:block_size=4,decode_kernel=torch"), prompts, steps=3)
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
