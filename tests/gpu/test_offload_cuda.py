"""On a GPU the offload must really free device memory and come back bit-exact (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_optimizer_offload_frees_device_memory_and_round_trips(tiny_model_dir):
    from hybrid_rl.switch.offload import OptimizerOffloader, optimizer_tensors
    from hybrid_rl.models.loading import load_causal_lm

    dev = torch.device("cuda")
    model = load_causal_lm(tiny_model_dir).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[4, 5, 6]], device=dev)).logits.sum().backward()
    opt.step()
    state_bytes = sum(v.numel() * v.element_size() for _, _, v in optimizer_tensors(opt))
    before = [v.clone() for _, _, v in optimizer_tensors(opt)]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    off = OptimizerOffloader(opt, dev)
    assert off.offload() == state_bytes
    assert allocated - torch.cuda.memory_allocated() >= state_bytes, "offload must free the device copies"
    assert all(v.is_pinned() for _, _, v in optimizer_tensors(opt))
    assert off.onload() == state_bytes
    assert all(torch.equal(a, b) for a, b in zip(before, (v for _, _, v in optimizer_tensors(opt))))


def test_module_offload_frees_device_memory(tiny_model_dir):
    from hybrid_rl.switch.offload import ModuleOffloader
    from hybrid_rl.models.loading import load_causal_lm

    dev = torch.device("cuda")
    model = load_causal_lm(tiny_model_dir).to(dev)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    off = ModuleOffloader(model, dev)
    off.offload()
    assert allocated - torch.cuda.memory_allocated() >= nbytes
    off.onload()
    assert all(torch.equal(p, ref[n]) for n, p in model.named_parameters())
