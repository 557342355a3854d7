"""Shared by the LoRA tests (unit, 2 ranks, vLLM): adapter weights that move the output, and a fixed batch."""

from __future__ import annotations

import torch


def perturb_adapters(model: torch.nn.Module, seed: int, scale: float = 0.5) -> torch.nn.Module:
    """Non-zero lora_A and lora_B (peft starts B at zero, so a fresh adapter changes nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def batch(seed: int = 0, n: int = 6):
    """ids, attn, response mask, P over the digits vocabulary (ids 4..14): prompts 2..5, responses 1..6 tokens."""
    from hybrid_rl.models.logprobs import build_sequences

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 15, (2 + i % 4,), generator=g).tolist() for i in range(n)]
    responses = [torch.randint(4, 15, (1 + (i * 5) % 6,), generator=g).tolist() for i in range(n)]
    return build_sequences(prompts, responses, pad_id=0)


def expected_adapter_numel(
    config, rank: int, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
) -> int:
    """rank x (in + out) summed over the targeted projections of every layer, from the HF config's arithmetic alone."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    widths = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    return layers * sum(rank * (widths[t][0] + widths[t][1]) for t in targets)
