# Data stages: the demo dataset (when the config points at it) and the data profiler.


rule make_demo_data:
    output:
        manifest=f"{DEMO_DIR}/demo.json",
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.manifest),
        n_samples=config["data"]["demo"]["n_samples"],
        seed=config["data"]["demo"]["seed"],
    log:
        "logs/make_demo_data.log",
    conda:
        ENV_FILE
    shell:
        "dflop make-demo-data --out-dir {params.out_dir} --n-samples {params.n_samples}"
        " --seed {params.seed} > {log} 2>&1"


PROFILE_DATA_SETTINGS = RuleSettings(
    run={"seed": config["run"]["seed"]},
    model={k: config["model"][k] for k in ("arch", "vision", "tokenizer", config["model"]["arch"])},
    data={"datasets": datasets_setting(weights=False), "max_skip_frac": config["data"]["max_skip_frac"]},
)


rule profile_data:
    input:
        dataset_files,
    output:
        shapes=f"{RESULTS}/data/shapes.parquet",
        histograms=f"{RESULTS}/data/histograms.parquet",
    params:
        settings=PROFILE_DATA_SETTINGS,
        settings_digest=PROFILE_DATA_SETTINGS.digest,
    threads: config["data"]["workers"] or 64
    log:
        "logs/profile_data.log",
    conda:
        ENV_FILE
    shell:
        "dflop profile-data --settings {params.settings:q} --shapes {output.shapes}"
        " --histograms {output.histograms} --workers {threads} > {log} 2>&1"


PROFILE_LOADING_SETTINGS = RuleSettings(
    run={"seed": config["run"]["seed"]},
    model={k: config["model"][k] for k in ("arch", "vision", "llm", "weights", "tokenizer", config["model"]["arch"])},
    data={"datasets": datasets_setting(weights=False),
          **{k: config["data"][k] for k in ("load_profile_samples", "load_profile_seconds")}},
    profile={"co_runners": profile_co_runners()},  # the node's ranks load at once, as in training
)


rule profile_loading:
    input:
        shapes=rules.profile_data.output.shapes,
    threads: profile_co_runners()
    output:
        loading=f"{RESULTS}/profile/load_profile.parquet",
    params:
        settings=PROFILE_LOADING_SETTINGS,
        settings_digest=PROFILE_LOADING_SETTINGS.digest,
    log:
        "logs/profile_loading.log",
    conda:
        ENV_FILE
    shell:
        "dflop profile-loading --settings {params.settings:q} --shapes {input.shapes} --out {output.loading}"
        " > {log} 2>&1"
