"""hybrid_rl/rollout/sglang/alloc_conf.py: which allocator settings torch reads, and expandable segments in them.

The rules come from torch's c10/core/AllocatorConfig.cpp (see the module docstring): the first
set of PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF is parsed, an empty
value counts as set, whitespace is dropped, a later item overrides an earlier one.
"""

from __future__ import annotations

import pytest

from hybrid_rl.rollout.sglang import alloc_conf as A

ON = "expandable_segments:True"


def _expandable_in_env(env) -> bool:
    """Whether torch, started with this environment, uses expandable segments."""
    return A.expandable_segments(A.effective_conf(env)[1])


@pytest.mark.parametrize(
    "env, name, expandable",
    [
        ({}, None, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": ON}, "PYTORCH_CUDA_ALLOC_CONF", True),
        ({"PYTORCH_ALLOC_CONF": ON}, "PYTORCH_ALLOC_CONF", True),  # the name the old detection missed
        ({"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": ON}, "PYTORCH_ALLOC_CONF", False),  # set, empty: wins
        ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": ON}, "PYTORCH_ALLOC_CONF", False),
        ({"PYTORCH_HIP_ALLOC_CONF": ON}, "PYTORCH_HIP_ALLOC_CONF", True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_HIP_ALLOC_CONF": ON}, "PYTORCH_CUDA_ALLOC_CONF", False),
    ],
)
def test_the_first_set_variable_wins(env, name, expandable):
    assert A.effective_conf(env)[0] == name
    assert _expandable_in_env(env) is expandable


@pytest.mark.parametrize(
    "conf, expandable",
    [
        ("expandable_segments:True", True),
        (" expandable_segments : True ", True),  # torch drops whitespace
        ("expandable_segments:True,expandable_segments:False", False),  # the last item wins
        ("expandable_segments:False,max_split_size_mb:128,expandable_segments:True", True),
        ("roundup_power2_divisions:[256:1,>:2],expandable_segments:True", True),  # commas inside a list
        ("max_split_size_mb:128", False),
        ("", False),
    ],
)
def test_expandable_segments_are_read_as_torch_parses_them(conf, expandable):
    assert A.expandable_segments(conf) is expandable


def test_switching_keeps_every_other_setting():
    """A settings call resets each key it does not name, so the whole string is switched."""
    conf = "max_split_size_mb:128, roundup_power2_divisions:[256:1,>:2], expandable_segments:True"
    off = A.ipc_safe(conf)
    assert off == "max_split_size_mb:128,roundup_power2_divisions:[256:1,>:2],expandable_segments:False"
    assert not A.expandable_segments(off) and A.expandable_segments(A.with_expandable(off, True))
    assert A.ipc_safe("max_split_size_mb:128") is None and A.ipc_safe("") is None  # nothing to switch
    assert A.without_expandable(conf) == "max_split_size_mb:128,roundup_power2_divisions:[256:1,>:2]"


def test_the_engine_environment_loses_expandable_segments_under_every_name():
    env = {
        "PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:True",
        "PYTORCH_CUDA_ALLOC_CONF": ON,
        "PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:64",
        "PATH": "/bin",
    }
    updates = A.engine_env_updates(env)
    # torch_memory_saver checks PYTORCH_CUDA_ALLOC_CONF's text even where PYTORCH_ALLOC_CONF wins.
    assert updates == {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6", "PYTORCH_CUDA_ALLOC_CONF": ""}
    merged = {**env, **updates}
    assert not _expandable_in_env(merged) and "expandable_segments:True" not in merged["PYTORCH_CUDA_ALLOC_CONF"]
    assert A.effective_conf(merged)[0] == "PYTORCH_ALLOC_CONF", "the same name still wins in the engine"
    assert A.engine_env_updates({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}) == {}
