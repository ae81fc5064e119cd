"""Block-scaled FP8 kernels: Triton (run by the interpreter on CPU tensors) against the torch references."""

from __future__ import annotations

import os
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from moelaunch import kernels
from moelaunch.kernels import fp8_reference as ref
from moelaunch.kernels import selection
from moelaunch.kernels.fp8_reference import BLOCK_SIZE, FP8_DTYPE, FP8_MAX

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels run on CPU tensors only when interpreted",
)


@pytest.fixture(scope="module")
def tri() -> ModuleType:
    from moelaunch.kernels import fp8_triton

    return fp8_triton


def _fp8_error_bound(x: Tensor, s_elem: Tensor) -> Tensor:
    """Worst-case |fp8(x/s)*s - x|: half an e4m3 ulp, i.e. 2^-4 relative for normals, 2^-10 (scaled) for
    subnormals; the factor covers the fp32 rounding of the division and the product."""
    return (x.abs() * 2.0**-4 + s_elem * 2.0**-10) * (1 + 1e-5)


def _row_block_scale(s: Tensor, k: int) -> Tensor:
    return s.repeat_interleave(BLOCK_SIZE, dim=-1)[..., :k]


def _scale_edge_amaxes() -> Tensor:
    """amax values whose plain scale (amax/448) is a power of two or 1-3 ulps above one; at 2^-20 an fp32
    log2 rounds those ulps away, so they check the ue8m0 ceiling at its boundary."""
    bases = torch.tensor([FP8_MAX * 2.0**-3, FP8_MAX * 2.0**-20]).view(torch.int32)
    return (bases[:, None] + torch.arange(4, dtype=torch.int32)).view(torch.float32).flatten()


def _with_edge_amaxes(x: Tensor) -> Tensor:
    """Give block 1 of the first rows an amax from `_scale_edge_amaxes` (tiny other entries)."""
    rows = x.reshape(-1, x.shape[-1]).clone()
    edges = _scale_edge_amaxes()[: rows.shape[0]].to(x.dtype)
    rows[: len(edges), BLOCK_SIZE : 2 * BLOCK_SIZE] *= 1e-8
    rows[: len(edges), BLOCK_SIZE] = edges
    return rows.reshape(x.shape)


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.uint8)


