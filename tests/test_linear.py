"""The engine's CPU linear layers (eagle_backbone/linear.py): the route by token count, the packed copy kept
current, the same outputs as F.linear, fused projections with the bits of one call each, and the fused RMSNorm
with the module's bits."""

import pytest
import torch
from torch import nn

from eagle_backbone import linear as lin
from eagle_backbone.linear import Projection, check_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_routes_by_token_count_and_matches_f_linear(dtype):
    torch.manual_seed(0)
    m = nn.Linear(48, 96, bias=True).to(dtype)
    p = Projection(m)
    assert p.min_tokens == lin.ROUTES[dtype]
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    for n in (1, 2, 3, 17):
        x = torch.randn(n, 48).to(dtype)
        routed = n >= p.min_tokens
        out = p(x)
        calls.append(routed)
        ref = nn.functional.linear(x, m.weight, m.bias)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        if routed:  # the packed route: the same numbers as oneDNN on the plain weight
            torch.testing.assert_close(out, real(x, m.weight, m.bias, "none", [], ""), atol=tol, rtol=tol)
    assert any(calls) and (dtype == torch.bfloat16 or not all(calls))  # float32: one token stays on F.linear


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
    assert Projection(m, "plain").min_tokens is None
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
