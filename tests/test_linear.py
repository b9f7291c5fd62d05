"""The engine's CPU linear layers (eagle_backbone/linear.py): the route by token count, the packed copy kept
current, and the same outputs as F.linear."""

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