def _quantized_weight(n: int, k: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ref.weight_quant_ref(torch.randn(n, k, generator=g))


def _quantized_act(shape: tuple[int, ...], seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ref.act_quant_ref(torch.randn(*shape, generator=g) * 4)


# --- act_quant ---------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize(("shape", "dtype"), [((5, 256), torch.bfloat16), ((2, 3, 384), torch.float32)])
def test_act_quant_triton_matches_reference(tri, shape, dtype, scale_fmt):
    g = torch.Generator().manual_seed(0)
    x = _with_edge_amaxes(torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[-1])).to(dtype)
    x[..., :BLOCK_SIZE] = 0  # an all-zero block takes the amax floor
    y, s = tri.act_quant_triton(x, scale_fmt=scale_fmt)
    y_ref, s_ref = ref.act_quant_ref(x, scale_fmt=scale_fmt)
    assert y.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert y.shape == x.shape and s.shape == (*shape[:-1], shape[-1] // BLOCK_SIZE)
    # The fp8 cast is done by torch in both, so values must agree bit for bit.
    assert torch.equal(s, s_ref)
    assert torch.equal(_bits(y), _bits(y_ref))


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_act_quant_reference_error_bound(scale_fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 512, generator=g) * torch.logspace(-4, 3, 512)
    y, s = ref.act_quant_ref(x, scale_fmt=scale_fmt)
    s_elem = _row_block_scale(s, 512)
    assert (y.float().abs() <= FP8_MAX).all()
    assert ((y.float() * s_elem - x).abs() <= _fp8_error_bound(x, s_elem)).all()


def test_act_quant_plain_scale_maps_amax_to_fp8_max():
    x = torch.tensor([[0.5, -3.0] + [0.0] * 126 + [0.0] * 128])
    y, s = ref.act_quant_ref(x)
    assert torch.equal(s, torch.tensor([[3.0, 1e-4]]) / FP8_MAX)
    assert y.float()[0, 1].item() == -FP8_MAX


def test_ue8m0_scale_is_power_of_two_ceiling():
    g = torch.Generator().manual_seed(2)
    x = _with_edge_amaxes(torch.randn(64, 256, generator=g) * torch.logspace(-5, 4, 64)[:, None])
    _, s_plain = ref.act_quant_ref(x)
    _, s = ref.act_quant_ref(x, scale_fmt="ue8m0")
    assert ((s_plain[:8, 1].view(torch.int32) & 0x7FFFFF) == torch.tensor([0, 1, 1, 2] * 2)).all()
    expected = torch.exp2(torch.ceil(torch.log2(s_plain.double()))).float()  # fp64 log2 is exact enough
    assert torch.equal(s, expected)
    assert s[:8, 1].tolist() == [2.0**-3] + [2.0**-2] * 3 + [2.0**-20] + [2.0**-19] * 3


# --- weight_dequant / weight_quant -----------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (1, 130)])
def test_weight_dequant_triton_matches_reference(tri, shape, out_dtype):
    q, s = _quantized_weight(*shape, seed=3)
    out = tri.weight_dequant_triton(q, s, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == shape
    assert torch.equal(out, ref.weight_dequant_ref(q, s, out_dtype=out_dtype))


def test_weight_dequant_default_dtype():
    q, s = _quantized_weight(130, 10, seed=4)
    assert ref.weight_dequant_ref(q, s).dtype == torch.get_default_dtype()


@needs_interpreter
@pytest.mark.parametrize("shape", [(200, 300), (256, 128), (3, 5)])
def test_weight_quant_round_trip(tri, shape):
    g = torch.Generator().manual_seed(5)
    # Rows with very different magnitudes give every block its own scale.
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[0])[:, None]
    q, s = kernels.weight_quant(w)
    nb, kb = -(-shape[0] // BLOCK_SIZE), -(-shape[1] // BLOCK_SIZE)
    assert q.dtype == FP8_DTYPE and q.shape == shape and s.shape == (nb, kb)
    for i in range(nb):
        for j in range(kb):
            block = w[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE, j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE]
            assert s[i, j].item() == pytest.approx(block.abs().max().item() / FP8_MAX, rel=1e-6)
    back = tri.weight_dequant_triton(q, s, out_dtype=torch.float32)
    s_elem = s.repeat_interleave(BLOCK_SIZE, 0)[: shape[0]].repeat_interleave(BLOCK_SIZE, 1)[:, : shape[1]]
    assert ((back - w).abs() <= _fp8_error_bound(w, s_elem)).all()


# --- fp8_gemm ----------------------------------------------------------------------------------------


def _assert_gemm_close(out: Tensor, expected: Tensor) -> None:
    # Both accumulate in fp32; only the summation order differs. atol covers cancellation to ~0.
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())


@needs_interpreter
@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("n", [128, 200, 384])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_fp8_gemm_triton_matches_reference(tri, m, n, k):
    a, a_s = _quantized_act((m, k), seed=m)
    b, b_s = _quantized_weight(n, k, seed=n + k)
    out = tri.fp8_gemm_triton(a, a_s, b, b_s, out_dtype=torch.float32)
    assert out.shape == (m, n)
    _assert_gemm_close(out, ref.fp8_gemm_ref(a, a_s, b, b_s, out_dtype=torch.float32))


@needs_interpreter
def test_fp8_gemm_triton_batched_bf16_and_empty(tri):
    a, a_s = _quantized_act((2, 3, 256), seed=6)
    b, b_s = _quantized_weight(200, 256, seed=7)
    out = tri.fp8_gemm_triton(a, a_s, b, b_s, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 200)
    # Triton writes fp32 under the interpreter and torch rounds, so this matches to the last bf16 bit.
    assert torch.equal(out, ref.fp8_gemm_ref(a, a_s, b, b_s, out_dtype=torch.float32).bfloat16())
    empty = tri.fp8_gemm_triton(a[:0, 0], a_s[:0, 0], b, b_s)
    assert empty.shape == (0, 200)


def _gemm_configs() -> list:
    from moelaunch.kernels import fp8_triton

    return [
        *[pytest.param(c, 1, 130, id=f"large-{c.block_m}x{c.block_n}") for c in fp8_triton.LARGE_M_CONFIGS],
        # K = 640 is 5 blocks: 3 splits of 2, 2 and 1 blocks; 4 splits leave the last one empty.
        *[
            pytest.param(c, split, m, id=f"small-{c.block_n}-split{split}-m{m}")
            for c in fp8_triton.SMALL_M_CONFIGS
            for split, m in ((1, 64), (3, 5), (4, 1))
        ],
    ]


@needs_interpreter
@pytest.mark.parametrize(("config", "split_k", "m"), _gemm_configs())
def test_fp8_gemm_each_config_matches_reference(tri, config, split_k, m):
    """Every config of both autotune lists once (on a GPU the autotuner picks among them), with and
    without K splits, a partial column tile (N = 200) and partial row tiles."""
    a, a_s = _quantized_act((m, 640), seed=m + split_k)
    b, b_s = _quantized_weight(200, 640, seed=11)
    out = tri.fp8_gemm_with(a, a_s, b, b_s, torch.float32, config=config, split_k=split_k)
    assert out.shape == (m, 200)
    _assert_gemm_close(out, ref.fp8_gemm_ref(a, a_s, b, b_s, out_dtype=torch.float32))


def test_fp8_gemm_split_k_from_static_shapes(tri):
    # Decode on 132 SMs: a narrow projection splits K until one wave is full, a wide one does not split.
    assert tri.split_k_for(m=4, n=2048, k=7168, sms=132) == 8
    assert tri.split_k_for(m=4, n=4096, k=2048, sms=132) == 4  # 16 K blocks: at least 4 per split
    assert tri.split_k_for(m=64, n=16384, k=7168, sms=132) == 1
    assert tri.split_k_for(m=1, n=7168, k=512, sms=132) == 1


@needs_interpreter
def test_fp8_gemm_decode_entry_takes_the_small_m_path(tri, monkeypatch):
    """kernels.fp8_gemm at M = 4 runs the first small-M config with the K split its shapes give."""
    monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    calls = []
    with_config = tri.fp8_gemm_with
    monkeypatch.setattr(
        tri, "fp8_gemm_with", lambda *args, **kw: calls.append(kw) or with_config(*args, **kw)
    )
    a, a_s = _quantized_act((4, 1024), seed=12)
    b, b_s = _quantized_weight(256, 1024, seed=13)
    out = kernels.fp8_gemm(a, a_s, b, b_s, out_dtype=torch.float32)
    _assert_gemm_close(out, ref.fp8_gemm_ref(a, a_s, b, b_s, out_dtype=torch.float32))
    assert calls == [{"config": tri.SMALL_M_CONFIGS[0], "split_k": 2}]


def test_fp8_gemm_reference_is_dequantized_matmul():
    a, a_s = _quantized_act((5, 384), seed=8)
    b, b_s = _quantized_weight(200, 384, seed=9)
    a_deq = a.float() * _row_block_scale(a_s, 384)
    expected = a_deq @ ref.weight_dequant_ref(b, b_s, out_dtype=torch.float32).T
    _assert_gemm_close(ref.fp8_gemm_ref(a, a_s, b, b_s, out_dtype=torch.float32), expected)


# --- fp8_linear and the dispatcher -------------------------------------------------------------------


def _linear_error_bound(x: Tensor, w: Tensor, scale_fmt: str | None) -> Tensor:
    """Propagate the per-element activation quantization bound through |W| (weights are exact)."""
    k = x.shape[-1]
    pad = -k % BLOCK_SIZE
    _, s = ref.act_quant_ref(F.pad(x.float(), (0, pad)), scale_fmt=scale_fmt)
    per_elem = _fp8_error_bound(x.float(), _row_block_scale(s, k))
    return per_elem @ w.abs().T + 1e-5 * (x.float().abs() @ w.abs().T)


@pytest.fixture(params=["reference", "triton"])
def path(request, monkeypatch):
    if request.param == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels run on CPU tensors only when interpreted")
        monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    else:
        monkeypatch.delenv("MOELAUNCH_TRITON_ON_CPU", raising=False)
    return request.param


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("k", [64, 256, 200])
def test_fp8_linear_matches_dequantized_linear(path, k, scale_fmt):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, 5, k, generator=g)
    q, s = ref.weight_quant_ref(torch.randn(200, k, generator=g) * 0.1)
    w = ref.weight_dequant_ref(q, s, out_dtype=torch.float32)
    out = kernels.fp8_linear(x, q, s, scale_fmt=scale_fmt)
    assert out.shape == (3, 5, 200) and out.dtype == x.dtype
    assert ((out - F.linear(x, w)).abs() <= _linear_error_bound(x, w, scale_fmt)).all()


def test_fp8_linear_bf16_input_keeps_dtype(path):
    g = torch.Generator().manual_seed(10)
    x = torch.randn(4, 64, generator=g).bfloat16()
    q, s = ref.weight_quant_ref(torch.randn(32, 64, generator=g))
    out = kernels.fp8_linear(x, q, s)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 32)
    w = ref.weight_dequant_ref(q, s, out_dtype=torch.float32)
    bound = _linear_error_bound(x, w, None) + out.float().abs() * 2.0**-8  # + bf16 output rounding
    assert ((out.float() - F.linear(x.float(), w)).abs() <= bound).all()


