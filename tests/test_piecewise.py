"""The piecewise kernel (``docs/method.md#piecewise``): the fused path, the Triton kernel (under
``TRITON_INTERPRET=1``) and the ONNX graph against the naive reference that builds every score;
the block choice against a plain top-k; every block exact = softmax; 16-bit inputs with real
calibrated scales; the calibration's choice of kernel and knobs.

The fused path's exact part runs through PyTorch's CPU flash kernel where the head sizes agree
(``dv == d``), else plain tensor ops; both are compared with the reference.

Tolerances: float32 paths within 2e-5 of the reference (the same sums in another order);
16-bit inputs within 2e-2 of the float32 result of the same rounded inputs; ONNX within 1e-4.
"""
import itertools
import os

import pytest
import torch

from tests.conftest import qkv
from tests.toy import ToyEncoder, toy_batches

from latte_plugin import linearize, ops
from latte_plugin.calibration.kernel_choice import pick_piecewise, piecewise_candidates
from latte_plugin.calibration.record import RecordedItem
from latte_plugin.nn.install import find_latte_layers
from latte_plugin.nn.params import LatteParams
from latte_plugin.ops import piecewise, triton_piecewise
from latte_plugin.ops.piecewise import pool_blocks, pooled_queries, select_key_blocks

F32 = 2e-5
PER_HEAD = dict(m=torch.tensor([0.5, 1.0, 1.5]).view(3, 1, 1), rho=torch.tensor([2.0, 1e3, 1e6]).view(3, 1, 1))


def _mask(b, m, cut):
    kpm = torch.zeros(b, m, dtype=torch.bool)
    kpm[-1, cut:] = True
    return kpm


@pytest.mark.parametrize("order", ops.ORDERS)
@pytest.mark.parametrize("rest", ops.RESTS)
@pytest.mark.parametrize("n,m,top,padded", [(37, 50, 1, False), (64, 64, 2, True), (70, 130, 2, True),
                                            (5, 130, 3, False), (130, 20, 1, True)])
