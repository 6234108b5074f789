"""The bucket plan: ranges of one flat momentum buffer, cut inside large contiguous tensors."""
import torch

from hvd_onebit.engine.fusion import fuse, plan_buckets
from tests.checks import assert_equal_tensors


def test_a_large_tensor_is_cut_across_buckets_and_small_ones_ride_along():
    params = [torch.zeros(3), torch.zeros(100, 10), torch.zeros(5), torch.zeros(250)]
    plan = plan_buckets(params, 400)  # small: at most 25 elements
    assert plan == [[(0, 0, 3), (1, 0, 397)], [(1, 397, 400)], [(1, 797, 203), (2, 0, 5),
                                                                 (3, 0, 192)], [(3, 192, 58)]], plan


def test_a_short_remainder_stays_with_its_bucket():
    plan = plan_buckets([torch.zeros(410)], 400)  # 10 left over <= 400 // 16
    assert plan == [[(0, 0, 410)]], plan


def test_non_contiguous_tensors_are_never_cut():
    t = torch.zeros(30, 40).t()
    assert not t.is_contiguous(), f"the transposed tensor is contiguous (strides {t.stride()})"
    plan = plan_buckets([torch.zeros(300), t], 400)
    assert plan == [[(0, 0, 300)], [(1, 0, 1200)]], plan


def test_momentum_views_cover_every_bucket_in_order():
    torch.manual_seed(0)
    params = [torch.zeros(7, 9), torch.zeros(300), torch.zeros(2)]
    momenta = [torch.randn(p.shape) for p in params]
    flat, buckets = fuse(params, momenta, 128)
    assert_equal_tensors(flat, torch.cat([m.reshape(-1) for m in momenta]),
                         "the fused buffer vs the momenta concatenated")
    assert_equal_tensors(torch.cat([b.momentum for b in buckets]), flat,
                         "the buckets' momenta concatenated vs the fused buffer")
    elsewhere = [i for i, b in enumerate(buckets)
                 if b.momentum.data_ptr() != flat[sum(x.numel for x in buckets[:i]):].data_ptr()]
    assert not elsewhere, f"buckets {elsewhere} of {len(buckets)} are not views of the fused " \
                          f"buffer at their offset"
    for b in buckets:  # each segment's piece of its parameter is its range of the bucket
        for i, seg in enumerate(b.segments):
            m = momenta[[p is seg.param for p in params].index(True)]
            assert torch.equal(b.momentum_view(i), b.piece(i, m).reshape(-1)), (b.index, i)
