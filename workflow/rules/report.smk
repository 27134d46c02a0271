# Report plots for `snakemake --report report.html`: PNG files drawn from the artifacts, one rule
# per artifact group, each output tagged with a caption (workflow/report/*.rst) and a category.
# They run where Snakemake runs (localrules): seconds of matplotlib, not worth a cluster job.
#   snakemake --profile profiles/local report_plots && snakemake --report report.html report_plots

REPORT_DIR = f"{RESULTS}/report"
# The training plots need the train rule; the other plots do not.
HAS_TRAIN = any(r.name == "train" for r in workflow.rules)
# The data-blind baseline's training run, where the workflow has one: its metrics.parquet feeds the
# summary's measured speedup (without it the summary says there is no baseline run).
HAS_TRAIN_BASELINE = any(r.name == "train_baseline" for r in workflow.rules)


localrules:
    plot_summary,
    plot_data,
    plot_costmodel,
    plot_plan,
    plot_candidates,
    report_plots,


rule plot_summary:
    input:
        unpack(summary_inputs),
    output:
        png=report(
            f"{REPORT_DIR}/summary.png",
            caption="../report/summary.rst",
            category="0. Summary",
            labels={"figure": "what was planned, and what it bought"},
        ),
    params:
        runs=summary_arguments,
    log:
        "logs/plot_summary.log",
    conda:
        ENV_FILE
    shell:
        "dflop report summary --plan {input.plan}{params.runs} --out {output.png} > {log} 2>&1"


rule plot_data:
    input:
        histograms=rules.profile_data.output.histograms,
    output:
        png=report(
            f"{REPORT_DIR}/data_shapes.png",
            caption="../report/data_shapes.rst",
            category="1. Data",
            labels={"figure": "sample shapes per dataset and modality"},
        ),
    log:
        "logs/plot_data.log",
    conda:
        ENV_FILE
    shell:
        "dflop report data --histograms {input.histograms} --out {output.png} > {log} 2>&1"


rule plot_costmodel:
    input:
        profile=rules.profile_model.output.profile,
        costmodel=rules.fit.output.costmodel,
        validation=rules.fit.output.validation,
    output:
        png=report(
            f"{REPORT_DIR}/costmodel_fit.png",
            caption="../report/costmodel_fit.rst",
            category="2. Cost model",
            labels={"figure": "prediction vs measurement"},
        ),
    log:
        "logs/plot_costmodel.log",
    conda:
        ENV_FILE
    shell:
        "dflop report costmodel --profile {input.profile} --costmodel {input.costmodel}"
        " --validation {input.validation} --out {output.png} > {log} 2>&1"


rule plot_plan:
    input:
        plan=rules.optimize.output.plan,
        shapes=rules.profile_data.output.shapes,
        costmodel=rules.fit.output.costmodel,
    output:
        comparison=report(
            f"{REPORT_DIR}/plan_vs_baseline.png",
            caption="../report/plan_vs_baseline.rst",
            category="3. Plan",
            labels={"figure": "plan vs data-blind baseline"},
        ),
        gantt_plan=report(
            f"{REPORT_DIR}/gantt_plan.png",
            caption="../report/gantt.rst",
            category="3. Plan",
            labels={"figure": "Gantt chart: DFLOP plan"},
        ),
        gantt_baseline=report(
            f"{REPORT_DIR}/gantt_baseline.png",
            caption="../report/gantt.rst",
            category="3. Plan",
            labels={"figure": "Gantt chart: data-blind baseline"},
        ),
    log:
        "logs/plot_plan.log",
    conda:
        ENV_FILE
    shell:
        "dflop report plan --plan {input.plan} --shapes {input.shapes} --costmodel {input.costmodel}"
        " --out {output.comparison} --gantt-plan {output.gantt_plan} --gantt-baseline {output.gantt_baseline}"
        " > {log} 2>&1"


rule plot_candidates:
    input:
        candidates=rules.optimize.output.candidates,
        plan=rules.optimize.output.plan,
    output:
        png=report(
            f"{REPORT_DIR}/candidates.png",
            caption="../report/candidates.rst",
            category="3. Plan",
            labels={"figure": "every candidate: predicted step vs memory"},
        ),
    log:
        "logs/plot_candidates.log",
    conda:
        ENV_FILE
    shell:
        "dflop report candidates --candidates {input.candidates} --plan {input.plan} --out {output.png} > {log} 2>&1"


if HAS_TRAIN:

    localrules:
        plot_training,
        plot_timeline,

    rule plot_timeline:
        input:
            trace=rules.train.output.trace,
            metrics=rules.train.output.metrics,
            plan=rules.optimize.output.plan,
            shapes=rules.profile_data.output.shapes,
            costmodel=rules.fit.output.costmodel,
        output:
            png=report(
                f"{REPORT_DIR}/timeline.png",
                caption="../report/timeline.rst",
                category="4. Training",
                labels={"figure": "one step: measured vs simulated"},
            ),
        params:
            seed=config["run"]["seed"],
        log:
            "logs/plot_timeline.log",
        conda:
            ENV_FILE
        shell:
            "dflop report timeline --trace {input.trace} --metrics {input.metrics} --plan {input.plan}"
            " --seed {params.seed} --shapes {input.shapes} --costmodel {input.costmodel} --out {output.png}"
            " > {log} 2>&1"

    rule plot_training:
        input:
            metrics=rules.train.output.metrics,
        output:
            png=report(
                f"{REPORT_DIR}/training_curves.png",
                caption="../report/training_curves.rst",
                category="4. Training",
                labels={"figure": "training curves"},
            ),
        log:
            "logs/plot_training.log",
        conda:
            ENV_FILE
        shell:
            "dflop report training --metrics {input.metrics} --out {output.png} > {log} 2>&1"


rule report_plots:
    input:
        rules.plot_summary.output,
        rules.plot_data.output,
        rules.plot_costmodel.output,
        rules.plot_plan.output,
        rules.plot_candidates.output,
        rules.plot_training.output if HAS_TRAIN else [],
        rules.plot_timeline.output if HAS_TRAIN else [],
