# Model stages: the model profiler and the cost models fitted on its measurements.


PROFILE_MODEL_SETTINGS = RuleSettings(
    run={"seed": config["run"]["seed"]},
    model={k: config["model"][k] for k in ("arch", "vision", "llm", "weights", "dtype")},
    profile={**config["profile"], "co_runners": profile_co_runners()},  # resolved: a cluster change re-runs
)                                                                       # the profile only if it changes them


rule profile_model:
    output:
        profile=f"{RESULTS}/profile/model_profile.parquet",
    params:
        settings=PROFILE_MODEL_SETTINGS,
        settings_digest=PROFILE_MODEL_SETTINGS.digest,
    threads: max(max(config["profile"]["tp_degrees"]), profile_co_runners())
    resources:
        # one GPU per rank of the largest profiling world (TP degree or co-runners, torchrun on one node); none on CPU
        gres=f"gpu:{max(max(config['profile']['tp_degrees']), profile_co_runners())}"
        if config["profile"]["device"] == "cuda"
        else "",
    log:
        "logs/profile_model.log",
    conda:
        ENV_FILE
    shell:
        "dflop profile-model --settings {params.settings:q} --out {output.profile} > {log} 2>&1"


rule fit:
    input:
        profile=rules.profile_model.output.profile,
        loading=rules.profile_loading.output.loading,
    output:
        costmodel=f"{RESULTS}/costmodel/costmodel.json",
        validation=f"{RESULTS}/costmodel/validation.parquet",
    log:
        "logs/fit.log",
    conda:
        ENV_FILE
    shell:
        "dflop fit --profile {input.profile} --loading {input.loading} --costmodel {output.costmodel}"
        " --validation {output.validation} > {log} 2>&1"