def test_fused_equals_naive_over_ragged_shapes_masks_rests_and_orders(order, rest, n, m, top, padded):
    q, k, v = qkv(b=2, h=3, n=n, m=m, d=16, dv=8, scale=2.0)
    kpm = _mask(2, m, m // 2) if padded else None
    spec = ops.PiecewiseSpec(top, 1.3, rest, 16, order)
    ref = ops.naive_piecewise_attention(q, k, v, spec, PER_HEAD["m"], PER_HEAD["rho"], kpm)
    got = ops.piecewise_attention(q, k, v, spec, PER_HEAD["m"], PER_HEAD["rho"], kpm)
    torch.testing.assert_close(got, ref, atol=F32, rtol=F32)


def _blocked_terms(q, k, v, kpm, spec):
    from latte_plugin.ops.piecewise import _blocked

    qb, kb, vb, validb, q_pool, _ = _blocked(q, k, v, kpm, spec.block, torch.float32, spec.order)
    k_pool, k_counts = pool_blocks(kb.flatten(2, 3), validb.flatten(2, 3), kb.shape[3])
    return qb, kb, vb, validb, select_key_blocks(q_pool, k_pool, k_counts, min(spec.top, kb.shape[2]))


@pytest.mark.parametrize("n,m,top,padded", [(37, 50, 1, False), (70, 130, 2, True), (130, 20, 1, True), (64, 64, 4, False)])
def test_fused_exact_part_equals_the_plain_one_and_the_naive_reference(n, m, top, padded):
    """The CPU flash kernel's exact part returns other terms (the normalised output, the log-sum-exp)
    that the shared normaliser must merge to the plain ops' result; and the whole eager path, which
    takes it where the head sizes agree, against the naive reference."""
    q, k, v = qkv(b=2, h=3, n=n, m=m, d=16, dv=16, scale=2.0)
    kpm = _mask(2, m, m // 2) if padded else None
    spec = ops.PiecewiseSpec(top, 1.3, "latte", 16, "tokens")
    qb, kb, vb, validb, idx = _blocked_terms(q, k, v, kpm, spec)
    assert piecewise.fused_exact_available(qb, vb)
    rest = piecewise.piecewise_rest_terms(qb, kb, vb, validb, idx, spec, PER_HEAD["m"], PER_HEAD["rho"])
    plain = piecewise.merge_terms(piecewise.piecewise_exact_terms(qb, kb, vb, validb, idx), rest)
    fused = piecewise.merge_terms(piecewise.fused_exact_terms(qb, kb, vb, validb, idx), rest)
    torch.testing.assert_close(fused, plain, atol=F32, rtol=F32)
    ref = ops.naive_piecewise_attention(q, k, v, spec, PER_HEAD["m"], PER_HEAD["rho"], kpm)
    for backend in ("eager", "plain"):
        got = ops.piecewise_attention(q, k, v, spec, PER_HEAD["m"], PER_HEAD["rho"], kpm, backend)
        torch.testing.assert_close(got, ref, atol=F32, rtol=F32)


def test_fused_exact_part_of_a_query_block_whose_chosen_keys_are_all_padding_is_empty():
    q, k, v = qkv(b=1, h=2, n=20, m=48, d=16, dv=16)
    kpm = _mask(1, 48, 32)  # key block 2 (32..47) is all padding
    qb, kb, vb, validb, idx = _blocked_terms(q, k, v, kpm, ops.PiecewiseSpec(1, 1.0, "latte", 16, "tokens"))
    idx = torch.full_like(idx, 2)
    num, den, lse = piecewise.fused_exact_terms(qb, kb, vb, validb, idx)
    _, _, mx = piecewise.piecewise_exact_terms(qb, kb, vb, validb, idx)
    assert bool((num == 0).all()) and bool(torch.isneginf(lse).all()) and bool(torch.isneginf(mx).all())
    assert not piecewise.fused_exact_available(qb, vb[..., :8])  # head sizes differ: the plain ops


def test_similarity_blocks_are_balanced_and_group_similar_tokens():
    from latte_plugin.ops.piecewise import token_groups

    # two well-separated clouds of 32 tokens each, interleaved: consecutive blocks mix them, bisection does not
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 64, 8, generator=g) * 0.1
    x[..., 1::2, 0] += 5.0
    groups, count = token_groups(x, None, 32, "similarity")
    assert count == 2 and torch.bincount(groups.flatten()).tolist() == [32, 32]
    assert len({int(groups[0, 0, i]) for i in range(1, 64, 2)}) == 1  # the shifted cloud is one block
    kpm = torch.zeros(1, 64, dtype=torch.bool)
    kpm[0, :10] = True
    groups, _ = token_groups(x, ~kpm, 16, "similarity")
    assert torch.bincount(groups.flatten()).tolist() == [16] * 4


def _slots(perm: torch.Tensor, groups: int) -> torch.Tensor:
    """The group of every token under ``perm`` (sorted position -> token): ``(B, H, L)``."""
    size = perm.shape[-1] // groups
    return torch.empty_like(perm).scatter_(2, perm, (torch.arange(perm.shape[-1]) // size).expand_as(perm))


@pytest.mark.parametrize("length,groups,d,shift,cut", [(64, 4, 8, 0.0, None), (256, 16, 16, 3.0, 200),
                                                       (128, 8, 16, 0.0, 100), (512, 8, 32, 10.0, None)])
def test_similarity_order_forms_the_reference_groups(length, groups, d, shift, cut):
    """The fast bisection (covariance power iteration, row gathers) against the reference's, which
    iterates over the tokens: the same groups. Within a group the order may differ; it is never used."""
    g = torch.Generator().manual_seed(length + groups)
    x = torch.randn(2, 3, length, d, generator=g) + shift
    valid = torch.ones(2, 1, length, dtype=torch.bool)
    if cut is not None:
        valid[1, :, cut:] = False
    fast = ops.piecewise.similarity_order(x, valid, groups)
    assert torch.equal(fast.sort(-1).values, torch.arange(length).expand_as(fast))  # a permutation
    torch.testing.assert_close(_slots(fast, groups), _slots(ops.naive_similarity_order(x, valid, groups), groups),
                               rtol=0, atol=0)
    if cut is not None:  # the padded tokens fill the last slots
        assert bool((_slots(fast, groups)[1, :, cut:] >= groups + (cut - length) // (length // groups)).all())


@pytest.mark.parametrize("length,groups,d,rank,cut", [(64, 4, 32, 8, None), (256, 16, 64, 16, 200),
                                                      (128, 8, 24, 4, 100), (512, 8, 64, 16, None)])
def test_lowrank_order_forms_the_reference_groups(length, groups, d, rank, cut):
    """The bisection in the top principal directions (covariance eigendecomposition, signs fixed)
    against the reference's (an SVD of the tokens): the same groups; and a permutation."""
    g = torch.Generator().manual_seed(length + d)
    x = torch.randn(2, 3, length, d, generator=g) * torch.linspace(0.2, 3.0, d) + 1.0
    valid = torch.ones(2, 1, length, dtype=torch.bool)
    if cut is not None:
        valid[1, :, cut:] = False
    fast = piecewise.lowrank_similarity_order(x, valid, groups, rank)
    assert torch.equal(fast.sort(-1).values, torch.arange(length).expand_as(fast))
    ref = ops.naive_lowrank_similarity_order(x, valid, groups, rank)
    torch.testing.assert_close(_slots(fast, groups), _slots(ref, groups), rtol=0, atol=0)
    if cut is not None:  # padding fills the last slots whichever way a split faces: no symmetry to check
        return
    # every token negated flips every direction's sign: the same groups (as sets; their order may change)
    flipped = _slots(piecewise.lowrank_similarity_order(-x, valid, groups, rank), groups)
    together = _slots(fast, groups)
    assert torch.equal(flipped.unsqueeze(-1) == flipped.unsqueeze(-2), together.unsqueeze(-1) == together.unsqueeze(-2))


def test_lowrank_order_groups_the_separated_clouds_and_runs_the_whole_path():
    """Two clouds apart along one of 64 dims: one block each, as the full bisection finds them; the
    whole piecewise path with the order against the naive reference (which forms the same blocks)."""
    from latte_plugin.ops.piecewise import token_groups

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 64, 64, generator=g) * 0.1
    x[..., 1::2, 5] += 5.0
    groups, count = token_groups(x, None, 32, "lowrank")
    assert count == 2 and len({int(groups[0, 0, i]) for i in range(1, 64, 2)}) == 1
    q, k, v = qkv(b=2, h=3, n=70, m=130, d=32, dv=32, scale=2.0)
    spec = ops.PiecewiseSpec(2, 1.3, "latte", 16, "lowrank")
    ref = ops.naive_piecewise_attention(q, k, v, spec, PER_HEAD["m"], PER_HEAD["rho"], _mask(2, 130, 65))
    for backend in ("eager", "plain"):
        got = ops.piecewise_attention(q, k, v, spec, PER_HEAD["m"], PER_HEAD["rho"], _mask(2, 130, 65), backend)
        torch.testing.assert_close(got, ref, atol=F32, rtol=F32)


def test_lowrank_order_refuses_onnx_export_in_one_line(monkeypatch, tmp_path):
    """The export names the layer before tracing; the kernel itself refuses under export too."""
    from latte_plugin.export import export_onnx

    model = torch.nn.Module()
    model.attn = LatteParams(64, 2)
    model.attn.set_piecewise(2, 1.0, "latte", 16, "lowrank")
    model.attn.mode = "linear"
    with pytest.raises(ValueError, match=r"piecewise layer attn uses piecewise_order='lowrank'.*'similarity' to export"):
        export_onnx(model, (torch.randn(1, 2, 64, 32),) * 3, str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    with pytest.raises(RuntimeError, match="piecewise_order='similarity' to export"):
        piecewise.lowrank_similarity_order(torch.randn(1, 1, 64, 32), torch.ones(1, 1, 64, dtype=torch.bool), 4)


def test_a_key_far_above_the_chosen_blocks_leaves_every_path_finite():
    """A key whose block mean scores low but which scores ~400 against the query: not chosen, it
    enters only through its block's mean; float32 exp of its raw score would overflow."""
    q, k, v = qkv(b=1, h=1, n=16, m=64, d=16)
    k[0, 0, :16] = -q[0, 0, 0] * 3  # block 0's mean points away from the queries...
    k[0, 0, 5] = q[0, 0, 0] * 60  # ...but one of its keys scores far above everything else
    spec = ops.PiecewiseSpec(1, 1.0, "latte", 16, "tokens")
    ref = ops.naive_piecewise_attention(q, k, v, spec, 0.8, 1e6)
    assert bool(torch.isfinite(ref).all())
    torch.testing.assert_close(ops.piecewise_attention(q, k, v, spec, 0.8, 1e6), ref, atol=F32, rtol=F32)
    # scalars as 0-d tensors (as benchmarks/attention.py passes them) broadcast the same way
    torch.testing.assert_close(ops.piecewise_attention(q, k, v, spec, torch.tensor(0.8), torch.tensor(1e6)), ref,
                               atol=F32, rtol=F32)


def test_block_choice_is_the_plain_top_k_of_the_block_means():
    q, k, _ = qkv(b=1, h=2, n=50, m=90, d=16, scale=2.0)
    kpm = _mask(1, 90, 75)  # the last key block (80..89) is all padding: never chosen before a real one
    valid = torch.nn.functional.pad(~kpm, (0, 6))[:, None]
    kp, kc = pool_blocks(torch.nn.functional.pad(k, (0, 0, 0, 6)), valid, 16)
    qp, _ = pool_blocks(torch.nn.functional.pad(q, (0, 0, 0, 14)), (torch.arange(64) < 50)[None, None], 16)
    idx = select_key_blocks(qp, kp, kc, 3)
    for h, i in itertools.product(range(2), range(4)):
        rows = q[0, h, 16 * i:16 * (i + 1)]
        means = [k[0, h, 16 * j:16 * (j + 1)][~kpm[0, 16 * j:16 * (j + 1)]].mean(0) for j in range(5)]
        scores = torch.stack([rows.mean(0) @ mj / 4.0 if not torch.isnan(mj).any() else torch.tensor(-1e9)
                              for mj in means])
        assert set(idx[0, h, i].tolist()) == set(torch.topk(scores, 3).indices.tolist())
        assert 5 not in idx[0, h, i].tolist()


@pytest.mark.parametrize("rest", ops.RESTS)
def test_every_block_exact_is_softmax_attention(rest):
    q, k, v = qkv(b=2, h=3, n=45, m=77, d=16, scale=3.0)
    kpm = _mask(2, 77, 40)
    ref = ops.naive_softmax_attention(q, k, v, kpm)
    for path, order in itertools.product((ops.piecewise_attention, ops.naive_piecewise_attention), ops.ORDERS):
        torch.testing.assert_close(path(q, k, v, ops.PiecewiseSpec(99, 2.0, rest, 16, order), 0.7, 5.0, kpm), ref,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rest", ops.RESTS)
def test_triton_kernel_equals_the_fused_path(rest):
    if not triton_piecewise.available():
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # similarity blocks take the kernel where they hold a power of two of tokens (64 = 4 x 16)
    for n, m, padded, order in [(37, 50, False, "tokens"), (70, 130, True, "tokens"), (64, 64, True, "similarity")]:
        q, k, v = (x.to(dev) for x in qkv(b=2, h=3, n=n, m=m, d=16, scale=2.0))
        kpm = _mask(2, m, m // 2).to(dev) if padded else None
        args = (ops.PiecewiseSpec(2, 1.3, rest, 16, order), PER_HEAD["m"].to(dev), PER_HEAD["rho"].to(dev), kpm)
        assert triton_piecewise.supported(16, 16, 16, 16)
        torch.testing.assert_close(ops.piecewise_attention(q, k, v, *args, backend="triton"),
                                   ops.piecewise_attention(q, k, v, *args), atol=F32, rtol=F32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_with_real_calibrated_scales_are_finite_and_close(dtype):
    # rho of calibrated ViT layers reaches 1e6..1e7 (results/main_job_deimv2_vit.json); activations of a few tens
    q, k, v = qkv(b=1, h=3, n=200, m=200, d=32, scale=20.0)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    for rest, order in itertools.product(ops.RESTS, ops.ORDERS):
        args = (ops.PiecewiseSpec(2, 1.5, rest, 64, order), PER_HEAD["m"], torch.tensor([1e5, 1e6, 1e7]).view(3, 1, 1))
        out = ops.piecewise_attention(q, k, v, *args)
        assert out.dtype == dtype and bool(torch.isfinite(out).all())
        ref = ops.piecewise_attention(q.float(), k.float(), v.float(), *args)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_layer_runs_piecewise_and_loads_a_checkpoint_written_before_it():
    layer = LatteParams(48, 3)
    old = {k: v for k, v in layer.state_dict().items() if "piecewise" not in k and "kernel" not in k}
    fresh = LatteParams(48, 3)
    fresh.set_piecewise(2, 1.5, "latte", 16)
    fresh.load_state_dict(old)  # an older checkpoint: its layers are LATTE layers
    assert fresh.kernel == "latte" and int(fresh.piecewise_block) == ops.PIECEWISE_BLOCK
    fresh.set_piecewise(2, 1.5, "latte", 16)
    fresh.mode = "linear"
    q, k, v = qkv(b=2, h=3, n=40, m=40, d=16)
    want = fresh.correct(ops.piecewise_attention(q, k, v, ops.PiecewiseSpec(2, 1.5, "latte", 16), fresh.m.view(-1, 1, 1),
                                                 fresh.log_rho.exp().view(-1, 1, 1)))
    torch.testing.assert_close(fresh(q, k, v), want)
    with pytest.raises(ValueError, match="general attention mask"):
        fresh(q, k, v, attn_mask=torch.ones(40, 40, dtype=torch.bool).triu(1))
    with pytest.raises(ValueError, match="unknown piecewise rest"):
        fresh.set_piecewise(2, 1.0, "nearest")


def test_pooled_queries_of_a_sample_give_the_full_kernel_on_those_queries():
    """Calibration records a sample of the queries with their blocks' pooled queries: the naive
    kernel on the sample equals the full kernel's rows."""
    q, k, v = qkv(b=1, h=2, n=100, m=90, d=16, scale=2.0)
    idx = torch.tensor([0, 7, 31, 32, 63, 99])
    for order in ops.ORDERS:
        pool = pooled_queries(q, 16, order)[:, :, idx]
        spec = ops.PiecewiseSpec(2, 1.2, "blockmean", 16, order)
        full = ops.piecewise_attention(q, k, v, spec, 0.8, 3.0)
        sample = ops.naive_piecewise_attention(q[:, :, idx], k, v, spec, 0.8, 3.0, None, pool)
        torch.testing.assert_close(sample, full[:, :, idx], atol=F32, rtol=F32)


def test_the_knobs_rule_keeps_the_fewest_blocks_within_the_slack():
    mse = {(1, 1.0): 3.0, (1, 2.0): 1.05, (2, 1.0): 1.2, (2, 2.0): 1.0, (4, 1.0): 0.99, (4, 2.0): 1.5}
    assert pick_piecewise(mse) == (1, 2.0)  # 1.05 <= 1.1 x 0.99
    mse[(1, 2.0)] = 1.2
    assert pick_piecewise(mse) == (2, 2.0)
    item = RecordedItem(q=torch.zeros(1, 4, 8), k=torch.zeros(1, 130, 8), v=torch.zeros(1, 130, 8),
                        target=torch.zeros(1, 4, 8))
    assert {t for t, _ in piecewise_candidates([item], 64, None)} == {1, 2}  # 3 key blocks: 4 and 8 cover them all
    assert {t for t, _ in piecewise_candidates([item], 64, 4)} == {4}


def test_calibration_chooses_the_kernel_per_layer_and_the_report_says_so():
    batches = toy_batches(4, tokens=60)
    runs = {}
    for kernel in ("piecewise", "auto"):
        model = ToyEncoder().eval()
        _, rep = linearize(model, batches, candidates=["layers.*.attn"], ratio=0.67, steps=2, log=lambda s: None,
                           progress=False, greedy_images=2, kernel=kernel, piecewise_block=16, signal=False,
                           selection="score", compensate="never")
        runs[kernel] = (model, rep)
        layers = find_latte_layers(model)
        for name, fit in rep["fit"].items():
            choice = fit["kernel"]
            assert layers[name].kernel == choice["kernel"]
            assert set(choice["errors"]) == {"piecewise@1", "piecewise@2"}  # 4 key blocks of 16: 4 and 8 are exact
            if kernel == "auto":  # the cross-fitted errors decide
                want = "piecewise" if choice["crossfit"]["piecewise"] < choice["crossfit"]["latte"] else "latte"
                assert choice["kernel"] == want
            else:
                assert choice["kernel"] == "piecewise" and int(layers[name].piecewise_top) == choice["top"]
    model, rep = runs["piecewise"]
    per_layer = rep["attention_gflops"]["per_layer"]
    assert sum(per_layer.values()) == pytest.approx(rep["attention_gflops"]["linearized"])
    assert rep["attention_gflops"]["linearized"] != rep["attention_gflops"]["exact"]
    with torch.no_grad():  # the hybrid runs, and its piecewise layers are what it runs
        assert torch.isfinite(model(batches[0])).all()
    model, rep = linearize(ToyEncoder().eval(), batches, candidates=["layers.*.attn"], ratio=0.67, steps=2,
                           log=lambda s: None, progress=False, greedy_images=2, kernel="piecewise",
                           piecewise_block=16, piecewise_top=1, signal=False, selection="score", compensate="never")
    assert {f["kernel"]["top"] for f in rep["fit"].values()} == {1}


def test_onnx_export_of_piecewise_layers_matches_onnxruntime(tmp_path):
    from latte_plugin.export import STANDARD_DOMAINS, export_onnx, max_abs_diff, onnx_ops, run_onnx

    model = ToyEncoder().eval()
    linearize(model, toy_batches(4), candidates=["layers.*.attn"], ratio=0.67, steps=2, log=lambda s: None,
              progress=False, greedy_images=2, kernel="piecewise", piecewise_block=16, piecewise_top=1, signal=False,
              selection="score", compensate="never")
    x, kpm = torch.randn(2, 48, 32), _mask(2, 48, 30)
    path = export_onnx(model, (x, kpm), str(tmp_path / "pw.onnx"), input_names=["x", "kpm"])
    ops_used = {op for _, op in onnx_ops(path)}
    assert {d for d, _ in onnx_ops(path)} <= set(STANDARD_DOMAINS) and {"TopK", "Gather"} <= ops_used
    with torch.no_grad():
        for mask in (kpm, _mask(2, 48, 10)):
            x = torch.randn(2, 48, 32)
            assert max_abs_diff([model(x, mask)], run_onnx(path, x, mask)) < 1e-4
