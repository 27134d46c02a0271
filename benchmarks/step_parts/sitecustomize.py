"""Step parts, measured inside the trainer's torchrun workers (a diagnostic, not part of dflop).

Put this directory on PYTHONPATH and set STEP_PARTS_OUT to a directory: every Python process then
imports this file at start-up, and the training ranks record, per forward / backward op of the LLM
stages (colocated: with the vision tower), the op's wall time, each module's time inside it (forward
hooks; wall and thread CPU time) and the bin's shapes, plus every sample's load time
(`StepSource.in_step_loads`), to STEP_PARTS_OUT/rank<r>.jsonl and loads<r>.jsonl. `analyse.py` compares
them with the cost model. Run in a demo clone (benchmarks/README.md, "Step parts"):

    PYTHONPATH=$REPO/benchmarks/step_parts STEP_PARTS_OUT=/tmp/parts dflop train ... --out-dir /tmp/run --fresh
    python benchmarks/step_parts/analyse.py /tmp/parts /tmp/run results/costmodel/costmodel.json results/data/shapes.parquet
"""
import json, os, time
out = os.environ.get("STEP_PARTS_OUT")
if out:
    from dflop.runtime import schedule as S
    _init, _fwd, _bwd, _run = S.PipelineExecutor.__init__, S.PipelineExecutor._llm_forward, S.PipelineExecutor._llm_backward, S.PipelineExecutor.run
    CTX = {"acc": None}
    STEP = {"n": 0}

    def hook(mod, kind):
        def pre(m, args, kwargs=None):
            m._t0 = time.perf_counter(); m._c0 = time.thread_time()
        def post(m, args, output, kwargs=None):
            if CTX["acc"] is not None:
                CTX["acc"][kind] = CTX["acc"].get(kind, 0.0) + time.perf_counter() - m._t0
                CTX["acc"]["cpu_" + kind] = CTX["acc"].get("cpu_" + kind, 0.0) + time.thread_time() - m._c0
        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)

    def init(self, *a, **k):
        _init(self, *a, **k)
        v, l = self.modules.vision, self.modules.llm
        if v is not None:
            if v.embeddings is not None: hook(v.embeddings, "vision_embed")
            for layer in v.layers: hook(layer, "vision_layer")
            if v.image_features is not None: hook(v.image_features, "projector_img")
        if l is not None:
            if l.embedding is not None: hook(l.embedding, "llm_embed")
            for layer in l.layers: hook(layer, "llm_layer")
            if l.head is not None: hook(l.head, "llm_head")
        self._diag = open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a")

    def record(self, op, k, p, fn, received):  # k: the rank's model chunk (0 unless interleaved)
        plan = self._plan
        bin_ = plan.bins[p][self.topo.llm_role.replica]
        share = plan.vision_shares[p][self.topo.llm_role.replica] if self.topo.plan.colocated else []
        CTX["acc"] = {}
        t0 = time.perf_counter(); c0 = time.thread_time()
        sends = fn(self, k, p, received)
        wall = time.perf_counter() - t0
        CTX["acc"]["cpu_wall"] = time.thread_time() - c0
        acc, CTX["acc"] = CTX["acc"], None
        self._diag.write(json.dumps(dict(step=STEP["n"], op=op, p=p, wall=wall, seq_len=[int(plan.seq_len[i]) for i in bin_],
                                         tiles=[int(plan.n_tiles[i]) for i in share], mods=acc)) + "\n")
        self._diag.flush()
        return sends

    def run(self, *a, **k):
        STEP["n"] += 1
        return _run(self, *a, **k)

    S.PipelineExecutor.__init__ = init
    S.PipelineExecutor.run = run
    S.PipelineExecutor._llm_forward = lambda self, k, p, received: record(self, "F", k, p, _fwd, received)
    S.PipelineExecutor._llm_backward = lambda self, k, p, received: record(self, "B", k, p, _bwd, received)
if out:
    import atexit, glob as _g
    def _threads():
        rows = []
        for t in _g.glob("/proc/self/task/*"):
            try:
                comm = open(t + "/comm").read().strip(); st = open(t + "/stat").read().rsplit(")", 1)[1].split()
                rows.append((comm, (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")))
            except OSError:
                pass
        with open(os.path.join(out, f"threads{os.environ.get('RANK', 'x')}_{os.getpid()}.txt"), "w") as f:
            for comm, s in sorted(rows, key=lambda r: -r[1]):
                f.write(f"{comm} {s:.2f}\n")
    atexit.register(_threads)
if out:
    from dflop.runtime import step_source as T
    _isl = T.StepSource.in_step_loads
    def isl(self, plan, loaded):
        with open(os.path.join(out, f"loads{self.trainer.rank}.jsonl"), "a") as f:
            f.write(json.dumps(dict(step=int(plan.step), rows={int(r): float(s.load_s) for r, s in loaded.items()})) + "\n")
        return _isl(self, plan, loaded)
    T.StepSource.in_step_loads = isl
