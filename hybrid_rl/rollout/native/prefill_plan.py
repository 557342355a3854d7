"""How the native engine lays out one decode batch's prefill: shared prompts once, then each row's own tokens,
in length buckets. Host lists only (no torch): the engine (`NativeEngine._prefill_batch`) runs the plan.

A partial rollout (issue 37) sends a carried sample as one row, its prompt + the prefix it generated: the G samples
of a carried group share the prompt and differ in their prefixes, and the rows run from a few tokens to prompt +
most of the budget. Prefilled whole, every row recomputes its prompt and every row is padded to the longest. Here:

* stems: rows are grouped by a shared leading run of tokens (sorted rows, greedily: a row joins the group while the
  tokens the group saves do not shrink, `_stem_lengths`); each distinct stem is prefilled once (phase 1), in
  length buckets (`buckets`), each bucket left-padded to its own length and written at the slots that end at P_s;
* suffixes: each distinct row's tokens after its stem are prefilled in a second forward (phase 2), in buckets by
  suffix length, over the row's copy of its stem's cache: a bucket of length L writes slots P - L .. P - 1 and
  attends to the stem (slots < P_s), a masked gap, and its own left-padded suffix. Positions count real tokens only
  (`models.logprobs.position_ids` over the row's whole mask), so a suffix token sits at its position in the row;
* a row that is its stem (no suffix: every row of an uncarried prompt) takes its first logits from phase 1 and
  has slots P_s .. P - 1 masked.

The cache then holds, for every row, its tokens' keys and values at the same positions as a whole-row prefill, with
masked slots where padding or the gap is; the decode loop reads only the mask. A batch without a shared stem
(every row distinct with nothing in common) has no phase 2: one bucketed prefill of whole rows.

Legend: N rows, U distinct rows, U1 distinct stems, P_s stem slots, P_x suffix slots, P = P_s + P_x.
"""

from __future__ import annotations

from dataclasses import dataclass

# A forward's fixed cost, in tokens of padding it is worth (a bucket boundary is placed where it saves more padded
# tokens than this). Measured on 2 CPU cores, 1 thread, tiny Qwen2 (hidden 128, 2 layers): a prefill forward of one
# token costs ~1 ms, and 0.02-0.03 ms a token at 64-1000 tokens; on CUDA a forward's launches cost as much as
# hundreds of tokens of a small model (not measured here: a guess that keeps GPU prefills in few buckets).
FORWARD_TOKENS = {"cpu": 48, "cuda": 1024}
MIN_STEM = 2  # tokens a shared stem needs before rows are split into stem + suffix for it


@dataclass(frozen=True)
class Bucket:
    """Rows a..b-1 of a phase, padded to L tokens, in forwards of at most the engine's prefill rows."""

    a: int
    b: int
    L: int


@dataclass
class PrefillPlan:
    stems: list[tuple[int, ...]]  # U1 distinct stems, shortest first (bucket order)
    stem_buckets: list[Bucket]
    rows: list[tuple[int, ...]]  # U distinct rows: those with a suffix first (shortest suffix first), then the rest
    stem_of: list[int]  # U: index into `stems` of each row's stem
    n_suffix: int  # rows[:n_suffix] have a suffix
    suffix_buckets: list[Bucket]
    src: list[int]  # N: index into `rows` of each input row
    P_s: int
    P_x: int

    @property
    def P(self) -> int:
        return self.P_s + self.P_x

    def suffix(self, u: int) -> tuple[int, ...]:
        return self.rows[u][len(self.stems[self.stem_of[u]]) :]

    def forwards(self) -> int:
        return len(self.stem_buckets) + len(self.suffix_buckets)


def _lcp(x: tuple[int, ...], y: tuple[int, ...]) -> int:
    n = min(len(x), len(y))
    i = 0
    while i < n and x[i] == y[i]:
        i += 1
    return i


