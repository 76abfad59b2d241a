from __future__ import annotations

import pytest
import torch

from kvlab.kv import KVStorage

L, NB, BS, H, D = 2, 6, 4, 3, 5


def pair(dtype: torch.dtype = torch.float32) -> tuple[KVStorage, KVStorage]:
    return KVStorage(L, NB, BS, H, D, layout="NHD", dtype=dtype), KVStorage(L, NB, BS, H, D, layout="HND", dtype=dtype)


def test_layouts_have_their_documented_shapes():
    nhd, hnd = pair()
    assert tuple(nhd.k_cache[0].shape) == (NB, BS, H, D)
    assert tuple(hnd.k_cache[0].shape) == (NB, H, BS, D)
    assert nhd.nbytes() == hnd.nbytes() == 2 * L * NB * BS * H * D * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn, torch.float8_e5m2])
def test_both_layouts_give_identical_results_and_match_a_reference(dtype: torch.dtype):
    """Writes, block copies and gathers in either layout; an fp8 pool (whose writes and copies go through its bytes)
    holds each value rounded as ``.to()`` rounds it."""
    gen = torch.Generator().manual_seed(0)
    nhd, hnd = pair(dtype)
    ref_k: dict[tuple[int, int], torch.Tensor] = {}
    for step in range(5):
        slots = torch.randperm(NB * BS, generator=gen)[:7]
        for layer in range(L):
            k = torch.randn(7, H, D, generator=gen)
            v = torch.randn(7, H, D, generator=gen)
            nhd.write(layer, slots, k, v)
            hnd.write(layer, slots, k, v)
            for i, s in enumerate(slots.tolist()):
                ref_k[(layer, s)] = k[i].to(dtype).float()
        if step == 2:
            for st in (nhd, hnd):
                st.copy_blocks([(0, 5), (1, 4)])
            for layer in range(L):
                for src, dst in ((0, 5), (1, 4)):
                    for off in range(BS):
                        if (layer, src * BS + off) in ref_k:
                            ref_k[(layer, dst * BS + off)] = ref_k[(layer, src * BS + off)]
                        else:
                            ref_k.pop((layer, dst * BS + off), None)
    query = torch.tensor([[3, 17], [22, 0], [9, 9]])  # any shape S -> [*S, H, D]
    for layer in range(L):
        k1, v1 = (t.float() for t in nhd.gather(layer, query))  # fp8 widened exactly: compared as fp32
        k2, v2 = (t.float() for t in hnd.gather(layer, query))
        assert k1.shape == (3, 2, H, D)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        for (lay, s), want in ref_k.items():
            if lay == layer:
                assert torch.equal(nhd.gather(layer, torch.tensor([s]))[0][0].float(), want)
        table = [5, 2, 4]
        c1 = [t.float() for t in nhd.gather_context(layer, table, 10)]
        c2 = [t.float() for t in hnd.gather_context(layer, table, 10)]
        assert c1[0].shape == (10, H, D)
        assert torch.equal(c1[0], c2[0]) and torch.equal(c1[1], c2[1])
        slots = [b * BS + o for b in table for o in range(BS)][:10]
        assert torch.equal(c1[0], nhd.gather(layer, torch.tensor(slots))[0].float())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_chained_copies_follow_list_order(layout):
    st = KVStorage(1, 3, 2, 1, 1, layout=layout)
    st.write(0, torch.tensor([0, 1]), torch.tensor([[[1.0]], [[2.0]]]), torch.zeros(2, 1, 1))
    st.copy_blocks([(0, 1), (1, 2)])  # block 2 gets block 1 as it is after the first copy
    k, _ = st.gather_context(0, [2], 2)
    assert k.flatten().tolist() == [1.0, 2.0]


def test_write_casts_to_the_storage_dtype_and_checks_shapes():
    st = KVStorage(1, 2, 2, 2, 4, dtype=torch.bfloat16)
    st.write(0, torch.tensor([3]), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    assert st.gather(0, torch.tensor([3]))[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="shape"):
        st.write(0, torch.tensor([0, 1]), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    with pytest.raises(ValueError, match="blocks"):
        st.gather_context(0, [0], 3)
    with pytest.raises(ValueError, match="layout"):
        KVStorage(1, 2, 2, 2, 4, layout="XYZ")
