"""Large freed CPU blocks are reused instead of mapped afresh (dflop.cpu_memory), counted by the
kernel's minor page faults in a fresh process."""

import subprocess
import sys

import pytest

CHILD = """
import ctypes, resource, sys
if sys.argv[1] == "reuse":
    from dflop.cpu_memory import reuse_large_cpu_allocations
    assert reuse_large_cpu_allocations()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 20  # above glibc's largest default mmap threshold (32 MB)
for _ in range(2):  # the first round grows the heap; the second is what a training step sees
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(block)
print(faults)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_a_freed_large_block_is_reused_without_page_faults():
    pages = (64 << 20) // 4096
    assert _faults("default") > pages // 2  # glibc maps fresh pages for every large block
    assert _faults("reuse") < pages // 20   # the heap's pages come back, already mapped