def test_fp8_linear_pads_k_like_explicit_zero_padding():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 64, generator=g)
    q, s = ref.weight_quant_ref(torch.randn(40, 64, generator=g))
    xp, qp = F.pad(x, (0, 64)), F.pad(q, (0, 64))
    x_q, x_s = ref.act_quant_ref(xp)
    assert torch.equal(
        kernels.fp8_linear(x, q, s), ref.fp8_gemm_ref(x_q, x_s, qp, s, out_dtype=torch.float32)
    )


def _spy(monkeypatch, module, names: list[str], calls: list[str]) -> None:
    for name in names:
        fn = getattr(module, name)

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)


def _run_public_api() -> None:
    x = torch.randn(2, 128)
    q, s = kernels.weight_quant(torch.randn(130, 128))
    kernels.weight_dequant(q, s)
    kernels.fp8_gemm(*kernels.act_quant(x), q, s)


TRITON_FNS = ["act_quant_triton", "weight_dequant_triton", "fp8_gemm_triton"]
REF_FNS = ["act_quant_ref", "weight_dequant_ref", "fp8_gemm_ref"]


@pytest.mark.parametrize(
    ("triton_on_cpu", "interpret"),
    [(None, "1"), ("1", None), ("0", "1")],
    ids=["default", "no-interp", "off"],
)
def test_dispatch_uses_reference_on_cpu(monkeypatch, tri, triton_on_cpu, interpret):
    for var, value in [("MOELAUNCH_TRITON_ON_CPU", triton_on_cpu), ("TRITON_INTERPRET", interpret)]:
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    calls: list[str] = []
    _spy(monkeypatch, tri, TRITON_FNS, calls)
    _spy(monkeypatch, ref, REF_FNS, calls)
    _run_public_api()
    assert calls == ["weight_dequant_ref", "act_quant_ref", "fp8_gemm_ref"]


@needs_interpreter
def test_dispatch_uses_triton_when_asked_on_cpu(monkeypatch, tri):
    monkeypatch.setenv("MOELAUNCH_TRITON_ON_CPU", "1")
    calls: list[str] = []
    _spy(monkeypatch, tri, TRITON_FNS, calls)
    _spy(monkeypatch, ref, REF_FNS, calls)
    _run_public_api()
    assert calls == ["weight_dequant_triton", "act_quant_triton", "fp8_gemm_triton"]


def test_dispatch_sends_cuda_tensors_to_triton(monkeypatch):
    monkeypatch.delenv("MOELAUNCH_TRITON_ON_CPU", raising=False)
    assert selection.use_triton(SimpleNamespace(is_cuda=True))
    assert not selection.use_triton(torch.zeros(1))
