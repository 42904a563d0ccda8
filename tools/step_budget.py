#!/usr/bin/env python3
"""The measured budget of one training step against its floor, op by op.

  python3 tools/step_budget.py PROFILE.csv --tokens SHARD --step 5 --num-iterations 6 \\
      --copy-tbs 4.23 --bf16-tflops 750.9 --fp8-tflops 1426

PROFILE.csv: tools/kernel_profile.cpp's file of one step of the trainer at the record's shapes
(--profile-step; one range). Each op of the step is a set of the trainer's kernels; its floor is
the least time the record's shapes allow it: FLOPs at the matmul ceiling (bf16 or FP8) for the
products, bytes (each input read once, each output written once, in the trainer's types) at the
copy ceiling for the rest. The ceilings are measured ones (bench_kernels' first rows, same GPU).
Attention counts the (query, key) pairs its mask allows on the step's own tokens (SHARD, the
loader's contiguous micro-sequences: step s's micro-sequence r starts at (s M + r) T), with keys in
the last w blocks of 128 (w the record's window at that step; half of it on the short-window layers).
A model, not a measurement: the byte counts are the op's inputs and outputs, not what a kernel
really moves; where an op is fused into another (the residual added by cuBLASLt), its bytes are the
product's. Prints one table: per step and per micro-sequence, measured, floor and their ratio; the
sums against the range's wall time.
"""
import argparse
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_summary  # noqa: E402

T, D, F, V, H, HEAD_DIM, LAYERS = 49152, 768, 3072, 50304, 6, 128, 12
ATTENTION_LAYERS = [i for i in range(LAYERS) if i != 7]  # the record's layer 7 has no attention
LONG_LAYERS = {0, 4, 11}                                 # the others attend over half the window
SKIPS = LAYERS // 2                                      # the U-net skips: the second half's inputs
EMBED_TABLES = 4                                         # the token embedding and 3 value embeddings
BLOCK, MAX_WINDOW_TOKENS, EOT = 128, 1728, 50256
NEWTON_SCHULZ_STEPS = 5
HIDDEN_MATRICES = [(D, D)] * (4 * len(ATTENTION_LAYERS)) + [(F, D)] * (2 * LAYERS)  # q, k, v, proj; fc, proj


def window_blocks(step, num_iterations):
    """The record's long window in blocks at step (0-based) of a run of num_iterations."""
    target = MAX_WINDOW_TOKENS * step / num_iterations
    return max(BLOCK, math.ceil(target / BLOCK) * BLOCK) // BLOCK


