"""The engine's CPU linear layers (eagle_backbone/linear.py): one route by CPU capability, padded to its
invariant rows, the packed copy kept current, the same outputs as F.linear, fused projections with the bits of one call each, and the fused RMSNorm
with the module's bits."""

import pytest
import torch
from torch import nn

from eagle_backbone import linear as lin
from eagle_backbone.linear import Projection, check_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False], ids=["cpu_routes", "no_packed_matmul"])
def test_every_call_of_a_projection_runs_one_kernel_padded_to_its_invariant_rows(dtype, packed, monkeypatch):
    """The route is what this CPU runs (oneDNN's packed matmul where it has the dtype, F.linear otherwise: an
    AVX2-only CPU's bfloat16, forced here on any machine), the same at every token count; a call with fewer rows
    than the kernel's invariant count runs padded with zero rows, and its outputs are those rows' outputs."""
    from eagle_backbone import runtime

    if not packed:
        monkeypatch.setattr(runtime, "packed_matmul", lambda dtype: False)
    torch.manual_seed(0)
    m = nn.Linear(48, 96, bias=True).to(dtype)
    p = Projection(m)
    route = "packed" if packed and runtime.packed_matmul(dtype) else "plain"
    assert p.route == route and p.min_rows == lin.INVARIANT_ROWS[(route, dtype)]
    seen = []
    real = {"packed": torch.ops.mkldnn._linear_pointwise, "plain": nn.functional.linear}
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.append(("packed", x.shape[0])) or real["packed"](x, *a))
    monkeypatch.setattr(lin.F, "linear", lambda x, *a: seen.append(("plain", x.shape[0])) or real["plain"](x, *a))
    x = torch.randn(17, 48).to(dtype)
    whole = p(x)
    for n in (1, 2, 3, 17):
        out = p(x[:n])
        assert out.shape == (n, 96) and torch.equal(out, p(x[:n]))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, real["plain"](x[:n], m.weight, m.bias), atol=tol, rtol=tol)
        assert torch.equal(out[0], whole[0])  # row 0's bits, whatever rows share the call
    assert {k for k, _ in seen} == {route}  # one kernel at every token count
    assert min(rows for _, rows in seen) == p.min_rows  # the short calls ran padded


def test_the_capability_probe_sees_what_onednn_runs():
    """float32 packs wherever oneDNN is built in; bfloat16 where oneDNN runs it (not on an AVX2-only CPU)."""
    from eagle_backbone import runtime

    assert runtime.packed_matmul(torch.float32) == torch.backends.mkldnn.is_available()
    if torch.backends.mkldnn.is_available():
        assert runtime.packed_matmul(torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert Projection(nn.Linear(8, 8, device="meta")).route == "plain"  # off a CPU: F.linear, unpadded
    assert Projection(nn.Linear(8, 8, device="meta")).min_rows == 1


@needs_onednn
def test_the_packed_copy_follows_in_place_updates():
    m = nn.Linear(16, 16, bias=False)
    p = Projection(m)
    x = torch.randn(8, 16)
    before = p(x)
    with torch.no_grad():
        m.weight.mul_(2.0)  # training between two engines changes the weight in place
    torch.testing.assert_close(p(x), 2 * before, atol=1e-5, rtol=1e-5)
    assert Projection(m).packed() is p.packed()  # one packed copy per weight per process


def test_plain_mode_and_bad_modes():
    m = nn.Linear(8, 8)
    assert Projection(m, "plain").route == "plain" and Projection(m, "plain").min_rows == 4  # float32: MKL's
    with pytest.raises(ValueError, match="linear must be one of"):
        check_linear("fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["auto", "plain"])
def test_fused_projections_give_each_linears_bits_and_follow_updates(dtype, mode):
    """q/k/v (or gate/up) fused into one matmul: split, each output is bit for bit the one-call output on the
    same route, at every token count; an in-place update of any part restacks and repacks."""
    torch.manual_seed(0)
    mods = [nn.Linear(48, n, bias=False).to(dtype) for n in (48, 16, 16)]
    fused = Projection(mods, mode)
    for n in (1, 2, 3, 17):
        x = torch.randn(n, 48).to(dtype)
        for got, m in zip(fused.split(x), mods):
            assert got.shape == (n, m.out_features)
            assert torch.equal(got, Projection(m, mode)(x))
    with torch.no_grad():
        mods[2].weight.mul_(2.0)
    x = torch.randn(5, 48).to(dtype)
    assert torch.equal(fused.split(x)[2], Projection(mods[2], mode)(x))
    with pytest.raises(ValueError, match="all have a bias or all have none"):
        Projection([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)])


def test_fused_projections_off_a_cpu_call_each_linear_and_stack_nothing():
    mods = [nn.Linear(8, 8, device="meta") for _ in range(3)]
    fused = Projection(mods)
    assert [t.shape for t in fused.split(torch.empty(4, 8, device="meta"))] == [(4, 8)] * 3
    assert fused._stacked is None  # no stacked copy of the weights held on a GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engines_rms_norm_has_the_modules_bits(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from eagle_backbone.llama import rms_norm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    for scale in (1e-3, 1.0, 30.0):
        x = (torch.randn(9, 64) * scale).to(dtype)
        assert torch.equal(rms_norm(norm, x), norm(x))
    other = nn.LayerNorm(64).to(dtype)  # not a Llama RMSNorm: called as it is
    x = torch.randn(3, 64).to(dtype)
    assert torch.equal(rms_norm(other, x), other(x))
