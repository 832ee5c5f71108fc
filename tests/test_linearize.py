"""The framework-free entry point ``latte_plugin.linearize`` on nn.MultiheadAttention and on HF
``transformers`` attention (ViT, CLIP vision + text, BERT, RoBERTa) built from configs.

Each test compares exact mode with the untouched model (bit-identical), then checks the
calibrated hybrid: the requested number of linear layers, finite outputs, and the masks
the model uses (padding for BERT, causal for CLIP text) honoured exactly."""
import copy

import pytest
import torch
from torch import nn

import latte_plugin
from latte_plugin.nn.install import find_latte_layers, set_modes
from tests.conftest import require

QUIET = dict(progress=False, log=lambda s: None, steps=5, greedy_images=2)


class TinyEncoder(nn.Module):
    def __init__(self, d=32, layers=3, heads=4):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True) for _ in range(layers))

    def forward(self, x, key_padding_mask=None):
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=key_padding_mask)
        return x


def _exact_then_hybrid(model, ref, batches, run, **kw):
    model, report = latte_plugin.linearize(model, batches, **kw, **QUIET)
    layers = find_latte_layers(model)
    set_modes(layers, [])
    with torch.no_grad():
        for a, b in zip(run(model), run(ref)):
            assert torch.equal(a, b), "exact mode must be bit-identical to the untouched model"
    set_modes(layers, report["linearized"])
    with torch.no_grad():
        hybrid = run(model)
    assert all(torch.isfinite(t).all() for t in hybrid)
    return model, report, hybrid


def test_linearize_nn_multihead_attention():
    torch.manual_seed(0)
    model = TinyEncoder().eval()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 40, 32)
    batches = [(torch.randn(2, 40, 32),) for _ in range(4)]
    with torch.no_grad():
        fast = ref(x)  # nn.TransformerEncoderLayer's fused inference fast path
    # A swapped layer must leave that fast path (it would bypass the LATTE core), so exact mode
    # equals torch's regular path bit for bit, and the fast path to float precision.
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        model, report, hybrid = _exact_then_hybrid(
            model, ref, batches, lambda m: [m(x)], candidates=["layers.*.self_attn"], ratio=0.67)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    set_modes(find_latte_layers(model), [])
    with torch.no_grad():
        torch.testing.assert_close(model(x), fast, atol=1e-5, rtol=1e-5)
        set_modes(find_latte_layers(model), report["linearized"])
        torch.testing.assert_close(model(x), hybrid[0])  # fast path on: LATTE still runs
    assert report["candidates"] == [f"layers.{i}.self_attn" for i in range(3)]
    assert len(report["linearized"]) == 2
    for key in ("variant", "sensitivity", "params", "attention_gflops", "selection", "config"):
        assert key in report
    assert all(bool(l.calibrated) for l in find_latte_layers(model).values())


def test_linearize_hf_vit():
    require("transformers")
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    model = ViTModel(ViTConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
                               image_size=32, patch_size=8)).eval()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32)
    batches = [{"pixel_values": torch.randn(2, 3, 32, 32)} for _ in range(4)]
    _, report, _ = _exact_then_hybrid(model, ref, batches, lambda m: [m(pixel_values=x).last_hidden_state],
                                      candidates=["layers.*.attention"], ratio=0.67)
    assert len(report["candidates"]) == 3 and len(report["linearized"]) == 2


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_linearize_hf_bert_family_honours_padding(arch):
    require("transformers")
    import transformers

    cfg_cls, model_cls = {"bert": (transformers.BertConfig, transformers.BertModel),
                          "roberta": (transformers.RobertaConfig, transformers.RobertaModel)}[arch]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                              vocab_size=100, max_position_embeddings=40)).eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    batches = [{"input_ids": torch.randint(3, 100, (2, 12)), "attention_mask": mask} for _ in range(3)]
    run = lambda m: [m(input_ids=ids, attention_mask=mask).last_hidden_state]  # noqa: E731
    model, report, hybrid = _exact_then_hybrid(model, ref, batches, run,
                                               candidates=["encoder.layer.*.attention.self"], num_linear=2)
    # padded tokens have exactly no influence on the valid ones
    ids2 = ids.clone()
    ids2[1, 8:] = 7
    with torch.no_grad():
        other = model(input_ids=ids2, attention_mask=mask).last_hidden_state
    assert torch.equal(other[1, :8], hybrid[0][1, :8])


