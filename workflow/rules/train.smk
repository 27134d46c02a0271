# Training with the plan: torchrun with the plan's world size; on Slurm one torchrun agent per node
# (srun) meeting at a c10d rendezvous. Checkpoints live in results/train/checkpoints, outside the
# declared outputs, so a re-run of a killed job resumes from the last one; a re-run whose settings,
# model, plan or data changed starts afresh and moves the old checkpoints to
# results/train/previous_runs/ (dflop.runtime.run_identity).


COMPARE_WITH_HF = config["train"]["compare_with_hf_trainer"]
TRAIN_SECTIONS = dict(
    run={"seed": config["run"]["seed"]},
    model=config["model"],
    data={"datasets": datasets_setting(weights=True), "max_skip_frac": config["data"]["max_skip_frac"]},
    cluster={k: config["cluster"][k] for k in ("device", "gpu_memory_gb")},
    train={k: v for k, v in config["train"].items() if k != "compare_with_hf_trainer"},  # rule train_baseline's
    scheduler=config["scheduler"],
)
TRAIN_SETTINGS = RuleSettings(**TRAIN_SECTIONS)


rule train:
    input:
        plan=rules.optimize.output.plan,
        shapes=rules.profile_data.output.shapes,
        costmodel=rules.fit.output.costmodel,
    output:
        metrics=f"{RESULTS}/train/metrics.parquet",
        final=directory(f"{RESULTS}/train/final"),
        trace=f"{RESULTS}/train/trace.json",  # train.trace_steps' timeline (dflop.runtime.spans)
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.metrics),
        settings=TRAIN_SETTINGS,
        settings_digest=TRAIN_SETTINGS.digest,
    threads: config["cluster"]["gpus_per_node"]
    resources:
        nodes=train_nodes,
        tasks=train_nodes,
        tasks_per_gpu=0,  # one task per node, not per GPU (the Slurm plugin turns `tasks` into it on GPU jobs)
        slurm_extra=lambda wildcards, input: "--ntasks-per-node=1",
        gres=train_gres,
    log:
        "logs/train.log",
    conda:
        ENV_FILE
    shell:
        "dflop train --settings {params.settings:q} --plan {input.plan} --shapes {input.shapes}"
        " --costmodel {input.costmodel} --out-dir {params.out_dir} > {log} 2>&1"


# The data-blind baseline of plan.yaml (its `baseline` section: uniform split, fixed-count
# microbatches in batch order), trained like the plan on the same global batches (same seed and
# data), so rule summary compares measured steps, not only predicted ones. With
# train.compare_with_hf_trainer (the demo) the baseline trains beside a second run of the plan and
# the Hugging Face Trainer, one step each in turn (dflop head-to-head): the summary's speedups over
# both come from those three runs, measured under the same machine phases.
BASELINE_OUTPUT = {"metrics": f"{RESULTS}/train_baseline/metrics.parquet",
                   "trace": f"{RESULTS}/train_baseline/trace.json"}
HEAD_TO_HEAD = f"{RESULTS}/head_to_head"
if COMPARE_WITH_HF:
    BASELINE_OUTPUT.update(plan_metrics=f"{HEAD_TO_HEAD}/plan/metrics.parquet",
                           hf_metrics=f"{HEAD_TO_HEAD}/hf/metrics.parquet")
    BASELINE_COMMAND = (
        "dflop head-to-head --settings {params.settings:q} --plan {input.plan} --shapes {input.shapes}"
        f" --costmodel {{input.costmodel}} --out-dir {HEAD_TO_HEAD} --baseline-dir {{params.out_dir}} > {{log}} 2>&1")
else:
    BASELINE_COMMAND = (
        "dflop train --baseline --no-export --settings {params.settings:q} --plan {input.plan}"
        " --shapes {input.shapes} --costmodel {input.costmodel} --out-dir {params.out_dir} > {log} 2>&1")
# Without the comparison, the settings of before it existed (a workspace from then does not re-run).
BASELINE_SETTINGS = RuleSettings(**{**TRAIN_SECTIONS, **(
    {"train": {**TRAIN_SECTIONS["train"], "compare_with_hf_trainer": True}} if COMPARE_WITH_HF else {})})


rule train_baseline:
    input:
        plan=rules.optimize.output.plan,
        shapes=rules.profile_data.output.shapes,
        costmodel=rules.fit.output.costmodel,
    output:
        **BASELINE_OUTPUT,
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.metrics),
        settings=BASELINE_SETTINGS,
        settings_digest=BASELINE_SETTINGS.digest,
    threads: config["cluster"]["gpus_per_node"]
    resources:
        nodes=train_nodes,
        tasks=train_nodes,
        tasks_per_gpu=0,
        slurm_extra=lambda wildcards, input: "--ntasks-per-node=1",
        gres=train_gres,
    log:
        "logs/train_baseline.log",
    conda:
        ENV_FILE
    shell:
        BASELINE_COMMAND


localrules:
    summary,


# The last lines of `make demo`: measured and predicted speedup of the plan over the baseline and
# the idle time of each, and with train.compare_with_hf_trainer the speedup over the Hugging Face
# Trainer (dflop.runtime.comparison), printed and kept in summary.yaml / summary.txt.
rule summary:
    input:
        unpack(summary_inputs),
    output:
        summary=f"{RESULTS}/summary.yaml",
        lines=f"{RESULTS}/summary.txt",
    params:
        hf=f" --hf-metrics {BASELINE_OUTPUT['hf_metrics']}" if COMPARE_WITH_HF else "",
    log:
        "logs/summary.log",
    conda:
        ENV_FILE
    shell:
        "dflop compare-runs --metrics {input.metrics} --baseline-metrics {input.baseline_metrics} --plan {input.plan}"
        "{params.hf} --out {output.summary} 2> {log} | tee {output.lines}"
