"""The multi-process tests' launcher (`gloo_ranks.run_ranks`): ranks get torchrun's environment, a
failed or hung rank fails the test with every rank's own output, and no rank is left running."""

from __future__ import annotations

import os
import textwrap

import pytest

from gloo_ranks import run_ranks


def _worker(tmp_path, body: str):
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_ranks_get_torchruns_environment_and_each_ranks_output(tmp_path):
    worker = _worker(tmp_path, """
        import os, sys
        import torch.distributed as dist
        dist.init_process_group("gloo")  # env:// as under torchrun
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, sys.argv[1] + os.environ["LOCAL_RANK"])
        print(f"rank {dist.get_rank()} of {os.environ['WORLD_SIZE']} saw {names}")
        dist.destroy_process_group()
    """)
    result = run_ranks(worker, "r", nproc=3, timeout=120)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [f"rank {r} of 3 saw ['r0', 'r1', 'r2']" for r in range(3)]


def test_a_failing_rank_ends_the_others_and_shows_every_ranks_output(tmp_path):
    worker = _worker(tmp_path, """
        import os, time
        rank = int(os.environ["RANK"])
        print(f"rank {rank} started", flush=True)
        if rank == 1:
            raise ValueError("rank 1 broke")
        time.sleep(600)  # a rank waiting on the failed one forever, as in a collective
    """)
    with pytest.raises(AssertionError) as failure:
        run_ranks(worker, nproc=2, timeout=300)
    message = str(failure.value)
    assert "failed (exit 1)" in message and "ValueError: rank 1 broke" in message
    assert "rank 0 started" in message and "rank 1 started" in message


def test_a_hung_run_is_killed_at_the_timeout(tmp_path):
    worker = _worker(tmp_path, """
        import os, time
        open(os.path.join(os.path.dirname(__file__), f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
        time.sleep(600)
    """)
    with pytest.raises(AssertionError, match="did not finish in 2 s"):
        run_ranks(worker, nproc=2, timeout=2)
    for rank in range(2):
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone, not left running


def test_ranks_start_with_the_tokenizer_the_fork_server_built(tmp_path):
    """The fork server's preload (`fork_preload`) holds the Qwen2.5 tokenizer, so a rank does not
    convert its BPE ranks again, and the inherited tokenizer encodes, batched too (its Rust thread
    pool starts in the rank, not in the server)."""
    worker = _worker(tmp_path, """
        from dflop.data.tokenizer import load_tokenizer
        cached = load_tokenizer.cache_info().currsize
        tokenizer = load_tokenizer("qwen2.5")
        texts = ["a <image>", "some text <video>", "1234"]
        batched = tokenizer(texts)["input_ids"] == [tokenizer.encode(t) for t in texts]
        print(cached, batched, tokenizer.encode("a <image>")[-1])
    """)
    result = run_ranks(worker, nproc=2, timeout=120)
    assert result.stdout.splitlines() == ["1 True 151665"] * 2
