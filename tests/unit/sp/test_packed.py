"""Packed attention: documents found from position_ids, and each attended alone, equal to running the
core on every document separately (plain sdpa on the slice), with and without a sliding window.
fp32 on CPU; the bucketed call pads documents on the right, which causal attention never lets a real
query see, so results match to rounding (1e-5)."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ds_ulysses.sp.packed import find_documents, packed_attention


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.is_causal, self.num_key_value_groups, self.training = True, groups, False


def _positions(docs):
    return torch.cat([torch.arange(n) for n in docs])[None]


def test_documents_start_where_positions_do_not_continue():
    docs = find_documents(torch.cat([_positions([3, 1, 4]), _positions([8])]))
    assert docs.spans == ((0, 0, 3), (0, 3, 1), (0, 4, 4), (1, 0, 8)) and docs.packed
    assert not find_documents(torch.arange(5)[None] + 7).packed  # one document, starting anywhere


@pytest.mark.parametrize("docs,window", [([3, 1, 4, 9], None), ([5, 11], 4), ([16], 3), ([2, 2, 2, 2], None)])
def test_each_document_is_attended_alone(docs, window):
    torch.manual_seed(0)
    sl, heads, kv, hs = sum(docs), 4, 2, 8
    q, k, v = torch.randn(1, heads, sl, hs), torch.randn(1, kv, sl, hs), torch.randn(1, kv, sl, hs)
    module = _Module(heads // kv)
    out, _ = packed_attention(sdpa_attention_forward, module, q, k, v, find_documents(_positions(docs)), window)
    start, want = 0, []
    for n in docs:
        piece = slice(start, start + n)
        mask = None
        if window is not None:
            i = torch.arange(n)
            mask = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window))[None, None]
        ref, _ = sdpa_attention_forward(module, q[:, :, piece], k[:, :, piece], v[:, :, piece], mask,
                                        is_causal=mask is None)
        want.append(ref)                                   # [1 n hc hs]
        start += n
    want = torch.cat(want, dim=1)
    assert out.shape == (1, sl, heads, hs)
    assert (out - want).abs().max() <= 1e-5
