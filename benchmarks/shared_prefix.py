"""A GRPO micro-batch forward (SCORE) and forward + backward (TRAIN): padded vs packed rows vs shared prefix.

    python benchmarks/shared_prefix.py                        # prompts of 4, 64 and 256 tokens
    python benchmarks/shared_prefix.py --prompt-lens 128 --json-only

The micro-batch is what the trainer runs: U prompts x G samples (rows grouped by prompt),
answers of up to `--max-new-tokens` (the length mix of the 32-token digits run: 55% reach
the limit, the rest 3-20 tokens), on a random-init Qwen2 built in code. The three layouts
are `models.logprobs.response_logprobs` (every row padded to the longest), first-fit-
decreasing packed rows (`packed_response_logprobs(share_prompts=False)`) and the distinct-
token row (`share_prompts=True`, each prompt once). They run interleaved, one repetition
of each in turn, so machine noise hits all three; the table prints medians and the
ratio of each to the shared row, and the tokens each layout computes.

Prints a human table, then ONE JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[4, 64, 256])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts per micro-batch (U)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-only", action="store_true")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    from hybrid_rl.data.digits import DIGIT_WORDS
    from hybrid_rl.models.loading import load_causal_lm
    from hybrid_rl.models.logprobs import build_sequences, response_logprobs
    from hybrid_rl.models.packing import pack, packed_response_logprobs
    from hybrid_rl.models.shared_prefix import build_layout
    from hybrid_rl.models.tiny import build_tiny_model_dir

    work = tempfile.mkdtemp(prefix="shared_prefix_bench_")
    model = load_causal_lm(
        build_tiny_model_dir(
            os.path.join(work, "m"), DIGIT_WORDS, hidden_size=a.hidden, num_layers=a.layers, seed=0, max_positions=1024
        )
    )
    V = model.config.vocab_size
    layouts = {
        "padded": lambda ids, attn, P: response_logprobs(model, ids, attn, P),
        "packed_rows": lambda ids, attn, P: packed_response_logprobs(
            model, ids, attn, P, min_saving=0.0, share_prompts=False
        ),
        "shared": lambda ids, attn, P: packed_response_logprobs(
            model, ids, attn, P, min_saving=0.0, share_prompts=True
        ),
    }
    results = []
    for plen in a.prompt_lens:
        rng = random.Random(plen)
        prompts = [[rng.randrange(4, V) for _ in range(plen)] for _ in range(a.prompts)]
        rows = [p for p in prompts for _ in range(a.n)]
        answers = [
            [rng.randrange(4, V) for _ in range(a.max_new_tokens if rng.random() < 0.55 else rng.randint(3, 20))]
            for _ in rows
        ]
        ids, attn, _, P = build_sequences(rows, answers, pad_id=0)
        tokens = {
            "padded": ids.numel(),
            "packed_rows": pack(ids, attn, P, one_row=False).ids_RC.numel(),
            "shared": build_layout(ids, attn, P).tokens,
        }
        times = {(name, mode): [] for name in layouts for mode in ("score", "train")}
        for rep in range(a.reps + 2):
            for name, fn in layouts.items():
                t = time.perf_counter()
                with torch.no_grad():
                    fn(ids, attn, P)
                score_s = time.perf_counter() - t
                t = time.perf_counter()
                logp, ent = fn(ids, attn, P)
                (logp.sum() + 0.01 * ent.sum()).backward()
                train_s = time.perf_counter() - t
                model.zero_grad(set_to_none=True)
                if rep >= 2:  # warm-up
                    times[(name, "score")].append(score_s)
                    times[(name, "train")].append(train_s)
        med = {k: statistics.median(v) for k, v in times.items()}
        results.append(
            {
                "prompt_len": plen,
                "rows": len(rows),
                "tokens": tokens,
                "median_s": {f"{n}/{m}": s for (n, m), s in med.items()},
                "ratio_to_shared": {f"{n}/{m}": med[(n, m)] / med[("shared", m)] for (n, m) in med},
            }
        )
        if not a.json_only:
            print(f"\nprompt {plen} tokens, {a.prompts} prompts x {a.n} samples, answers <= {a.max_new_tokens}")
            print(f"{'layout':>12} {'tokens':>7} {'score_ms':>9} {'x shared':>9} {'train_ms':>9} {'x shared':>9}")
            for n in layouts:
                print(
                    f"{n:>12} {tokens[n]:>7} {med[(n, 'score')] * 1e3:>9.1f} "
                    f"{med[(n, 'score')] / med[('shared', 'score')]:>8.2f}x {med[(n, 'train')] * 1e3:>9.1f} "
                    f"{med[(n, 'train')] / med[('shared', 'train')]:>8.2f}x"
                )
    print(
        json.dumps(
            {
                "bench": "shared_prefix",
                "versions": {"torch": torch.__version__},
                "settings": vars(a),
                "cpu_count": os.cpu_count(),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
