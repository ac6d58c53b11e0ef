"""A host pool's page view (non-contiguous, dense last dim) is copied by one strided memcpy, bit-exact."""
from __future__ import annotations

import pytest
import torch

from kvd.client.cache import _copy_out
from kvd.client.tensors import copy_in, host_strided_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_a_layer_first_page_view_round_trips_through_the_pool(dtype):
    host = (torch.randn(4, 8, 3, 16) * 100).to(dtype)  # layers x pages x heads x dim
    page = host[:, 2]  # one page across every layer: a strided view, as SGLang's layer-first pool gives
    nbytes = page.numel() * page.element_size()
    assert host_strided_bytes(page) is not None
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    copy_in(pool, page, [(128, nbytes)])
    assert torch.equal(pool[128:128 + nbytes], page.contiguous().view(-1).view(torch.uint8))
    back = torch.zeros_like(host)
    _copy_out(pool, [(128, nbytes)], back[:, 5])
    assert torch.equal(back[:, 5].view(torch.uint8), page.view(torch.uint8))
    assert not back[:, 4].any() and not back[:, 6].any()  # nothing written beside the page


def test_views_a_byte_view_cannot_express_take_the_torch_copy():
    assert host_strided_bytes(torch.zeros(4, 4)[:, 1]) is None  # last dim not dense
    assert host_strided_bytes(torch.zeros(4, 4)) is None  # contiguous: the plain memcpy path
