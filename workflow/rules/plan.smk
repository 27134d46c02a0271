# The data-aware 3D parallelism optimizer.


# The datasets reach the planner only when they carry weights (data.datasets[].weight: its sampled
# batches are drawn by the mix); without, a run's settings and re-runs stay as they were.
MIXED_DATASETS = {"data": {"datasets": datasets_setting(weights=True)}} if any(
    d.get("weight") is not None for d in config["data"]["datasets"]) else {}

OPTIMIZE_SETTINGS = RuleSettings(
    run={"seed": config["run"]["seed"]},
    model={k: config["model"][k] for k in ("arch", "vision", "llm", "weights")},
    cluster=config["cluster"],
    planner=config["planner"],
    train={"global_batch_size": config["train"]["global_batch_size"]},
    **MIXED_DATASETS,
)


rule optimize:
    input:
        shapes=rules.profile_data.output.shapes,
        costmodel=rules.fit.output.costmodel,
    output:
        plan=f"{RESULTS}/plan/plan.yaml",
        candidates=f"{RESULTS}/plan/candidates.parquet",
    params:
        settings=OPTIMIZE_SETTINGS,
        settings_digest=OPTIMIZE_SETTINGS.digest,
    log:
        "logs/optimize.log",
    conda:
        ENV_FILE
    shell:
        "dflop optimize --settings {params.settings:q} --shapes {input.shapes} --costmodel {input.costmodel}"
        " --plan {output.plan} --candidates {output.candidates} > {log} 2>&1"
