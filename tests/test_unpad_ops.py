"""dmfx::unpad_index (cuda_ops/unpad.py): where the real tokens of a padded batch are, and the unpad /
pad helpers around it."""

import pytest
import torch

from dmfx.cuda_ops import unpad as U


def reference(mask):
    keep = mask != 0
    indices = torch.tensor([b * mask.shape[1] + s for b in range(mask.shape[0]) for s in range(mask.shape[1]) if keep[b, s]],
                           dtype=torch.int64)
    lengths = keep.sum(1).tolist()
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    return indices, cu


MASKS = {
    "right": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]),
    "left": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]),
    "holes": torch.tensor([[1, 0, 1, 0, 1], [0, 1, 1, 1, 0], [1, 1, 0, 1, 1]]),
    "all padding": torch.zeros(2, 4, dtype=torch.long),
    "no padding": torch.ones(2, 4, dtype=torch.long),
    "a padded row": torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]]),
    "empty batch": torch.zeros(0, 5, dtype=torch.long),
}


@pytest.mark.parametrize("case", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float32])
def test_indices_and_offsets(case, dtype):
    mask = MASKS[case].to(dtype)
    indices, cu = U.unpad_index(mask)
    ref_i, ref_cu = reference(MASKS[case])
    assert indices.dtype == torch.int64 and cu.dtype == torch.int32
    assert torch.equal(indices, ref_i)
    assert torch.equal(cu, ref_cu)


def test_unpad_then_pad_round_trip():
    mask = MASKS["holes"]
    x = torch.randn(*mask.shape, 3, 2)
    packed, indices, cu = U.unpad(x, mask)
    assert packed.shape == (int(mask.sum()), 3, 2)
    assert torch.equal(packed, x[mask.bool()])
    back = U.pad(packed, indices, *mask.shape)
    assert torch.equal(back[mask.bool()], x[mask.bool()])
    assert torch.equal(back[~mask.bool()], torch.zeros_like(back[~mask.bool()]))


@pytest.mark.parametrize("bad", [2, -1, 0.5])
def test_values_other_than_0_1_raise(bad):
    mask = MASKS["right"].to(torch.float32).clone()
    mask[1, 2] = bad
    with pytest.raises(ValueError, match="dmfx::unpad_index: the padding mask .attention_mask. must hold only 0"):
        U.unpad_index(mask)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4)])
def test_not_2d_raises(shape):
    with pytest.raises(ValueError, match=r"dmfx::unpad_index: mask must be a 2-D \[batch, seq\] padding mask"):
        U.unpad_index(torch.ones(shape))


def test_not_a_tensor_raises():
    with pytest.raises(TypeError, match="dmfx::unpad_index: mask must be a Tensor"):
        U.unpad_index([[1, 0]])


def test_traced_number_of_tokens_is_data_dependent():
    """In a graph the number of real tokens is an unbacked SymInt bounded by B * S: one compiled graph
    serves every batch."""
    def f(x, mask):
        indices, cu = torch.ops.dmfx.unpad_index(mask)
        return x.reshape(-1, x.shape[-1]).index_select(0, indices).sum(0), cu

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 5, 4)
    for case in ("right", "left", "holes", "no padding"):
        mask = MASKS[case] if MASKS[case].shape == (3, 5) else torch.ones(3, 5, dtype=torch.long)
        got, cu = compiled(x, mask)
        ref, ref_cu = f(x, mask)
        assert torch.allclose(got, ref) and torch.equal(cu, ref_cu)


def test_opcheck():
    for case in ("right", "holes", "all padding"):
        torch.library.opcheck(torch.ops.dmfx.unpad_index.default, (MASKS[case],),
                              test_utils=("test_schema", "test_autograd_registration"))


# ----------------------------------------------------------------------------------------- unpad_targets


def test_targets_of_the_real_rows():
    mask = MASKS["holes"]
    target = torch.randint(0, 7, mask.shape).masked_fill(mask == 0, -100)
    indices, _ = U.unpad_index(mask)
    for t in (target, target.reshape(-1)):
        assert torch.equal(torch.ops.dmfx.unpad_targets(t, mask, indices, -100), target.reshape(-1)[mask.reshape(-1) != 0])


def test_a_target_at_padding_raises_naming_the_position():
    mask = MASKS["left"]
    target = torch.randint(0, 7, mask.shape)  # (padding not ignored)
    b, s = (mask == 0).nonzero()[0].tolist()
    indices, _ = U.unpad_index(mask)
    with pytest.raises(ValueError, match=rf"at padding position \[{b}, {s}\] \(not ignore_index -100\)"):
        torch.ops.dmfx.unpad_targets(target, mask, indices, -100)
    # ignored with another ignore_index: fine
    out = torch.ops.dmfx.unpad_targets(target.masked_fill(mask == 0, 3), mask, indices, 3)
    assert out.shape == indices.shape


@pytest.mark.parametrize("target,why", [(torch.zeros(8), "integer class indices"),
                                        (torch.zeros(2, 2, 2, dtype=torch.long), "one class index per position")])
def test_targets_bad_input_raises(target, why):
    mask = torch.ones(2, 4, dtype=torch.long)
    indices, _ = U.unpad_index(mask)
    with pytest.raises((ValueError, TypeError), match=why):
        torch.ops.dmfx.unpad_targets(target, mask, indices, -100)


def test_targets_opcheck():
    mask = MASKS["holes"]
    target = torch.randint(0, 7, mask.shape).masked_fill(mask == 0, -100)
    indices, _ = U.unpad_index(mask)
    torch.library.opcheck(torch.ops.dmfx.unpad_targets.default, (target, mask, indices, -100),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