def test_linearize_hf_clip_vision_and_causal_text():
    require("transformers")
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    cfg = CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         vocab_size=50, max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=8),
        projection_dim=16)
    model = CLIPModel(cfg).eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(2, 50, (2, 10))
    px = torch.randn(2, 3, 32, 32)
    batches = [{"input_ids": torch.randint(2, 50, (2, 10)), "pixel_values": torch.randn(2, 3, 32, 32)}
               for _ in range(2)]
    run = lambda m: [m(input_ids=ids, pixel_values=px).text_embeds,  # noqa: E731
                     m(input_ids=ids, pixel_values=px).image_embeds]
    model, report, _ = _exact_then_hybrid(model, ref, batches, run, candidates=["*.encoder.layers.*.self_attn"],
                                          ratio=1.0)
    assert len(report["linearized"]) == 4  # 2 text + 2 vision
    # the text tower is causal: a later token must not change earlier outputs, linear or not
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % 50
    with torch.no_grad():
        a = model.text_model(input_ids=ids).last_hidden_state
        b = model.text_model(input_ids=ids2).last_hidden_state
    assert torch.equal(a[:, :-1], b[:, :-1])


def test_linearize_errors_are_clear():
    model = TinyEncoder().eval()
    batches = [(torch.randn(1, 8, 32),)]
    with pytest.raises(ValueError, match="matches no attention module"):
        latte_plugin.linearize(model, batches, candidates=["encoder.*.attn"], **QUIET)
    with pytest.raises(ValueError, match="neither an nn.MultiheadAttention"):
        latte_plugin.linearize(model, batches, candidates=["layers.*.linear1"], **QUIET)
    with pytest.raises(ValueError, match="empty calibration set"):
        latte_plugin.linearize(model, [], candidates=["layers.*.self_attn"], **QUIET)
    with pytest.raises(ValueError, match="unknown LATTE setting"):
        latte_plugin.linearize(model, batches, candidates=["layers.*.self_attn"], not_a_knob=1, **QUIET)


def test_linearize_takes_the_same_calibrate_vocabulary():
    """calibrate='auto' keeps a calibrated model's state, 'always' recalibrates, 'never' requires state."""
    torch.manual_seed(0)
    batches = [(torch.randn(2, 24, 32),) for _ in range(4)]
    with pytest.raises(ValueError, match="calibrate='never'"):
        latte_plugin.linearize(TinyEncoder().eval(), batches, candidates=["layers.*.self_attn"], calibrate="never",
                               **QUIET)
    model, first = latte_plugin.linearize(TinyEncoder().eval(), batches, candidates=["layers.*.self_attn"], **QUIET)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model, again = latte_plugin.linearize(model, batches, candidates=["layers.*.self_attn"], **QUIET)
    assert first is not None and again is None
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    _, forced = latte_plugin.linearize(model, batches, candidates=["layers.*.self_attn"], calibrate="always", **QUIET)
    assert forced is not None
    with pytest.raises(ValueError, match="calibrate must be"):
        latte_plugin.linearize(model, batches, candidates=["layers.*.self_attn"], calibrate="sometimes", **QUIET)


def test_inference_settings_apply_to_a_loaded_calibration():
    """calibrate='auto' on a model that already holds calibrated state: mode and threshold take
    effect on its linear layers (they used to be silently ignored); a different variant is kept
    as calibrated and said in one line."""
    torch.manual_seed(0)
    model = TinyEncoder().eval()
    batches = [torch.randn(2, 20, 32) for _ in range(6)]
    _, rep = latte_plugin.linearize(model, batches, candidates=["layers.*.self_attn"], ratio=0.67, **QUIET)
    state = model.state_dict()
    fresh = TinyEncoder().eval()
    latte_plugin.swap_attention(fresh, ["layers.*.self_attn"])
    fresh.load_state_dict(state)
    lines = []
    _, again = latte_plugin.linearize(fresh, batches, candidates=["layers.*.self_attn"], mode="dynamic",
                                      threshold=7, variant="jpn_only", progress=False, log=lines.append)
    assert again is None  # not recalibrated
    layers = find_latte_layers(fresh)
    assert {n for n, l in layers.items() if l.mode == "dynamic"} == set(rep["linearized"])
    assert all(l.mode == "exact" for n, l in layers.items() if n not in rep["linearized"])
    assert all(int(l.threshold) == 7 and l.variant == "latte" for l in layers.values())
    said = [s for s in lines if "variant='jpn_only' not applied" in s]
    assert len(said) == 1 and "calibrate='always'" in said[0]
