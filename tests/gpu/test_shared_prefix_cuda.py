"""The shared-prefix micro-batch forward on CUDA (sdpa underneath) against the padded path, fp32:
log-probs, entropies and every parameter's gradient. Skipped without CUDA; run with `pytest tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from tests.unit.models.test_shared_prefix import check_equals_the_padded_path
from tests.unit.rollout.native.test_lean_step import KINDS, _build

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_equals_the_padded_path_on_cuda(kind):
    torch.backends.cuda.matmul.allow_tf32 = False
    check_equals_the_padded_path(_build(kind).cuda())
