"""Launch training with the plan's world size: ``python -m dflop.runtime.launch --plan ... [args]``.

Outside torchrun this builds the torchrun command from plan.yaml (one process per plan rank;
single node: ``--standalone``; several nodes: c10d rendezvous, one agent per node, as
``srun ... python -m dflop.runtime.launch --nodes N --rdzv-endpoint HOST:PORT``) and runs it with
the same arguments; inside torchrun (``RANK`` is set) each worker calls `dflop.runtime.run.train`.

    python -m dflop.runtime.launch --config config/config.yaml --plan results/plan/plan.yaml \\
        --shapes results/data/shapes.parquet --costmodel results/costmodel/costmodel.json \\
        --out-dir results/train
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from dflop.errors import UserError
from dflop.plan import read_plan


def torchrun_command(plan_path: str | Path, worker_args: Sequence[str], *, nodes: int = 1,
                     rdzv_endpoint: str | None = None, rdzv_id: str = "dflop-train",
                     python: str = sys.executable) -> list[str]:
    """The torchrun command that starts the plan's world size of workers running `worker_args`.

    nodes > 1: ``world_size / nodes`` processes per node and a c10d rendezvous at `rdzv_endpoint`
    (the first node's host:port); run the same command once per node (e.g. under srun).
    """
    plan = read_plan(plan_path).plan
    if nodes < 1 or plan.world_size % nodes:
        raise UserError(f"{plan.source}: world_size {plan.world_size} does not split over {nodes} node(s)")
    command = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(plan.world_size // nodes)]
    if nodes == 1:
        command.append("--standalone")
    else:
        if not rdzv_endpoint:
            raise UserError("multi-node training needs --rdzv-endpoint HOST:PORT (the first node)")
        command += ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                    "--rdzv-id", rdzv_id]
    return command + ["-m", "dflop.runtime.launch", *worker_args]


def slurm_job_nodes(env: dict | None = None) -> list[str]:
    """Host names of the current Slurm job, [] outside one.

    Always asked from squeue (and expanded with scontrol): Snakemake's Slurm executor strips
    SLURM_JOB_NODELIST, and inside its `srun -n1` step SLURM_NODELIST names only the step's node.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return []
    nodelist = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                              check=True).stdout.strip()
    if not nodelist:
        raise UserError(f"Slurm job {job_id}: squeue reports no nodes")
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           check=True).stdout.split()
    return hosts


