"""FP8 blocks whose absmax is so small that 448 / absmax overflows float32: no NaN stored, true error reported."""
import pytest

torch = pytest.importorskip("torch")

from eagleflow.capture.storage import dequantise_fp8, quantise_fp8


def test_a_tiny_block_beside_exact_zeros_stores_no_nan_and_reports_its_real_error():
    x = torch.randn(6, 64)
    x[0] = 0.0
    x[0, 3] = 1e-38          # 448 / 1e-38 overflows float32: scaled by inf, the zeros became 0 x inf = NaN
    x[1] = 0.0
    x[1, :4] = torch.tensor([2e-37, -1e-37, 5e-38, 0.0])
    x[2] = 0.0               # an all-zero block
    x[3, 32:] = 0.0
    x[3, 40] = 1e-44         # a subnormal alone in the second layer's block
    q, scales, err = quantise_fp8(x, layers=2)
    assert torch.isfinite(q.float()).all() and torch.isfinite(scales).all()
    back = dequantise_fp8(q, scales)
    assert torch.isfinite(back).all()
    assert back[2].abs().max() == 0 and scales[2].abs().max() == 0
    assert float(back[0, 3]) == pytest.approx(1e-38, rel=0.07) and back[0, :3].abs().max() == 0
    assert torch.allclose(back[1, :4], x[1, :4], rtol=0.07, atol=0)
    # the error figure is that of the worst block, not hidden by a NaN or by the scaled domain
    assert 0 < float(back[3, 40]) == pytest.approx(1e-44, rel=0.2)      # not flushed to zero
    xd, bd = x.double().reshape(6, 2, 32), back.double().reshape(6, 2, 32)
    rel = [float((bd[i, b] - xd[i, b]).norm() / xd[i, b].norm()) for i in range(6) for b in range(2)
           if xd[i, b].norm() > 0]
    assert err["max_rel"] == pytest.approx(max(rel), rel=1e-3, abs=1e-6)
