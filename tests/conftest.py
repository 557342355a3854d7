"""Shared fixtures: one tiny random-weight Hugging Face model directory per session.

The directory is built once with `hybrid_rl.models.tiny.build_tiny_model_dir` over
the digits-task vocabulary (`<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3, then
"0".."9", "="), so it goes through exactly the loading path a real checkpoint takes.

    tiny_model_dir          str path of that directory (session; treat as read-only)
    tiny_tokenizer          its tokenizer via `load_tokenizer` (session; do not mutate)
    tiny_model              a fresh fp32 copy of the model in eval mode (per test: mutate freely)
    sharp_model             module-scoped: the tiny model with seeded noise on every matrix, so outputs
                            depend on the context and EOS is sampled now and then (do not mutate)
    tiny_trainer_overrides  small `key=value` overrides for a fast `Trainer` in one process
    no_model_build          loading the policy model fails the test: a check of bad input that
                            should run before the model loads also pins *when* its error comes
    fake_sglang             module-scoped: `import sglang` resolves to the CPU stand-in (tests/fake_sglang)
                            while the module runs; undone after it
    torch_one_thread        module-scoped: torch intra-op threads = 1 while the module runs
                            (a 64-wide model is all overhead; extra threads only contend for
                            cores, several times slower on a loaded machine). Opt in with
                            `pytestmark = pytest.mark.usefixtures("torch_one_thread")`.
"""

from __future__ import annotations

import os

import pytest

TINY_HIDDEN = 64
TINY_LAYERS = 2


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.tiny import build_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny_model")
    return build_tiny_model_dir(str(root / "model"), DIGIT_WORDS, hidden_size=TINY_HIDDEN, num_layers=TINY_LAYERS)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from hybrid_rl.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def tiny_model(tiny_model_dir):
    import torch

    from hybrid_rl.models.loading import load_causal_lm

    return load_causal_lm(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sharp_model(tiny_model_dir):
    import torch

    from hybrid_rl.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(0.15 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture
def tiny_trainer_overrides(tiny_model_dir, tmp_path) -> list[str]:
    """Dotlist overrides for a `Trainer` that builds in about a second on CPU (append your own)."""
    return [
        f"model.path={tiny_model_dir}",
        "data.batch_size=4",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "trainer.total_steps=1",
        f"trainer.out_dir={tmp_path / 'run'}",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
    ]


@pytest.fixture
def no_model_build(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the policy model was loaded before the bad input was reported")

    monkeypatch.setattr("hybrid_rl.models.fsdp.load_causal_lm", fail)


@pytest.fixture(scope="module")
def torch_one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


FAKE_SGLANG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_sglang")


@pytest.fixture(scope="module")
def fake_sglang():
    """Put the SGLang stand-in on sys.path; undo what building an Engine does to this process."""
    import multiprocessing as mp
    import sys

    sys.path.insert(0, FAKE_SGLANG)
    start_method = mp.get_start_method(allow_none=True)
    cuda_conn = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    try:
        yield FAKE_SGLANG
    finally:
        sys.path.remove(FAKE_SGLANG)
        for name in [m for m in sys.modules if m in ("sglang", "fake_sglang_helpers") or m.startswith("sglang.")]:
            del sys.modules[name]
        mp.set_start_method(start_method, force=True)
        if cuda_conn is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = cuda_conn


# CI installs vLLM (`make install`, the [vllm] extra) and sets HYBRID_RL_REQUIRE_VLLM=1 (`.ci/run`): there a
# real-vLLM test that skips (vllm not importable, a broken install) fails the run instead of passing quietly.
# A test counts as a vLLM test when its node id names vllm (tests/*/test_*vllm*.py).
_REQUIRE_VLLM = os.environ.get("HYBRID_RL_REQUIRE_VLLM", "") not in ("", "0")
_skipped_vllm: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and "vllm" in report.nodeid.lower():
        _skipped_vllm.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _REQUIRE_VLLM and _skipped_vllm:
        import sys

        print(
            f"\nHYBRID_RL_REQUIRE_VLLM is set but {len(_skipped_vllm)} vLLM test(s) skipped; the first: "
            f"{_skipped_vllm[0]}. Install the extra: pip install -e '.[vllm]' (see the Makefile).",
            file=sys.stderr,
        )
        session.exitstatus = 1
