"""The pipeline transport (`dflop.runtime.p2p`) on two gloo ranks, and the trainer's messages.

References: the tensors each rank sent (values, shapes), and the calls to
``torch.distributed.batch_isend_irecv`` (recorded): one point of the schedule is one batch; a
message whose shape the plan fixes needs no header, one whose shape it does not takes a header
batch and a data batch; the model profiler's ``p2p`` rows time one message the same way. For the
trainer: its op order, the messages the partition calls for (the schedule's contract) and the
tensors actually sent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dflop.plan import plan_from_dict
from dflop.profiling._timing import Timer
from dflop.profiling.step_costs import link_rows, link_sizes
from dflop.runtime.p2p import BACKWARD, FORWARD, P2P, Message
from dflop.runtime.topology import LLM, VISION, Topology
from test_checkpoint_helpers import spawn
from test_pipeline_equivalence import case, plan
from trainer_reference import config_dict
from gloo_ranks import run_ranks


def _recording(monkeypatch) -> list[list[tuple[str, int, tuple[int, ...]]]]:
    """Every batch_isend_irecv call from now on, as [(op, peer, shape)]."""
    calls = []
    original = dist.batch_isend_irecv

    def record(ops):
        calls.append([(op.op.__name__, op.peer, tuple(op.tensor.shape)) for op in ops])
        return original(ops)

    monkeypatch.setattr(dist, "batch_isend_irecv", record)
    return calls


def _values(rank: int, shape, salt: int = 0) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1000 * rank + salt


def _transport_worker(rank: int) -> None:
    peer = 1 - rank
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = _recording(monkeypatch)
        p2p = P2P(torch.device("cpu"), torch.float32)
        gate = []
        p2p.before_first_message = lambda: gate.append(rank)

        # Both ranks send before they receive (1F1B's steady state): one batch each, known shapes.
        out = {0: (4, 3), 1: (2, 5)}
        mine, theirs = out[rank], out[peer]
        got = p2p.exchange([(Message(peer, 2, FORWARD if rank == 0 else BACKWARD, mine), _values(rank, mine))],
                           [Message(peer, 2, BACKWARD if rank == 0 else FORWARD, theirs)])
        assert torch.equal(got[0], _values(peer, theirs))
        assert calls == [sorted([("isend", peer, mine), ("irecv", peer, theirs)], key=lambda c: c[0] != "isend")]
        assert gate == [rank] and p2p.before_first_message is None

        # Empty messages cost nothing on either end.
        calls.clear()
        got = p2p.exchange([(Message(peer, 3, FORWARD, (0, 7)), torch.empty(0, 7))], [Message(peer, 3, FORWARD, (0, 7))])
        assert calls == [] and got[0].shape == (0, 7)

        # Unknown shapes: a header, read on the host, then the data (an empty one is its header only).
        calls.clear()
        if rank == 0:
            p2p.exchange([(Message(1, 4, FORWARD, None), _values(0, (3, 2, 2), 1)),
                          (Message(1, 5, FORWARD, None), torch.empty(0, 4))], [])
            assert calls == [[("isend", 1, (8,)), ("isend", 1, (3, 2, 2)), ("isend", 1, (8,))]]
        else:
            got = p2p.exchange([], [Message(0, 4, FORWARD, None), Message(0, 5, FORWARD, None)])
            assert torch.equal(got[0], _values(0, (3, 2, 2), 1)) and got[1].shape == (0, 4)
            assert calls == [[("irecv", 0, (8,)), ("irecv", 0, (8,))], [("irecv", 0, (3, 2, 2))]]

        # A tensor that is not the shape the plan gives is refused before anything is sent.
        calls.clear()
        with pytest.raises(RuntimeError, match=r"has shape \(2, 2\), but the plan says \(2, 3\)"):
            p2p.exchange([(Message(peer, 6, FORWARD, (2, 3)), torch.zeros(2, 2))], [])
        assert calls == []
        p2p.wait_sends()
        assert p2p.bytes_sent == 4 * (torch.Size(mine).numel() + (12 if rank == 0 else 0))


@pytest.mark.distributed
def test_exchange_batches_each_point_and_sends_headers_only_for_unknown_shapes(tmp_path):
    spawn(_transport_worker, 2, tmp_path)


# --------------------------------------------------------------------------------------------------
# The model profiler's p2p link rows time a message as the transport sends one of known shape
# --------------------------------------------------------------------------------------------------

def _sweep(rank: int) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = _recording(monkeypatch)
        monkeypatch.setattr(dist, "send", None)  # no unbatched message either
        monkeypatch.setattr(dist, "recv", None)
        rows = link_rows(torch.device("cpu"), Timer(torch.device("cpu")), {}, repeats=1)
    sizes = link_sizes(torch.device("cpu"))
    assert sorted(r["bytes"] for r in rows if r["module"] == "p2p") == sizes
    peer = 1 - rank
    first, second = ("isend", "irecv") if rank == 0 else ("irecv", "isend")
    # per size: one untimed and one timed round trip, each two batches of one float32 message
    assert calls == [[(kind, peer, (n // 4,))] for n in sizes for _ in range(2) for kind in (first, second)]


@pytest.mark.distributed
def test_p2p_rows_time_one_batched_message_without_a_header(tmp_path):
    spawn(_sweep, 2, tmp_path)


# --------------------------------------------------------------------------------------------------
# The trainer's messages (p2p_worker.py: one global batch through the real trainer, recorded)
# --------------------------------------------------------------------------------------------------

WORKER = Path(__file__).with_name("p2p_worker.py")
ONE, TWO, LLM_PP2 = (1, 1, 1, [2]), (1, 1, 2, [2]), (1, 2, 1, [1, 1])
CASES = {
    # LLM hidden states between stages, of padded rows; InternViT hidden states (with CLS) between
    # vision stages and InternVL features into the LLM
    3: [case("llava-llm-pp2-padded", "llava_ov", plan(ONE, LLM_PP2, m=4), policy="baseline", pad=True),
        case("internvl-vision-pp2", "internvl", plan(LLM_PP2, ONE, m=4), shuffle_seed=3)],
    # LLaVA-OV features from each vision replica to each LLM replica; sequence-parallel shards
    4: [case("vision-dp2-llm-dp2", "llava_ov", plan(TWO, TWO, m=2)),
        case("colocated-tp2-llm-pp2-sp", "llava_ov", plan((2, 1, 1, [2]), (2, 2, 1, [1, 1]), "colocated", m=2,
                                                          sequence_parallel=True), shuffle_seed=6)],
}


def _run(world: int, tmp_path: Path, pools: dict, manifest) -> list[tuple[dict, Path]]:
    cases = [{**c, "out": str(tmp_path / c["name"]), "config": config_dict(c["arch"], manifest, **c["config"]),
              "shapes": pools[c["arch"]]} for c in CASES[world]]
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps({"manifest": str(manifest), "cases": cases}))
    run_ranks(WORKER, spec, nproc=world, timeout=600)
    return [(c, Path(c["out"])) for c in cases]


def _expected_messages(layout, world: int, bins, shares) -> set[tuple[int, int, int, int]]:
    """(src, dst, position, direction) of every message the step's partition calls for, from the
    contract of `dflop.runtime.schedule` and `Topology`'s peers (every part trainable): between stages
    of one module, per replica and TP rank, when the replica has work; the last vision stage's
    features of replica v to LLM replica r when r's bin holds samples of v's share (LLM tp rank u
    from vision tp rank u % tp_v), their gradient back (vision tp rank t from LLM tp rank t % tp_l)."""
    rank_of = Topology(layout, 0, world).rank_of
    vision, llm = layout.vision, layout.llm
    out = set()

    def chain(module, lay, replica, p):
        for stage in range(lay.pp - 1):
            for t in range(lay.tp):
                a, b = rank_of(module, stage, replica, t), rank_of(module, stage + 1, replica, t)
                out.update({(a, b, p, FORWARD), (b, a, p, BACKWARD)})

    for p, (bins_p, shares_p) in enumerate(zip(bins, shares)):
        for r, bin_ in enumerate(bins_p):
            if bin_:
                chain(LLM, llm, r, p)
        if layout.colocated:
            continue
        for v, share in enumerate(shares_p):
            if share:
                chain(VISION, vision, v, p)
            for r, bin_ in enumerate(bins_p):
                if set(share) & set(bin_):
                    last = vision.pp - 1
                    out.update((rank_of(VISION, last, v, u % vision.tp), rank_of(LLM, 0, r, u), p, FORWARD)
                               for u in range(llm.tp))
                    out.update((rank_of(LLM, 0, r, t % llm.tp), rank_of(VISION, last, v, t), p, BACKWARD)
                               for t in range(vision.tp))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted(CASES))
def test_trainer_batches_each_schedule_point_and_receivers_know_every_shape(world, tmp_path, pools, runtime_demo):
    """(a) A rank calls batch_isend_irecv at most once between two of its ops, with the sends of
    the op before and the receives of the op after: sends and receives of one point in one batch.
    (b) Every message the partition calls for went through those batches, and nothing else.
    (c) No message has a header, and every receive buffer has the shape of the tensor sent.
    (d) Between each (sender, receiver) pair the receiver posts its receives in the order the sender
    issues the sends: NCCL ignores tags and matches a pair's messages in issue order (gloo matches
    by tag and would hide a different order)."""
    for c, out in _run(world, tmp_path, pools, runtime_demo):
        result = json.loads((out / "result.json").read_text())
        layout = plan_from_dict(c["plan"], c["name"]).plan
        sent, posted = {}, {}
        sent_order: dict[tuple, list] = {}
        posted_order: dict[tuple, list] = {}
        for rank in range(world):
            events = json.loads((out / f"p2p_rank{rank}.json").read_text())
            ops = [(kind, p) for tag, kind, p in (e for e in events if e[0] == "op")]
            points: list[list] = [[]]
            for event in events:
                if event[0] == "op":
                    points.append([])
                else:
                    points[-1].append(event[1])
            for k, batches in enumerate(points):
                assert len(batches) <= 1, (c["name"], rank, k, batches)
                for name, peer, tag, shape in (batches[0] if batches else []):
                    position, direction, part = tag // 4, tag // 2 % 2, tag % 2
                    assert part == 1, (c["name"], rank, "a header was sent")
                    op = ops[k - 1] if name == "isend" else ops[k]  # the op before / after the point
                    assert op == ("F" if direction == FORWARD else "B", position), (c["name"], rank, k, name, tag)
                    key = (rank, peer, position, direction) if name == "isend" else (peer, rank, position, direction)
                    (sent if name == "isend" else posted)[key] = tuple(shape)
                    order = sent_order if name == "isend" else posted_order
                    order.setdefault(key[:2], []).append(key[2:])
        assert set(sent) == _expected_messages(layout, world, result["bins"], result["vision_shares"]), c["name"]
        assert posted == sent, c["name"]
        assert posted_order == sent_order, c["name"]
