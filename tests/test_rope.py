import math

import pytest
import torch
from conftest import assert_case

from foak.ops.rope import rope, rope_reference
from foak.testing import relative_error, rope_case

DTYPES = [torch.float32, torch.bfloat16]
CASES = [
    # batch, q_heads, kv_heads, seq, head_dim, extra
    (2, 5, 3, 7, 16, {}),
    (1, 4, 1, 11, 8, {"hf_layout": False}),
    (3, 2, 2, 13, 32, {"cos_batch": 3}),
    (2, 6, 2, 9, 24, {"rotary_dim": 12}),  # partial rotary
    (2, 4, 2, 19, 16, {"rotary_dim": 10, "packed": True}),  # position_ids restart inside a row
    (1, 3, 3, 23, 16, {"packed": True, "hf_layout": False}),
    (2, 5, 3, 7, 16, {"interleaved": True}),  # GLM's adjacent pairs
    (2, 6, 2, 9, 24, {"rotary_dim": 12, "interleaved": True}),  # GLM-4: interleaved partial rotary
    (2, 4, 2, 19, 16, {"rotary_dim": 10, "packed": True, "interleaved": True}),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:5])) + "".join(f"-{k}" for k in c[5]))
def test_matches_reference(case, dtype):
    *dims, extra = case
    errors = assert_case(rope_case(*dims, **extra), dtype)
    assert set(errors) == {"out0", "out1", "grad_q", "grad_k"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [None, 10])
def test_k_without_heads_rotates_q_alone(dtype, rotary_dim):
    """A k of no heads (Gemma 4 rotates q and k in separate one-tensor calls): q's output and gradient are the
    reference's, computed with a real k."""
    g = torch.Generator().manual_seed(0)
    B, H, S, D = 2, 3, 9, 18
    rot = rotary_dim or D
    x = torch.randn(B, S, H, D, generator=g).to(dtype).requires_grad_()
    angles = torch.rand(1, S, rot // 2, generator=g) * 6.3
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = x.transpose(1, 2)
    out, k_out = rope(q, q[:, :0], cos, sin)
    assert k_out.shape == (B, 0, S, D)
    dy = torch.randn(out.shape, generator=g).to(dtype)
    (dx,) = torch.autograd.grad(out, x, dy)
    xr = x.detach().float().requires_grad_()
    ref, _ = rope_reference(xr.transpose(1, 2), torch.zeros(B, 1, S, D), cos.float(), sin.float())
    (dx_ref,) = torch.autograd.grad(ref, xr, dy.float())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert relative_error(out, ref) < tol and relative_error(dx, dx_ref) < tol


def _complex_rotation(x, angles):
    """Independent formulation: pairs (x_i, x_{i+R/2}) rotated as complex numbers by the angle."""
    half = angles.shape[-1]
    rot = 2 * half
    z = torch.complex(x[..., :half].double(), x[..., half:rot].double()) * torch.polar(
        torch.ones_like(angles).double(), angles.double()
    )
    return torch.cat((z.real, z.imag, x[..., rot:].double()), dim=-1)


def test_reference_is_a_rotation():
    angles = torch.rand(1, 9, 6) * 2 * math.pi  # rotary dim 12 of head dim 16
    cos = torch.cat((angles, angles), -1).cos()
    sin = torch.cat((angles, angles), -1).sin()
    q, k = torch.randn(2, 3, 9, 16, dtype=torch.float64), torch.randn(2, 1, 9, 16, dtype=torch.float64)
    q_out, k_out = rope_reference(q, k, cos, sin)
    assert relative_error(q_out, _complex_rotation(q, angles[:, None])) < 1e-6
    assert relative_error(k_out, _complex_rotation(k, angles[:, None])) < 1e-6


def test_packed_positions_equal_per_sequence_rope():
    # a row packing sequences of lengths 4 and 6 equals rotating each sequence from position 0
    table_angles = torch.rand(16, 8) * 6.3
    cos = torch.cat((table_angles, table_angles), -1).cos()
    sin = torch.cat((table_angles, table_angles), -1).sin()
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    q, k = torch.randn(1, 3, 10, 16), torch.randn(1, 1, 10, 16)
    q_out, k_out = rope(q, k, cos, sin, position_ids=pos)
    for start, n in ((0, 4), (4, 6)):
        q_seq, k_seq = rope(q[:, :, start:start + n], k[:, :, start:start + n], cos[None, :n], sin[None, :n])
        assert relative_error(q_out[:, :, start:start + n], q_seq) < 1e-6
        assert relative_error(k_out[:, :, start:start + n], k_seq) < 1e-6


def test_inputs_are_not_modified_and_layout_is_kept():
    q = torch.randn(2, 7, 4, 16).transpose(1, 2).requires_grad_()  # HF layout [B, H, S, D] over [B, S, H, D]
    k = torch.randn(2, 7, 2, 16).transpose(1, 2).requires_grad_()
    angles = torch.rand(1, 7, 8)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q_before, k_before = q.detach().clone(), k.detach().clone()
    q_out, k_out = rope(q, k, cos, sin)
    (q_out.square().sum() + k_out.sum()).backward()
    assert torch.equal(q.detach(), q_before) and torch.equal(k.detach(), k_before)
    assert q_out.stride() == q.stride()
    # rotation preserves norms per (head, position)
    assert relative_error(q_out.norm(dim=-1), q.norm(dim=-1)) < 1e-6


def test_backward_is_inverse_rotation():
    angles = torch.rand(1, 5, 8) * 6.3
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q, k = torch.randn(1, 2, 5, 16, requires_grad=True), torch.randn(1, 1, 5, 16, requires_grad=True)
    q_out, k_out = rope(q, k, cos, sin)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (q_out.detach(), k_out.detach()))
    assert relative_error(dq, q.detach()) < 1e-6 and relative_error(dk, k.detach()) < 1e-6


