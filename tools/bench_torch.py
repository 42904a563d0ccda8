#!/usr/bin/env python3
"""PyTorch's side of the kernel benchmark: the same ops at the record's shapes, timed on the same
GPU, beside our kernels' times (the table `build/bench_kernels` prints, passed with --ours).

- attention: FlexAttention with the reference's block masks (SPEC 1.4: document-causal mask_mod,
  partial/full block lists sorted nearest-first, the window clamping of BlockMask.from_kv_blocks)
  over the documents of the first T tokens of data/sample/ (the same tokens bench_kernels reads);
  F.scaled_dot_product_attention (causal, no document mask: a dense reference point);
- the FP8 head of SPEC 1.5 through torch._scaled_mm (forward with fast accumulation, both
  backward products without) over T rows in chunks of 8192, and the bf16 matmuls of every
  linear layer;
- rms_norm, the softcapped cross-entropy and the MLP's fc with ReLU² (forward, and the proj's dx
  with ReLU²'s backward) under torch.compile (what the reference runs).

Usage (on the GPU machine, from the repository root):
    build/bench_kernels 20 > bench_kernels.txt
    python3 tools/bench_torch.py --ours bench_kernels.txt [--repeats 20]
"""
import argparse
import re
import struct

import torch
import torch.nn.functional as F

T, D, FF, QKV, V, H, HEAD_DIM = 49152, 768, 3072, 2304, 50304, 6, 128
CHUNK = 8192  # rows of the lm_head at once, as the model runs it (train_gpt.cu kHeadChunkRows)
BOS, BLOCK = 50256, 128
SAMPLE = "data/sample/sample_train_000001.bin"


@torch.compile
def softcapped_loss(z, targets):
    """The reference's summed softcapped cross-entropy (SPEC 1.2.7), as it compiles it."""
    z = 30 * torch.sigmoid(z.float() / (7.5 * D ** 0.5))
    return F.cross_entropy(z, targets, reduction="sum")


def median_ms(fn, repeats):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def read_tokens(path, count):
    with open(path, "rb") as f:
        header = struct.unpack("<256i", f.read(1024))
        if header[0] != 20240520 or header[1] != 1:
            raise SystemExit(f"{path}: not a shard (magic {header[0]}, version {header[1]})")
        data = f.read(2 * count)
    if len(data) < 2 * count:
        raise SystemExit(f"{path}: holds fewer than {count} tokens")
    return torch.frombuffer(bytearray(data), dtype=torch.int16).to(torch.int32) & 0xFFFF


