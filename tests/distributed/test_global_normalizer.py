"""Real 2-process gloo test of the global loss normaliser.

Each rank holds half of the rows of one mini-batch. It all-reduce-sums
normalizer_count, computes aggregate_loss on its half, backpropagates, and
all-reduce-sums the loss and the gradients (of the per-token log-probs and of
a shared parameter, as DDP would for a model). The sums must equal a
1-process computation on all rows, for every aggregation mode and loss.

The ranks are separate Python processes running this file as a script (not
multiprocessing pickling), so the test does not depend on how pytest imports
test modules. Hang-proofing: init_process_group has a 60 s timeout and the
parent waits at most RANK_TIMEOUT_S for both ranks, stops waiting as soon as
one rank fails, then kills the ranks it started that are still running and
fails with the log of the failing rank.

Legend: N rows, T response tokens, D features; _NT per token.
"""

import argparse
import os
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

import hybrid_rl
from hybrid_rl.algorithms import LOSS_AGG_MODES, aggregate_loss, compute_policy_loss, normalizer_count

WORLD = 2
N, T, D = 8, 10, 3
NORM_LEN = 12
LOSSES = {
    "ppo_clip": dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
    "gspo": dict(clip_ratio_low=0.01, clip_ratio_high=0.015),
    "cispo": dict(clip_ratio_high=0.2),
}
RANK_TIMEOUT_S = 120


def _make_data():
    """Deterministic mini-batch; rank halves get different token counts and an empty row."""
    g = torch.Generator().manual_seed(1234)
    base_NT = -torch.rand(N, T, generator=g, dtype=torch.float64) * 2
    feats_NTD = 0.3 * torch.randn(N, T, D, generator=g, dtype=torch.float64)
    w0_D = torch.randn(D, generator=g, dtype=torch.float64)
    old_NT = base_NT + feats_NTD @ w0_D + 0.1 * torch.randn(N, T, generator=g, dtype=torch.float64)
    adv_N = torch.randn(N, generator=g, dtype=torch.float64)
    lengths = [10, 3, 0, 7, 1, 2, 10, 5]  # rank 0: 20 tokens + empty row; rank 1: 18 tokens
    mask_NT = torch.zeros(N, T)
    for i, length in enumerate(lengths):
        mask_NT[i, :length] = 1
    return base_NT, feats_NTD, w0_D, old_NT, adv_N, mask_NT


def _forward_backward(rows, mode, loss_name, normalizer, data):
    """Loss on `rows` with a given global normaliser; returns loss and grads (full-size)."""
    base_NT, feats_NTD, w0_D, old_NT, adv_N, mask_NT = data
    w_D = w0_D.clone().requires_grad_(True)
    logp_NT = base_NT + feats_NTD @ w_D
    logp_NT.retain_grad()
    loss_NT, _ = compute_policy_loss(
        loss_name, logp_NT[rows], old_NT[rows], adv_N[rows], mask_NT[rows], **LOSSES[loss_name]
    )
    loss = aggregate_loss(loss_NT, mask_NT[rows], mode, normalizer, norm_length=NORM_LEN)
    loss.backward()
    return loss.detach(), logp_NT.grad.detach(), w_D.grad.detach()


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the host name may not resolve to a local address
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        data = _make_data()
        rows = torch.arange(N).chunk(WORLD)[rank]
        results = {}
        for mode in LOSS_AGG_MODES:
            local = torch.tensor(normalizer_count(data[-1][rows], mode), dtype=torch.float64)
            global_count = local.clone()
            dist.all_reduce(global_count)
            for loss_name in LOSSES:
                loss, g_logp, g_w = _forward_backward(rows, mode, loss_name, float(global_count), data)
                for t in (loss, g_logp, g_w):
                    dist.all_reduce(t)
                results[(mode, loss_name)] = dict(
                    local_count=float(local), global_count=float(global_count), loss=loss, grad_logp=g_logp, grad_w=g_w
                )
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _PortTaken(Exception):
    pass


def _launch(tmp_path: Path) -> list[dict]:
    for attempt in range(3):
        try:
            return _launch_once(tmp_path)
        except _PortTaken:
            # Another process grabbed the free port between probe and bind; retry.
            if attempt == 2:
                raise AssertionError("could not find a free port for the gloo rendezvous in 3 tries")
    raise AssertionError("unreachable")


def _launch_once(tmp_path: Path) -> list[dict]:
    port = _free_port()
    env = dict(os.environ)
    # The ranks import hybrid_rl from the same tree as this process, installed or not.
    src_root = str(Path(hybrid_rl.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
    procs, logs = [], []
    for rank in range(WORLD):
        log = open(tmp_path / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--rank", str(rank), "--port", str(port), "--out", str(tmp_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        # Poll rather than wait on one rank: if a rank dies, its peer would
        # otherwise sit in a collective until the gloo timeout.
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                stuck = [r for r, p in enumerate(procs) if p.poll() is None]
                raise AssertionError(f"ranks {stuck} did not finish within {RANK_TIMEOUT_S} s (hang?)")
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for log in logs:
            log.close()
    for rank, p in sorted(enumerate(procs), key=lambda rp: rp[1].returncode < 0):  # killed peers last
        if p.returncode != 0:
            text = (tmp_path / f"rank{rank}.log").read_text()[-4000:]
            if "Address already in use" in text:
                raise _PortTaken()
            raise AssertionError(f"rank {rank} exited with {p.returncode}:\n{text}")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def test_two_rank_gloo_sum_equals_single_process(tmp_path):
    results = _launch(tmp_path)
    data = _make_data()
    everything = torch.arange(N)
    for mode in LOSS_AGG_MODES:
        full_count = normalizer_count(data[-1], mode)
        for loss_name in LOSSES:
            ref_loss, ref_g_logp, ref_g_w = _forward_backward(everything, mode, loss_name, full_count, data)
            assert ref_g_w.abs().sum() > 0
            r0, r1 = results[0][(mode, loss_name)], results[1][(mode, loss_name)]
            key = f"{mode}/{loss_name}"
            assert r0["global_count"] == r1["global_count"] == full_count, key
            assert r0["local_count"] != full_count, key  # each rank really saw only part of the batch
            for r in (r0, r1):
                assert torch.allclose(r["loss"], ref_loss, rtol=1e-12, atol=1e-14), key
                assert torch.allclose(r["grad_logp"], ref_g_logp, rtol=1e-12, atol=1e-14), key
                assert torch.allclose(r["grad_w"], ref_g_w, rtol=1e-12, atol=1e-14), key


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        _rank_main(args.rank, args.port, args.out)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
