"""An offloaded FSDP2 module refuses `load_state_dict` and `_apply` (`.to()`): both end in FSDP2's
`FSDPParam.reset_sharded_param`, which re-pads an uneven shard by copying from the storage the
offload freed (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: its `data_ptr() > 0` test fails
for a freed storage). Real 2-rank gloo FSDP2 with free_storage=True (the device's path on CPU); a
Linear(3, 5) shards its 5 rows 3 + 2, so rank 1's shard is uneven. After the refusal the module
onloads bit-exact, and then both calls work."""

from __future__ import annotations

import torch

from tests.distributed.launch import run_ranks


def _guarded(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from hybrid_rl.runtime import distributed as D
    from hybrid_rl.switch.offload import ModuleOffloader

    dev = D.init("cpu", timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 3))
    fully_shard(model[0])
    fully_shard(model)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}  # DTensors, as a checkpoint loads them
    local = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    refused = {}
    for what, call in [
        ("load", lambda: model.load_state_dict(saved)),
        ("to", lambda: model.to("cpu")),
        ("load_layer", lambda: model[0].load_state_dict({k[2:]: v for k, v in saved.items() if k.startswith("0.")})),
        ("float_layer", lambda: model[0].float()),
    ]:
        off = ModuleOffloader(model, dev, always_copy=True, free_storage=True)
        off.offload()
        try:
            call()
            refused[what] = ""
        except RuntimeError as err:
            refused[what] = str(err)
        off.onload()
        assert all(torch.equal(v.to_local(), local[k]) for k, v in model.state_dict().items()), what
    model.load_state_dict(saved)  # resident again: both work, and change nothing
    model.to("cpu")
    same = all(torch.equal(v.to_local(), local[k]) for k, v in model.state_dict().items())
    return {"refused": refused, "same": same, "uneven": model[0].weight.to_local().shape[0] != 3}


def test_an_offloaded_fsdp_module_refuses_load_state_dict_and_to():
    out = run_ranks(_guarded, world=2, timeout=120)
    assert out[1]["uneven"]
    for rank in out:
        assert rank["same"]
        for what, msg in rank["refused"].items():
            assert "offloaded to host memory" in msg and "onload it first" in msg, (what, msg)