def attention_pairs(tokens, window):
    """(query, key) pairs of one micro-sequence over the layers: same document, causal, key in the last
    `window` blocks of the query's (half of it on the short-window layers)."""
    doc_start, start = [], 0
    for t, token in enumerate(tokens):
        if token == EOT:  # the record's cumsum: an end-of-text token is its next document's first
            start = t
        doc_start.append(start)
    total = 0
    for layer in ATTENTION_LAYERS:
        w = window if layer in LONG_LAYERS else max(window // 2, 1)
        for t in range(len(tokens)):
            first = max(doc_start[t], (t // BLOCK - w + 1) * BLOCK, 0)
            total += t - first + 1
    return total


def read_tokens(path, offset, count):
    with open(path, "rb") as f:
        header = f.read(1024)
        if int.from_bytes(header[:4], "little") != 20240520:
            raise SystemExit(f"error: {path}: not a FineWeb shard (bad magic)")
        f.seek(1024 + 2 * offset)
        data = f.read(2 * count)
    if len(data) != 2 * count:
        raise SystemExit(f"error: {path}: {count} tokens from {offset} run past its end")
    return [int.from_bytes(data[i:i + 2], "little") for i in range(0, len(data), 2)]


def ops(pairs_per_micro, distinct_tokens, micro_batches):
    """[(op, kernel-name pattern, per-step FLOPs or 0, per-step bytes or 0, ceiling: bf16 | fp8 | copy)]."""
    M, td, tf = micro_batches, T * D, T * F
    blocks_flops = 3 * 2 * T * D * (len(ATTENTION_LAYERS) * (3 * D + D) + LAYERS * 2 * F)
    ns_flops = sum(NEWTON_SCHULZ_STEPS * (4 * min(r, k) ** 2 * max(r, k) + 2 * min(r, k) ** 3)
                   for r, k in HIDDEN_MATRICES)
    attention_forward = 4 * HEAD_DIM * H * pairs_per_micro
    hidden = sum(r * k for r, k in HIDDEN_MATRICES)
    adam = EMBED_TABLES * V * D + V * D  # the embeddings and the head (the scalars are few)
    return [
        ("bf16 matmuls: the blocks' 3 products a layer, Muon's Newton-Schulz once a step",
         r"^(nvjet_sm90_(?!q|rq)|cutlass|cublasLt::splitKreduce)", M * blocks_flops + ns_flops, 0, "bf16"),
        ("FP8 head products (forward, dx, dW)", r"^nvjet_sm90_(q|rq)", M * 3 * 2 * T * D * V, 0, "fp8"),
        ("attention forward", r"^flash::forward(_ws)?_kernel$", M * attention_forward, 0, "bf16"),
        ("attention backward (2.5x the forward's FLOPs; delta; with --qkv-backward fused also the QK norm's, "
         "RoPE's and the value mix's backward, whose rows then hold nothing or only the scalar sums)",
         r"^(flash::backward_|attention_delta_kernel)", M * 2.5 * attention_forward, 0, "bf16"),
        ("head cross-entropy: bf16 logits in, e5m2 gradient out", r"^softcap_cross_entropy_kernel$", 0,
         M * 3 * T * V, "copy"),
        ("FP8 casts: x and x^T per chunk, the gradient's transpose, w once", r"^fp8_quantize_kernel$", 0,
         M * (4 * td + 2 * T * V) + 6 * V * D, "copy"),
        ("a block's input: skip, lambda mix, RMS norm in one pass (12)", r"^mix_norm_forward_kernel$", 0,
         M * (SKIPS * 12 + (LAYERS - SKIPS) * 8) * td, "copy"),
        ("RMS norm forward (13 a micro-sequence)", r"^rmsnorm_forward_kernel$", 0, M * 13 * 4 * td, "copy"),
        ("RMS norm backward, accumulating (13 a micro-sequence)", r"^rmsnorm_backward_kernel$", 0, M * 13 * 8 * td,
         "copy"),
        ("a block's input backward: RMS norm, lambda mix, skip in one pass (12; layers 1 to SKIPS - 1 also read "
         "the gradient through a skip)", r"^mix_norm_backward_kernel$", 0,
         M * (SKIPS * 20 + (LAYERS - SKIPS) * 16 + (SKIPS - 1) * 2) * td, "copy"),
        ("MLP fc and proj dx with ReLU² in our GEMM's epilogues (--mlp-fc fused; their FLOPs also in the "
         "matmuls' floor)", r"^gemm_epilogue::gemm_kernel<ReluSquared(Backward)?>$", M * LAYERS * 2 * 2 * T * D * F, 0,
         "bf16"),
        ("qkv with QK norm, RoPE and the value mix in our GEMM's epilogue (--qkv fused; its FLOPs also in the "
         "matmuls' floor)", r"^gemm_epilogue::gemm_kernel<QkvEpilogue>$", M * len(ATTENTION_LAYERS) * 2 * T * D * 3 * D,
         0, "bf16"),
        ("ReLU² forward", r"^relu_squared_forward_kernel$", 0, M * LAYERS * 4 * tf, "copy"),
        ("ReLU² backward", r"^relu_squared_backward_kernel$", 0, M * LAYERS * 6 * tf, "copy"),
        ("QK norm + RoPE forward", r"^qk_norm_rope_forward_kernel$", 0, M * len(ATTENTION_LAYERS) * 8 * td, "copy"),
        ("QK norm + RoPE backward", r"^qk_norm_rope_backward_kernel$", 0, M * len(ATTENTION_LAYERS) * 12 * td,
         "copy"),
        ("value mixes forward (11)", r"^weighted_sum_forward_kernel$", 0, M * 11 * 6 * td, "copy"),
        ("value mixes backward (11; the scalar sums of all mixes)", r"^(weighted_sum_backward|add_scalar_gradients)",
         0, M * 11 * 12 * td, "copy"),
        ("add_into (--residual-add separate's residual adds only; no floor counted)", r"^add_into_kernel$", 0, 0,
         "copy"),
        ("embedding forward", r"^embedding_forward_kernel$", 0, M * EMBED_TABLES * 4 * td, "copy"),
        ("embedding backward (7 a micro-sequence)", r"^embedding_(backward|segment|split)_kernel$", 0,
         M * 7 * (2 * td + 8 * distinct_tokens * D), "copy"),
        ("optimizers: Adam, Muon's elementwise passes",
         r"^(adam_kernel|muon_|frobenius_|scale_by_inverse_norms_kernel)", 0, 28 * adam + 20 * hidden,
         "copy"),
    ]


def budget(ranges, records, pairs_per_micro, distinct_tokens, micro_batches, ceilings):
    """Rows (op, calls, measured ns, floor ns) and the range's wall ns; unmatched kernels are 'other'."""
    (start, end), = ranges
    table = ops(pairs_per_micro, distinct_tokens, micro_batches)
    measured = {op: [0, 0] for op, *_ in table}
    other = [0, 0]
    for kind, s, e, _, name in records:
        if not start <= s <= end:
            continue
        short = profile_summary.short_name(kind, name)
        row = next((measured[op] for op, pattern, *_ in table if kind == "kernel" and re.search(pattern, short)), other)
        row[0] += 1
        row[1] += e - s
    rows = []
    for op, _, flops, bytes_, ceiling in table:
        floor = flops / (ceilings[ceiling] * 1e12) if flops else bytes_ / (ceilings["copy"] * 1e12)
        rows.append((op, measured[op][0], measured[op][1], floor * 1e9))
    rows.append(("other: copies, memsets, loss sums, the rest", other[0], other[1], 0.0))
    return rows, end - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile")
    parser.add_argument("--tokens", required=True, help="the training shard the step read (FineWeb format)")
    parser.add_argument("--step", type=int, required=True, help="the profiled step, 1-based (--profile-step)")
    parser.add_argument("--num-iterations", type=int, required=True)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--copy-tbs", type=float, required=True, help="measured copy ceiling, TB/s (read + write)")
    parser.add_argument("--bf16-tflops", type=float, required=True)
    parser.add_argument("--fp8-tflops", type=float, required=True)
    args = parser.parse_args(argv)
    try:
        ranges, records = profile_summary.read_profile(args.profile)
    except (OSError, profile_summary.ProfileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if len(ranges) != 1:
        print(f"error: {args.profile}: {len(ranges)} ranges; the budget is of one step", file=sys.stderr)
        return 1
    M, step = args.micro_batches, args.step - 1
    window = window_blocks(step, args.num_iterations)
    pairs, distinct = 0, 0
    for r in range(M):
        tokens = read_tokens(args.tokens, (step * M + r) * T, T)
        pairs += attention_pairs(tokens, window)
        distinct += len(set(tokens))
    ceilings = {"copy": args.copy_tbs, "bf16": args.bf16_tflops, "fp8": args.fp8_tflops}
    rows, wall = budget(ranges, records, pairs / M, distinct / M, M, ceilings)
    print(f"Step {args.step} of {args.num_iterations} at M = {M} (window {window} blocks, short {window // 2}; "
          f"{pairs / M / 1e6:.0f} M attention pairs and {distinct / M:.0f} distinct tokens a micro-sequence); "
          f"ceilings {args.copy_tbs} TB/s, bf16 {args.bf16_tflops} and FP8 {args.fp8_tflops} TFLOP/s.\n")
    print("| op | calls | measured ms / step | per micro-sequence | floor ms / step | measured / floor |\n"
          "|---|---|---|---|---|---|")
    for op, calls, ns, floor in rows:
        ratio = f"{ns / floor:.2f}" if floor else "-"
        print(f"| {op} | {calls} | {ns / 1e6:.2f} | {ns / M / 1e6:.2f} | {floor / 1e6:.2f} | {ratio} |")
    total, floors = sum(r[2] for r in rows), sum(r[3] for r in rows)
    print(f"| **sum of the kernels** | {sum(r[1] for r in rows)} | {total / 1e6:.2f} | {total / M / 1e6:.2f} | "
          f"{floors / 1e6:.2f} | {total / floors:.2f} |")
    print(f"| **the step's wall time** (sum / wall {total / wall:.3f}) | | {wall / 1e6:.2f} | {wall / M / 1e6:.2f} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