def _stem_lengths(uniq: list[tuple[int, ...]]) -> list[int]:
    """Each distinct row's stem length: groups of rows (in sorted order) that share their first k tokens. A row
    joins the open group when the group's saving, (members - 1) x stem, does not shrink: C x lcp >= (C - 1) x stem
    (a group of one saves nothing, so any shared run of MIN_STEM tokens starts one); a row alone is its own stem."""
    order = sorted(range(len(uniq)), key=lambda i: uniq[i])
    out = [len(r) for r in uniq]
    group: list[int] = []
    stem = 0

    def close() -> None:
        if len(group) > 1:
            for i in group:
                out[i] = stem

    for i in order:
        if group:
            k = min(stem, _lcp(uniq[group[-1]], uniq[i]))
            if k >= MIN_STEM and len(group) * k >= (len(group) - 1) * stem:
                group.append(i)
                stem = k
                continue
            close()
        group, stem = [i], len(uniq[i])
    close()
    return out


def buckets(lengths: list[int], chunk: int, forward_tokens: int) -> list[Bucket]:
    """Buckets over rows sorted by length (ascending): contiguous runs, each padded to its longest, chosen to minimise
    padded tokens + forward_tokens per forward (dynamic programming over the distinct lengths); a bucket of more
    than `chunk` rows runs in several forwards of at most `chunk`."""
    if not lengths:
        return []
    distinct = sorted(set(lengths))
    ends: list[int] = []  # ends[j]: rows with length <= distinct[j]
    for L in distinct:
        ends.append(sum(1 for x in lengths if x <= L))

    def cost(i: int, j: int) -> int:  # distinct lengths i..j in one bucket
        n = ends[j] - (ends[i - 1] if i else 0)
        return n * distinct[j] + forward_tokens * -(-n // chunk)

    best = [0] * (len(distinct) + 1)
    cut = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        best[j], cut[j] = min((best[i] + cost(i, j - 1), i) for i in range(j))
    out: list[Bucket] = []
    j = len(distinct)
    while j:
        i = cut[j]
        a, b = (ends[i - 1] if i else 0), ends[j - 1]
        out += [Bucket(x, min(b, x + chunk), distinct[j - 1]) for x in range(a, b, chunk)][::-1]
        j = i
    return out[::-1]


def plan_prefill(
    prompts: list[list[int]], chunk: int, forward_tokens: int, share: bool = True, max_slots: int | None = None
) -> PrefillPlan:
    """The batch's plan. share=False, or a shared layout wider than max_slots (the slots the memory budget was
    planned with): whole rows, bucketed (P = the longest row)."""
    first: dict[tuple[int, ...], int] = {}
    src_in = [first.setdefault(tuple(p), len(first)) for p in prompts]
    uniq = list(first)
    stem_len = _stem_lengths(uniq) if share else [len(r) for r in uniq]
    if share and max_slots is not None:
        P = max(stem_len) + max(len(r) - k for r, k in zip(uniq, stem_len))
        if P > max_slots:
            stem_len = [len(r) for r in uniq]
    # Stems, shortest first; rows with a suffix first, shortest suffix first.
    stem_set = sorted({r[:k] for r, k in zip(uniq, stem_len)}, key=lambda s: (len(s), s))
    stem_idx = {s: i for i, s in enumerate(stem_set)}
    order = sorted(range(len(uniq)), key=lambda i: (len(uniq[i]) == stem_len[i], len(uniq[i]) - stem_len[i], i))
    pos = {u: j for j, u in enumerate(order)}
    rows = [uniq[u] for u in order]
    stem_of = [stem_idx[uniq[u][: stem_len[u]]] for u in order]
    n_suffix = sum(1 for u in order if len(uniq[u]) > stem_len[u])
    suffix_lens = [len(uniq[u]) - stem_len[u] for u in order[:n_suffix]]
    return PrefillPlan(
        stems=stem_set,
        stem_buckets=buckets([len(s) for s in stem_set], chunk, forward_tokens),
        rows=rows,
        stem_of=stem_of,
        n_suffix=n_suffix,
        suffix_buckets=buckets(suffix_lens, chunk, forward_tokens),
        src=[pos[u] for u in src_in],
        P_s=max(len(s) for s in stem_set),
        P_x=max(suffix_lens, default=0),
    )