def slurm_command(plan_path: str | Path, worker_args: Sequence[str], hosts: Sequence[str], *,
                  port: int = 29500, job_id: str = "dflop", cpus_per_task: int | None = None) -> list[str]:
    """srun one torchrun agent per node of the job, meeting at a c10d rendezvous on the first node.

    cpus_per_task: the job's CPUs per node (its SLURM_CPUS_PER_TASK), passed on explicitly because
    the step's own SLURM_* variables are dropped (`srun_environment`); without it each agent,
    with all its ranks and loader workers, would get Slurm's default of one CPU.
    """
    nodes = len(hosts)
    inner = torchrun_command(plan_path, worker_args, nodes=nodes, rdzv_endpoint=f"{hosts[0]}:{port}",
                             rdzv_id=f"dflop-{job_id}")
    cpus = [f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else []
    # --overlap: the step running this command already holds CPUs of the first node.
    return ["srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", *cpus,
            "--kill-on-bad-exit=1", *inner]


def srun_environment(env: dict | None = None) -> dict:
    """The environment for srun inside a job step: without the step's SLURM_*/SRUN_* variables
    (they pin srun to the step's one node), keeping SLURM_JOB_ID so srun joins the job and
    SLURM_CONF for sites whose slurm.conf is not at the default path."""
    env = dict(os.environ if env is None else env)
    return {k: v for k, v in env.items()
            if not k.startswith(("SLURM_", "SRUN_", "SBATCH_")) or k in ("SLURM_JOB_ID", "SLURM_CONF")}


TRAINABLE_SCHEDULES = ("1f1b", "interleaved", "zb-h1")  # LLM pipeline schedules the executor runs (`runtime.schedule`)


def check_trainable_schedule(plan) -> None:
    """One-line UserError unless the trainer runs the plan's LLM schedule (plan.yaml `llm.schedule`),
    a schedule the simulator knows (`dflop.sim.schedules.SCHEDULES`) but the executor does not."""
    lay = plan.layout
    if lay.schedule not in TRAINABLE_SCHEDULES:
        raise UserError(f"{plan.source}: llm.schedule is {lay.schedule} (chunks {lay.chunks}), which the trainer "
                        f"does not run yet (it runs {', '.join(TRAINABLE_SCHEDULES)}): re-plan with "
                        f"planner.schedules: [{', '.join(TRAINABLE_SCHEDULES)}]")


def check_before_launch(cfg, plan_path: str | Path) -> None:
    """One-line UserError, before any process starts, unless the plan can train the config's model
    on its cluster: a schedule the trainer runs (`check_trainable_schedule`), layer splits, TP degrees,
    world size, a launchable rank layout (`Plan.check`: what `dflop simulate` and the workers check
    too) and the global batch."""
    from dflop.models.handle import ModelHandle
    from dflop.pricing.cluster import Cluster

    plan_file = read_plan(plan_path)
    check_trainable_schedule(plan_file.plan)
    plan_file.plan.check(ModelHandle.resolve(cfg.model).split_limits, Cluster.from_section(cfg.cluster))
    plan_file.check_batch(cfg.train.global_batch_size)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflop train",
        description="Train with the plan: starts torchrun with the plan's world size (one process per rank; on "
                    "Slurm one torchrun agent per node, through srun) and runs the same arguments in every worker.")
    parser.add_argument("--config", type=Path, help="YAML config (default: the demo default)")
    parser.add_argument("--settings", help="JSON object laid over --config")
    parser.add_argument("--plan", type=Path, required=True, help="plan.yaml")
    parser.add_argument("--shapes", type=Path, required=True, help="shapes.parquet")
    parser.add_argument("--costmodel", type=Path, help="costmodel.json (default: the analytic stand-in)")
    parser.add_argument("--out-dir", type=Path, required=True, help="metrics.parquet, checkpoints/, final/")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--policy", choices=["dflop", "baseline"], help="override scheduler.policy")
    parser.add_argument("--pad", action="store_true", default=None,
                        help="baseline variant: pad samples to the longest of their bin (scheduler.pad_to_longest)")
    parser.add_argument("--baseline", action="store_true",
                        help="train plan.yaml's data-blind baseline (its baseline section's layout) with the "
                             "data-blind scheduler (implies --policy baseline); the same seed gives the same batches")
    parser.add_argument("--no-export", action="store_true", help="skip writing the Hugging Face directory final/")
    parser.add_argument("--fresh", action="store_true",
                        help="start afresh even if out-dir/checkpoints holds this run's checkpoint (the old "
                             "checkpoints are moved to out-dir/previous_runs/, not deleted)")
    parser.add_argument("--take-turns", metavar="DIR/NAME",
                        help="take each step in turn with the other jobs of DIR (dflop.runtime.turns; "
                             "`dflop head-to-head` starts such jobs)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="nodes (default: those of the enclosing Slurm job, else 1)")
    parser.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (multi-node without Slurm)")
    return parser


def _worker_args(args: argparse.Namespace) -> list[str]:
    out = []
    for flag in ("config", "settings", "plan", "shapes", "costmodel", "out_dir", "steps", "policy", "take_turns"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    out += ["--pad"] if args.pad else []
    out += ["--no-export"] if args.no_export else []
    out += ["--fresh"] if args.fresh else []
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if "RANK" not in os.environ:
            # Check inputs here, once, so a typo is one line instead of a traceback per rank.
            for flag in ("config", "plan", "shapes", "costmodel"):
                path = getattr(args, flag)
                if path is not None and not Path(path).exists():
                    raise UserError(f"--{flag}: file not found: {path}")
            if args.baseline:  # the workers train the baseline section, written as a plan of its own
                args.plan, args.policy = write_baseline_plan(args.plan, args.out_dir, padded=bool(args.pad)), "baseline"
            from dflop.config import load

            check_before_launch(load(args.config, args.settings), args.plan)
            hosts = slurm_job_nodes() if args.nodes is None and args.rdzv_endpoint is None else []
            if len(hosts) > 1:
                cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
                command = slurm_command(args.plan, _worker_args(args), hosts,
                                        job_id=os.environ.get("SLURM_JOB_ID", "dflop"),
                                        cpus_per_task=int(cpus) if cpus.isdigit() else None)
            else:
                command = torchrun_command(args.plan, _worker_args(args), nodes=args.nodes or 1,
                                           rdzv_endpoint=args.rdzv_endpoint)
            print("launching: " + " ".join(command), file=sys.stderr, flush=True)
            env = srun_environment() if command[0] == "srun" else None
            error_file = worker_error_file(args.out_dir)
            error_file.unlink(missing_ok=True)
            code = subprocess.run(command, env=env).returncode
            if code and error_file.exists():  # a worker's one-line error, last, after torchrun's report
                print(f"dflop train: {error_file.read_text().strip()}", file=sys.stderr)
                return 2
            return code
        from dflop.config import load
        from dflop.runtime.run import train

        train(load(args.config, args.settings), plan_path=args.plan, shapes_path=args.shapes,
              costmodel_path=args.costmodel, out_dir=args.out_dir, steps=args.steps, policy=args.policy,
              pad_to_longest=args.pad, export=not args.no_export, fresh=args.fresh, take_turns=args.take_turns)
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker, done: leave as `end_worker` explains
            from dflop.runtime.process_group import end_worker

            end_worker(0)
    except UserError as exc:
        print(f"dflop train: {exc}", file=sys.stderr)
        if "RANK" in os.environ:
            _record_worker_error(args.out_dir, str(exc))
        return 2
    return 0


def write_baseline_plan(plan_path: str | Path, out_dir: str | Path, *, padded: bool = False) -> Path:
    """`out_dir`/baseline_plan.yaml: plan.yaml's data-blind baseline (with `padded`, its padded
    baseline) as a plan of its own."""
    from dflop.io import read_yaml
    from dflop.plan import baseline_plan_doc, write_plan

    path = Path(out_dir) / "baseline_plan.yaml"
    doc = read_yaml(plan_path, missing_hint="run `dflop optimize` first")
    write_plan(baseline_plan_doc(doc, str(plan_path), padded=padded), path)
    return path


def worker_error_file(out_dir: str | Path) -> Path:
    """Where a worker leaves its one-line error for the launcher to print last."""
    return Path(out_dir) / ".train_error"


def _record_worker_error(out_dir: str | Path, message: str) -> None:
    from dflop.io import write_text_atomic

    path = worker_error_file(out_dir)
    if not path.exists():  # ranks fail alike (dflop.runtime.skipping, agreement): one line is enough
        try:
            write_text_atomic(path, message.splitlines()[0] + "\n")
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
