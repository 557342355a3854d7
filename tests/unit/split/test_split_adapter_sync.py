"""Where a split rollout rank puts an adapter-only sync (hybrid_rl/split/weight_sync.py AdapterTarget): the native
engine's own peft-injected module, or an engine's update_adapter; one process, no process group (the broadcast
itself is tests/distributed/test_split_lora.py's)."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.config.schema import LoraSettings

SETTINGS = LoraSettings(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])


def _injected(model_dir: str, seed: int) -> torch.nn.Module:
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.lora import apply_lora

    torch.manual_seed(seed)
    model = apply_lora(load_causal_lm(model_dir, torch.float32), SETTINGS)
    with torch.no_grad():  # lora_B starts at zero: make the adapter matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    return model


def _peft_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What the learner sends: the adapters under their peft names, written out here from the parameter names."""
    out = []
    for n, p in model.named_parameters():
        if ".lora_A.default." in n or ".lora_B.default." in n:
            module, ab = n.rsplit(".lora_", 1)
            out.append((f"base_model.model.{module}.lora_{ab[0]}.weight", p.detach().clone()))
    return out


def test_the_native_engine_gets_the_adapter_in_its_module_and_nothing_else(tiny_model_dir):
    """Catches: adapter tensors copied under the wrong module names (a KeyError, or A into B), the base touched."""
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.split.weight_sync import AdapterTarget

    learner, rollout = _injected(tiny_model_dir, 0), _injected(tiny_model_dir, 1)
    base_before = {n: p.detach().clone() for n, p in rollout.named_parameters() if "lora_" not in n}
    engine = NativeEngine(rollout, pad_id=0, eos_id=1)
    AdapterTarget(rollout).apply(engine, _peft_tensors(learner))
    want = dict(learner.named_parameters())
    for n, p in rollout.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, want[n]), n
        else:
            assert torch.equal(p, base_before[n]), f"{n}: the base changed"


def test_an_engine_that_serves_adapters_gets_the_whole_adapter_with_its_config(tiny_model_dir):
    """Catches: an adapter-serving engine (vLLM, SGLang) handed weight updates instead of update_adapter."""
    from hybrid_rl.split.weight_sync import AdapterTarget

    class Serving:
        got = None

        def update_adapter(self, named_tensors, config):
            self.got = (list(named_tensors), config)
            return 0

    model = _injected(tiny_model_dir, 0)
    engine, sent = Serving(), _peft_tensors(model)
    AdapterTarget(model).apply(engine, sent)
    names, config = engine.got
    assert [n for n, _ in names] == [n for n, _ in sent]
    assert config["r"] == 2 and config["lora_alpha"] == 4.0


def test_an_adapter_of_other_targets_is_refused(tiny_model_dir):
    """Catches: a partial adapter applied silently (the rest would keep the previous version's values)."""
    from hybrid_rl.rollout.native.engine import NativeEngine
    from hybrid_rl.split.transport import PeerError
    from hybrid_rl.split.weight_sync import AdapterTarget

    model = _injected(tiny_model_dir, 0)
    sent = [(n, t) for n, t in _peft_tensors(model) if "v_proj" not in n]
    with pytest.raises(PeerError, match="missing"):
        AdapterTarget(model).apply(NativeEngine(model, pad_id=0, eos_id=1), sent)