def _args(**over):
    angles = torch.rand(1, 7, 8)
    args = {
        "q": torch.randn(2, 4, 7, 16), "k": torch.randn(2, 2, 7, 16),
        "cos": torch.cat((angles, angles), -1).cos(), "sin": torch.cat((angles, angles), -1).sin(),
        "position_ids": None,
    }
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, message",
    [
        ({"q": torch.randn(4, 7, 16)}, "q and k must be 4-D"),
        ({"k": torch.randn(2, 2, 8, 16)}, "must agree in batch, seq and head_dim"),
        ({"k": torch.randn(2, 2, 7, 16, dtype=torch.bfloat16)}, "tensors must share one dtype"),
        ({"q": torch.randint(0, 3, (2, 4, 7, 16))}, "q has dtype torch.int64"),
        ({"cos": torch.rand(1, 7, 8)}, "cos .* and sin .* must have the same shape"),
        ({"cos": torch.rand(1, 7, 7), "sin": torch.rand(1, 7, 7)}, "must be even"),
        ({"cos": torch.rand(1, 7, 18), "sin": torch.rand(1, 7, 18)}, "must be even, positive and <= head_dim"),
        ({"cos": torch.rand(3, 7, 16), "sin": torch.rand(3, 7, 16)}, r"cos/sin must be \[2 or 1, 7, rotary_dim\]"),
        ({"cos": torch.rand(7, 16), "sin": torch.rand(7, 16)}, "without position_ids"),
        ({"position_ids": torch.arange(7)[None]}, "with position_ids, cos/sin must be tables"),
        ({"position_ids": torch.arange(7.0)[None], "cos": torch.rand(9, 16), "sin": torch.rand(9, 16)}, "int32 or int64"),
        ({"position_ids": torch.arange(6)[None], "cos": torch.rand(9, 16), "sin": torch.rand(9, 16)}, r"position_ids must be \[2 or 1, 7\]"),
        ({"position_ids": torch.arange(7)[None] + 3, "cos": torch.rand(9, 16), "sin": torch.rand(9, 16)}, r"span \[3, 9\] but the cos/sin tables have 9"),
        ({"position_ids": torch.arange(7)[None] - 1, "cos": torch.rand(9, 16), "sin": torch.rand(9, 16)}, r"span \[-1, 5\]"),
        ({"cos": torch.rand(1, 7, 16, requires_grad=True)}, "gradients w.r.t. cos/sin are not supported"),
        ({"k": torch.randn(2, 2, 7, 16, device="meta")}, "all tensors must be on one device"),
    ],
)
def test_bad_input(over, message):
    with pytest.raises(ValueError, match=message):
        rope(**_args(**over))


@pytest.mark.parametrize("rot", [16, 10])
def test_interleaved_is_half_layout_on_permuted_pairs(rot):
    # independent formulation: moving the even dims of the rotary part first and the odd ones after turns the
    # interleaved layout into the rotate_half layout (cos/sin of pair i at i and R/2 + i)
    q, k = torch.randn(2, 3, 7, 16, dtype=torch.float64), torch.randn(2, 1, 7, 16, dtype=torch.float64)
    angles = torch.rand(1, 7, rot // 2, dtype=torch.float64) * 6.3
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    garbage = torch.full_like(cos[..., rot // 2:], 7.0)  # the second half is never read in that layout
    cos_i, sin_i = torch.cat((cos[..., : rot // 2], garbage), -1), torch.cat((sin[..., : rot // 2], garbage), -1)
    perm = torch.cat((torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, 16)))
    inverse = torch.argsort(perm)
    expected = [t[..., inverse] for t in rope_reference(q[..., perm], k[..., perm], cos, sin)]
    for out, exp in zip(rope(q.float(), k.float(), cos_i.float(), sin_i.float(), interleaved=True), expected):
        assert relative_error(out, exp) < 1e-6
    for out, exp in zip(rope_reference(q, k, cos_i, sin_i, interleaved=True), expected):
        assert relative_error(out, exp) < 1e-12
