#!/usr/bin/env python3
"""tools/profile_summary.py on files in the layout tools/kernel_profile.cpp writes."""
import contextlib
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import profile_summary  # noqa: E402

FLASH = "void flash_attention_backward_kernel<128, true>(const __nv_bfloat16*, int, float)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_ws_persistent"
CUTLASS = ("void cutlass::device_kernel<cutlass3x_sm90_tensorop_gemm_bf16_128x128x64_1x2x1_0_tnn_align8, "
           "int>(cutlass3x_sm90_tensorop_gemm_bf16_128x128x64_1x2x1_0_tnn_align8::Params)")


class ProfileSummaryTest(unittest.TestCase):
    def write(self, text):
        d = tempfile.mkdtemp()
        self.addCleanup(lambda: (os.remove(os.path.join(d, "p.csv")), os.rmdir(d)))
        path = os.path.join(d, "p.csv")
        with open(path, "w") as f:
            f.write(text)
        return path

    def run_main(self, *args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = profile_summary.main(list(args))
        return status, out.getvalue(), err.getvalue()

    def test_a_range_its_kernels_and_their_share(self):
        # A 10 ms range: flash twice (2 + 3 ms), a GEMM of 4 ms overlapping the second flash by 1 ms
        # on another stream, a memset; one kernel outside the range (before it) is not counted.
        path = self.write("range,0,1000000,11000000\n"
                          f"kernel,0,900000,7,{FLASH}\n"
                          f"kernel,1000000,3000000,7,{FLASH}\n"
                          f"kernel,3000000,6000000,7,{FLASH}\n"
                          f"kernel,5000000,9000000,13,{GEMM}\n"
                          "memset,9000000,9500000,7,1024 bytes\n")
        status, out, _ = self.run_main(path)
        self.assertEqual(status, 0, out)
        # sum 2 + 3 + 4 + 0.5 = 9.5 ms; busy: [1, 9.5] without the 1 ms overlap = 8.5 ms
        self.assertIn("| 0 | 10.00 | 9.50 | 8.50 | 0.950 | 4 |", out)
        self.assertIn("| `flash_attention_backward_kernel` | 2 | 5.000 | 2500.0 | 50.0% |", out)
        self.assertIn(f"| `{GEMM[:97]}...` | 1 | 4.000 | 4000.0 | 40.0% |", out)
        self.assertIn("| `[memset 1024 bytes]` | 1 | 0.500 | 500.0 | 5.0% |", out)
        self.assertLess(out.index("flash_attention_backward_kernel"), out.index("sm90_xmma"))  # largest first

    def test_two_ranges_are_averaged(self):
        path = self.write("range,0,0,1000\nrange,1,2000,3000\n"
                          f"kernel,0,500,7,{FLASH}\nkernel,2000,2300,7,{FLASH}\n")
        status, out, _ = self.run_main(path)
        self.assertEqual(status, 0)
        self.assertIn("| `flash_attention_backward_kernel` | 1 | 0.000 | 0.4 | 40.0% |", out)

    def test_names(self):
        self.assertEqual(profile_summary.short_name("kernel", CUTLASS),
                         "cutlass3x_sm90_tensorop_gemm_bf16_128x128x64_1x2x1_0_tnn_align8")
        self.assertEqual(profile_summary.short_name("kernel", "triton_per_fused_add_mean_0"), "triton_per_fused_add_mean_0")
        self.assertEqual(profile_summary.short_name("kernel", "void add_into_kernel(const __nv_bfloat16*, int)"),
                         "add_into_kernel")
        self.assertEqual(profile_summary.short_name("kernel", FLASH, full=True), FLASH)
        ours = ("void gemm_epilogue::gemm_kernel<(gemm_epilogue::BLayout)0, gemm_epilogue::ReluSquared>(CUtensorMap_st, "
                "CUtensorMap_st, gemm_epilogue::ReluSquared, __nv_bfloat16*, int, int, int)")
        self.assertEqual(profile_summary.short_name("kernel", ours), "gemm_epilogue::gemm_kernel<ReluSquared>")
        self.assertEqual(profile_summary.short_name("kernel", ours.replace("gemm_epilogue::ReluSquared", "QkvEpilogue")),
                         "gemm_epilogue::gemm_kernel<QkvEpilogue>")
        self.assertEqual(profile_summary.short_name("memcpy", "4096 bytes, kind 1"), "[memcpy 4096 bytes]")

    def test_files_that_are_no_measurement_are_refused(self):
        for text, message in (
                (f"kernel,0,5,7,{FLASH}\n", "no profiled range: the program never called cudaProfilerStart"),
                ("range,0,100,0\n", "a range was never closed"),
                ("range,0,0,100\ndropped,12\n", "CUPTI dropped 12 records"),
                ("range,0,0,100\nkernel,oops\n", "p.csv:2: not a kernel_profile line")):
            with self.subTest(message=message):
                status, _, err = self.run_main(self.write(text))
                self.assertEqual(status, 1)
                self.assertIn(message, err)

    def test_ncu_counters_per_kernel_name(self):
        # ncu --csv --page raw: its own messages unquoted, a header and a units row, a row per launch;
        # the metrics NCU_METRICS names are kept (time in microseconds), the others left out
        path = self.write(
            "==PROF== Connected to process 1\n"
            '"ID","Kernel Name","gpu__time_duration.sum","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",'
            '"sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","launch__grid_size"\n'
            '"","","ns","%","%",""\n'
            f'"0","{FLASH}","1,000,500","60","2","2304"\n'
            f'"1","{FLASH}","999,500","70","4","2304"\n'
            '"2","void softcap_cross_entropy_kernel<Store>(const __nv_bfloat16*)","500,000","0","80","8192"\n')
        status, out, err = self.run_main("--ncu", path)
        self.assertEqual(status, 0, err)
        self.assertIn("| kernel | launches | time us | tensor pipe active % | XU (MUFU) pipe % |\n", out)
        self.assertIn("| `flash_attention_backward_kernel` | 2 | 1000 | 65 | 3 |", out)
        self.assertIn("| `softcap_cross_entropy_kernel` | 1 | 500 | 0 | 80 |", out)
        self.assertNotIn("grid", out)
        status, _, err = self.run_main("--ncu", self.write("==ERROR== the profiler could not read counters\n"))
        self.assertEqual(status, 1)
        self.assertIn("not ncu's raw CSV", err)

if __name__ == "__main__":
    unittest.main()
