#!/usr/bin/env python3
"""tools/step_budget.py: the record's window, the attention pairs of a hand-counted case, each kernel
assigned to its op, the floors from the ceilings, and the whole table from a profile and a shard."""
import contextlib
import io
import os
import struct
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import step_budget  # noqa: E402


class StepBudgetTest(unittest.TestCase):
    def test_the_records_window(self):
        self.assertEqual(step_budget.window_blocks(0, 6), 1)   # at least one block
        self.assertEqual(step_budget.window_blocks(4, 6), 9)   # 1728 * 4/6 = 1152 tokens
        self.assertEqual(step_budget.window_blocks(5, 6), 12)  # 1440 -> 1536
        self.assertEqual(step_budget.window_blocks(860, 860), 14)

    def test_attention_pairs_counted_by_hand(self):
        # 2 blocks, an end-of-text token at 200 (the first token of the second document), window 2:
        # long layers (0, 4, 11) see both blocks, the 8 short ones only their own block.
        tokens = [1] * 256
        tokens[200] = 50256
        long = sum(t + 1 for t in range(200)) + sum(t - 199 for t in range(200, 256))  # 20100 + 1596
        short = sum(t + 1 for t in range(128)) + sum(t - 127 for t in range(128, 200)) + 1596
        self.assertEqual(step_budget.attention_pairs(tokens, 2), 3 * long + 8 * short)
        self.assertEqual(3 * long + 8 * short, 164928)

    def test_kernels_go_to_their_ops_and_floors_follow_the_ceilings(self):
        records = [("kernel", 0, 100, 7, "nvjet_sm90_tst_192x192_64x3_1x2_h_bx_coopB_NTN"),
                   ("kernel", 100, 150, 7, "nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN"),
                   ("kernel", 150, 160, 7, "void flash::backward_dq_kernel<true>(const __nv_bfloat16*)"),
                   ("kernel", 160, 170, 7, "attention_delta_kernel(const __nv_bfloat16*)"),
                   ("kernel", 170, 180, 7, "void weighted_sum_backward_kernel(const __nv_bfloat16*)"),
                   ("kernel", 180, 185, 7, "add_scalar_gradients_kernel(const float*, int, float*, float*)"),
                   ("kernel", 186, 190, 7, "mix_norm_backward_kernel(const __nv_bfloat16*)"),
                   ("memset", 185, 186, 7, "4 bytes"),
                   ("kernel", 500, 600, 7, "void add_into_kernel(const __nv_bfloat16*)")]  # after the range
        ceilings = {"copy": 4.0, "bf16": 800.0, "fp8": 1600.0}
        rows, wall = step_budget.budget([(0, 200)], records, 1e8, 5000, 8, ceilings)
        by_op = {op.split(":")[0].split(" (")[0]: (calls, ns, floor) for op, calls, ns, floor in rows}
        self.assertEqual(wall, 200)
        self.assertEqual(by_op["bf16 matmuls"][:2], (1, 100))
        self.assertEqual(by_op["FP8 head products"][:2], (1, 50))
        self.assertEqual(by_op["attention backward"][:2], (2, 20))
        self.assertEqual(by_op["value mixes backward"][:2], (2, 15))
        self.assertEqual(by_op["a block's input backward"][:2], (1, 4))
        # 8 x (6 layers with the skip x 20 + 6 without x 16 + 5 reading the gradient through a skip x 2)
        # bytes x T x d at 4 TB/s
        self.assertAlmostEqual(by_op["a block's input backward"][2], 8 * (6 * 20 + 6 * 16 + 5 * 2) * 49152 * 768 / 4e12 * 1e9)
        self.assertEqual(by_op["add_into"][:2], (0, 0))
        self.assertEqual(by_op["other"][:2], (1, 1))
        # attention backward: 8 micro-sequences x 2.5 x 4 x 128 x 6 x 1e8 pairs at 800 TFLOP/s
        self.assertAlmostEqual(by_op["attention backward"][2], 8 * 2.5 * 4 * 128 * 6 * 1e8 / 800e12 * 1e9)
        # add_into runs only under --residual-add separate: no floor counted
        self.assertEqual(by_op["add_into"][2], 0)

    def test_the_table_from_a_profile_and_a_shard(self):
        with tempfile.TemporaryDirectory() as d:
            shard = os.path.join(d, "train.bin")
            with open(shard, "wb") as f:  # 2 steps of 8 micro-sequences, a document every 1000 tokens
                tokens = 2 * 8 * 49152 + 1
                f.write(struct.pack("<256i", 20240520, 1, tokens, *[0] * 253))
                f.write(struct.pack(f"<{tokens}H", *[50256 if t % 1000 == 0 else t % 7 + 1 for t in range(tokens)]))
            profile = os.path.join(d, "p.csv")
            with open(profile, "w") as f:
                f.write("range,0,0,1000000\nkernel,0,900000,7,void flash::forward_kernel(const __nv_bfloat16*)\n")
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                status = step_budget.main([profile, "--tokens", shard, "--step", "2", "--num-iterations", "6",
                                           "--copy-tbs", "4", "--bf16-tflops", "800", "--fp8-tflops", "1600"])
        self.assertEqual(status, 0)
        text = out.getvalue()
        self.assertIn("Step 2 of 6 at M = 8 (window 3 blocks, short 1;", text)
        self.assertIn("8 distinct tokens a micro-sequence", text)  # 1..7 and the end of text
        self.assertIn("| attention forward | 1 | 0.90 | 0.11 |", text)
        self.assertIn("| **the step's wall time** (sum / wall 0.900) | | 1.00 | 0.12 | | |", text)


if __name__ == "__main__":
    unittest.main()
