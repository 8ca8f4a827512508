"""server.device: where the hf capture server runs the target (the GPU check runs it on cuda)."""
from __future__ import annotations

import pytest
import torch

from eagleflow.engines.hf.server import CaptureModel
from eagleflow.config import ConfigError, load_config


def test_config_takes_cpu_cuda_auto_and_nothing_else():
    assert load_config(data={"target_model": "m"}).server.device == "cpu"   # the hf backend's old behaviour
    for d in ("cpu", "cuda", "auto"):
        assert load_config(data={"target_model": "m", "server": {"device": d}}).server.device == d
    with pytest.raises(ConfigError, match="device"):
        load_config(data={"target_model": "m", "server": {"device": "gpu"}})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no CUDA GPU")
def test_cuda_without_a_gpu_is_refused_before_loading_naming_the_setting(tmp_path):
    # no model at that path: the refusal comes first, with what to do
    with pytest.raises(RuntimeError, match=r"server.device is 'cuda' but torch sees no CUDA GPU.*server.device: cpu"):
        CaptureModel(str(tmp_path / "absent"), device="cuda")


@pytest.mark.slow   # builds the demo assets (a fitted tiny Llama)
def test_auto_on_this_machine_and_the_forward_on_that_device(demo_assets):
    m = CaptureModel(demo_assets["target_model"], device="auto")
    assert m.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    ids, aux, last, tok = m.forward([5, 6, 7, 8])
    assert aux.device.type == m.device.type and aux.shape == (4, 3 * m.hidden_size) and isinstance(tok, int)
