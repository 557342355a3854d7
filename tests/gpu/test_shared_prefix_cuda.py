"""The shared-prefix micro-batch forward on CUDA (sdpa underneath) against the padded path, fp32:
log-probs, entropies and every parameter's gradient. Skipped without CUDA; run with `pytest tests/gpu`."""
from __future__ import annotations

import pytest
import torch

from hybrid_rl.models.logprobs import response_logprobs
from hybrid_rl.models.shared_prefix import shared_prefix_logprobs
from tests.unit.test_lean_step import KINDS, _build
from tests.unit.test_shared_prefix import _assert_grads_close, _group_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_equals_the_padded_path_on_cuda(kind):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _build(kind).cuda()
    ids, attn, mask, P = (t.cuda() if isinstance(t, torch.Tensor) else t for t in _group_batch())
    w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)).cuda() * mask
    ref_lp, ref_ent = response_logprobs(model, ids, attn, P, temperature=0.7)
    ((ref_lp * w).sum() + (ref_ent * w).sum()).backward()
    ref_g = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lp, ent = shared_prefix_logprobs(model, ids, attn, P, temperature=0.7)
    torch.testing.assert_close(lp, ref_lp * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent * mask, rtol=1e-5, atol=1e-5)
    ((lp * w).sum() + (ent * w).sum()).backward()
    _assert_grads_close(model, ref_g)