def block_masks(tokens, window_blocks):
    """The reference's long and short BlockMasks for one packed sequence (SPEC 1.4)."""
    from torch.nn.attention.flex_attention import BlockMask

    docs = (tokens == BOS).cumsum(0)

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx])

    def ordered(dense):  # block counts and indices, nearest (highest) kv block first
        counts = dense.sum(dim=-1, dtype=torch.int32)
        indices = dense.argsort(dim=-1, descending=False, stable=True).flip(-1).to(torch.int32)
        return counts[None, None].contiguous(), indices[None, None].contiguous()

    n = len(tokens) // BLOCK
    block = torch.arange(n, dtype=torch.int32, device=tokens.device)
    low, high = docs.view(-1, BLOCK)[:, 0].contiguous(), docs.view(-1, BLOCK)[:, -1].contiguous()
    any_ = (block[:, None] >= block) & (low[:, None] <= high) & (high[:, None] >= low)
    all_ = (block[:, None] > block) & (low[:, None] == high) & (high[:, None] == low)
    partial_counts, partial_indices = ordered(any_ & ~all_)
    full_counts, full_indices = ordered(all_)

    def with_window(w):
        w = torch.tensor(w, dtype=torch.int32, device=tokens.device)
        return BlockMask.from_kv_blocks(
            torch.clamp_max(partial_counts, torch.clamp_min(w - full_counts, 1)), partial_indices,
            torch.clamp_max(full_counts, w - 1), full_indices, BLOCK_SIZE=BLOCK, mask_mod=document_causal)

    return with_window(window_blocks), with_window(window_blocks // 2)


def bench_attention(rows, repeats):
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    tokens = read_tokens(SAMPLE, T).cuda()
    q, k, v = (torch.randn(1, H, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dy = torch.randn(1, H, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for window in (1, 2, 4, 7, 10, 14):
        mask, _ = block_masks(tokens, window)
        fwd = median_ms(lambda: flex(q, k, v, block_mask=mask, scale=0.12), repeats)
        both = median_ms(lambda: flex(q, k, v, block_mask=mask, scale=0.12).backward(dy), repeats)
        rows.append((f"flash attention fwd, window {window:2d} blocks", f"FlexAttention fwd, window {window}", fwd))
        rows.append((f"flash attention bwd, window {window:2d} blocks", f"FlexAttention bwd, window {window}", both - fwd))
    fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.12), repeats)
    rows.append((None, "sdpa causal fwd (dense, no documents)", fwd))


def bench_matmuls(rows, repeats):
    for name, n_in, n_out in (("qkv", D, QKV), ("attn proj", D, D), ("mlp fc", D, FF), ("mlp proj", FF, D),
                              ("lm_head (bf16)", D, V)):
        x = torch.randn(T, n_in, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(T, n_out, device="cuda", dtype=torch.bfloat16)
        ours = f"matmul {name} fwd {T}x{n_in}->{n_out}"
        rows.append((ours, f"torch.mm {name} fwd", median_ms(lambda: x @ w.T, repeats)))
        rows.append((f"matmul {name} dx", f"torch.mm {name} dx", median_ms(lambda: dy @ w, repeats)))
        rows.append((f"matmul {name} dW (fp32 out)", f"torch.mm {name} dW (bf16 out)",
                     median_ms(lambda: dy.T @ x, repeats)))


def bench_fp8_head(rows, repeats):
    """SPEC 1.5's FP8 head over the T rows in chunks of CHUNK rows, as bench_kernels times it (one
    chunk's gradient, reused). The product rows time _scaled_mm and the transposes the reference
    makes for it; the last row is the reference's custom op (casts, transposes, products) and the
    compiled loss with its gradient per chunk, the weight cast once, and the chunks' weight
    gradients summed (ours accumulate in the product)."""
    x_s, w_s, grad_s = D ** 0.5 / 448, 24 / 448, 1 / 448
    # The scales as device tensors once: a host-to-device copy per call would be timed too.
    sx, sw, sg = (torch.tensor(s, device="cuda", dtype=torch.float32) for s in (x_s, w_s, grad_s))
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(V, D, device="cuda", dtype=torch.float32) * 0.02
    g = torch.randn(CHUNK, V, device="cuda", dtype=torch.bfloat16) * 1e-3
    x_f8 = (x / x_s).to(torch.float8_e4m3fn)
    w_f8 = (w / w_s).to(torch.float8_e4m3fn)
    g_f8 = (g / grad_s).to(torch.float8_e5m2)
    targets = torch.randint(0, V, (CHUNK,), device="cuda")
    chunks = range(0, T, CHUNK)

    def forward():
        for r in chunks:
            torch._scaled_mm(x_f8[r:r + CHUNK], w_f8.T, out_dtype=torch.bfloat16, scale_a=sx,
                             scale_b=sw, use_fast_accum=True)

    def grad_input():
        w_f8_t = w_f8.T.contiguous().T
        for _ in chunks:
            torch._scaled_mm(g_f8, w_f8_t, out_dtype=torch.bfloat16, scale_a=sg, scale_b=sw,
                             use_fast_accum=False)

    def grad_weight():
        for r in chunks:
            torch._scaled_mm(x_f8[r:r + CHUNK].T.contiguous(), g_f8.T.contiguous().T, out_dtype=torch.float32,
                             scale_a=sx, scale_b=sg, use_fast_accum=False)

    dw = torch.zeros(V, D, device="cuda", dtype=torch.float32)

    def reference_op():
        w8 = w.div(w_s).to(torch.float8_e4m3fn)
        w8_t = w8.T.contiguous().T
        for r in chunks:
            x8 = x[r:r + CHUNK].div(x_s).to(torch.float8_e4m3fn)
            logits = torch._scaled_mm(x8, w8.T, out_dtype=torch.bfloat16, scale_a=sx, scale_b=sw,
                                      use_fast_accum=True).requires_grad_()
            softcapped_loss(logits, targets).backward()
            g8 = logits.grad.div(grad_s).to(torch.float8_e5m2)
            torch._scaled_mm(g8, w8_t, out_dtype=torch.bfloat16, scale_a=sg, scale_b=sw,
                             use_fast_accum=False)
            dw.add_(torch._scaled_mm(x8.T.contiguous(), g8.T.contiguous().T, out_dtype=torch.float32,
                                     scale_a=sx, scale_b=sg, use_fast_accum=False).T)

    rows.append(("fp8 head fwd", "_scaled_mm fp8 head fwd", median_ms(forward, repeats)))
    rows.append(("fp8 head dx", "_scaled_mm fp8 head dx (+ w transpose)", median_ms(grad_input, repeats)))
    rows.append(("fp8 head dW (fp32 out)", "_scaled_mm fp8 head dW (+ transposes)", median_ms(grad_weight, repeats)))
    rows.append(("fp8 head + loss fwd+bwd (6 chunks, w once)", "reference mm op + loss fwd+bwd, 6 chunks",
                 median_ms(reference_op, repeats)))


def bench_muon(rows, repeats):
    """The reference's Newton-Schulz (SPEC 1.9) batched over a shape group, as one W = 1 rank runs
    it: momentum, five quintic steps in bf16, the apply."""
    a, b, c = 3.4445, -4.7750, 2.0315
    for ours, count, r, k in (("muon group: 12 c_fc [3072, 768]", 12, FF, D), ("muon group: 33 qkv [768, 768]", 33, D, D)):
        p = torch.randn(count, r, k, device="cuda")
        g = torch.randn(count, r, k, device="cuda")
        buf = torch.zeros_like(g)

        def update():
            buf.lerp_(g, 0.05)
            x = g.lerp(buf, 0.95).bfloat16()
            if r > k:
                x = x.mT
            x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
            for _ in range(5):
                A = x @ x.mT
                B = b * A + c * A @ A
                x = a * x + B @ x
            if r > k:
                x = x.mT
            p.add_(x, alpha=-0.05)

        rows.append((ours, f"torch NS5 batched {count} x [{r}, {k}]", median_ms(update, repeats)))


def bench_compiled_pointwise(rows, repeats):
    # The MLP's fc with ReLU² as the record compiles it (Inductor: cuBLAS, then a fused pointwise
    # kernel), beside ours fused into the product's epilogue (--mlp-fc fused), and the backward's
    # counterpart: the proj's dx product with ReLU²'s backward from the forward's a.
    h = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w_fc = torch.randn(FF, D, device="cuda", dtype=torch.bfloat16) * 0.02
    fc = torch.compile(lambda t: F.relu(t @ w_fc.T).square())
    rows.append(("mlp fc + relu^2: our gemm, fused epilogue", "compiled relu(h @ w_fc.T).square()",
                 median_ms(lambda: fc(h), repeats)))
    dy, w_proj, a = torch.randn(T, D, device="cuda", dtype=torch.bfloat16), w_fc.T.contiguous(), fc(h)
    proj_dx = torch.compile(lambda g: (g @ w_proj) * 2 * a.sqrt())
    rows.append(("mlp proj dx + relu^2 bwd: our gemm, fused epilogue", "compiled (dy @ w_proj) * 2 sqrt(a)",
                 median_ms(lambda: proj_dx(dy), repeats)))
    # The attention's qkv product with QK norm, half-truncated RoPE and the value mix as the record
    # compiles them, beside ours in the product's epilogue (--qkv fused).
    w_qkv = torch.randn(3 * D, D, device="cuda", dtype=torch.bfloat16) * 0.02
    ve = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    freq = torch.cat([(1 / 1024) ** torch.linspace(0, 1, 32, device="cuda"), torch.zeros(32, device="cuda")])
    theta = torch.arange(T, device="cuda", dtype=torch.float32)[:, None] * freq[None, :]
    cos, sin = theta.cos()[:, None, :].bfloat16(), theta.sin()[:, None, :].bfloat16()

    def qkv_passes(t):
        q, k, v = (t @ w_qkv.T).view(T, 3, D // 128, 128).unbind(1)

        def rotate(x):
            x = F.rms_norm(x, (128,))
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat((x1 * cos + x2 * sin, -x1 * sin + x2 * cos), -1).type_as(x)
        return rotate(q), rotate(k), 0.75 * v - 0.375 * ve.view_as(v)
    qkv_compiled = torch.compile(qkv_passes)
    rows.append(("qkv + qk norm + rope + v mix: our gemm, fused", "compiled qkv, rms_norm, rotary, v mix",
                 median_ms(lambda: qkv_compiled(h), repeats)))
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16) * 2
    norm = torch.compile(lambda t: F.rms_norm(t, (D,)))
    rows.append(("rmsnorm fwd [49152, 768]", "compiled F.rms_norm fwd", median_ms(lambda: norm(x), repeats)))
    logits = torch.randn(T, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, V, (T,), device="cuda")
    rows.append(("cross-entropy fwd+bwd [49152, 50304]", "compiled softcap cross-entropy fwd+bwd",
                 median_ms(lambda: softcapped_loss(logits, targets).backward(), repeats)))


def our_times(path):
    """Row name -> ms from bench_kernels' markdown table."""
    times = {}
    if path:
        for line in open(path):
            m = re.match(r"\|\s*(.+?)\s*\|\s*([0-9.]+)\s*\|", line)
            if m:
                times[m.group(1)] = float(m.group(2))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ours", help="bench_kernels output to compare with")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    print(f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}, median of {args.repeats} runs\n")
    rows = []
    for bench in (bench_matmuls, bench_fp8_head, bench_muon, bench_compiled_pointwise, bench_attention):
        try:
            bench(rows, args.repeats)
        except Exception as e:  # one missing feature must not hide the other rows
            rows.append((None, f"{bench.__name__} failed: {type(e).__name__}: {e}"[:90], float("nan")))
    ours = our_times(args.ours)
    print("| PyTorch op | torch ms | ours ms | ours / torch |\n|---|---|---|---|")
    for our_name, torch_name, ms in rows:
        mine = ours.get(our_name)
        ratio = f"{mine / ms:.2f}" if mine and ms == ms and ms > 0 else ""
        print(f"| {torch_name} | {ms:.3f} | {mine if mine is not None else ''} | {ratio} |")


if __name__ == "__main__":
    main()
