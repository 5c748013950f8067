"""bench/cuda_branch_coverage.py finds the lines only a CUDA device reaches."""
import importlib.util
import os
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "cuda_branch_coverage", os.path.join(HERE, "..", "..", "bench", "cuda_branch_coverage.py"))
cbc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cbc)


def test_cuda_only_lines(tmp_path):
    src = textwrap.dedent("""\
        def f(self, sync):
            a = 1
            if self.cuda:
                b = 2
            else:
                c = 3
            if not self.cuda:
                d = 4
            else:
                e = 5
            if self.cuda and sync:
                g = 6
            if not self.cuda and sync:
                h = 7
            if torch.cuda.is_available():
                i = 8
            return a

        class CUDAMeter:
            def live(self):
                return 9

        def _collect_cuda_stats(x):
            return x
        """)
    p = tmp_path / "m.py"
    p.write_text(src)
    lines = cbc.cuda_only_lines(str(p))
    text = src.splitlines()
    got = {text[i - 1].strip() for i in lines}
    assert got == {"b = 2", "e = 5", "g = 6", "i = 8", "def live(self):", "return 9", "return x"}, got


def test_the_executor_has_cuda_only_lines():
    root = os.path.join(HERE, "..", "..")
    assert {"vramcut_core/runtime/executor.py", "vramcut_core/figures/meters.py"} <= set(cbc.FILES)
    assert all(f.startswith("vramcut_core/") for f in cbc.FILES)
    assert sum(len(cbc.cuda_only_lines(os.path.join(root, f))) for f in cbc.FILES if "/runtime/" in f
               or f.endswith("executor.py")) > 50
    assert len(cbc.cuda_only_lines(os.path.join(root, "vramcut_core", "figures", "meters.py"))) > 5
