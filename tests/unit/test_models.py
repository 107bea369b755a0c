import pytest
import torch

from hadpsgd.models import PRESETS, build_model, count_parameters


def test_swb_preset_matches_paper_size():
    # h-adpsgd section 5.2: "over 43 million parameters": 6 BLSTM layers x 512 per direction,
    # a 256 projection and 32,000 outputs from 260 inputs.
    n = count_parameters(build_model("swb", 260, 32000))
    assert abs(n - 43.1e6) / 43.1e6 < 0.01, n


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_shape(preset):
    model = build_model(preset, 7, 5)
    out = model(torch.randn(3, 11, 7))
    assert out.shape == (3, 11, 5)


def test_presets_are_ordered_by_size():
    sizes = {p: count_parameters(build_model(p, 260, 100)) for p in PRESETS}
    assert sizes["tiny"] < sizes["small"] < sizes["swb"]


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="small"):
        build_model("huge", 260, 10)


def test_bidirectional_uses_future_context():
    torch.manual_seed(0)
    model = build_model("tiny", 4, 3).eval()
    x = torch.randn(1, 9, 4)
    y = x.clone()
    y[0, -1] += 1.0  # change only the last frame
    with torch.no_grad():
        assert not torch.allclose(model(x)[0, 0], model(y)[0, 0])
