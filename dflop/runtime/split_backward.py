"""A stage's backward split in two, as ZB-H1 runs it: B (the gradient of the stage's inputs, which
the previous stage waits for) now, W (the weight gradients) later.

Neither half recomputes the other. B runs the autograd engine from the stage's outputs to its
inputs only (``torch.autograd.grad``, graph retained) and, through pre-hooks, keeps the gradient
arriving at each node where a weight's branch leaves the input's path ("meeting" nodes: a linear's
``AddmmBackward``, a norm's ``MulBackward``, the embedding's splice). W restarts the engine at those
nodes with the kept gradients (``torch.autograd.backward`` on their `GradientEdge`s, restricted to
the weights), so it runs only the weight branches: ``dW = X^T dY`` and the like. This is what
``torch.distributed.pipelining._backward`` (`stage_backward_input` / `stage_backward_weight`) does;
its W, though, adds ``autograd.grad``'s results into ``.grad`` by hand, so a parameter's
post-accumulate-grad hooks (the gradient sync's overlap, sequence parallelism's norm all-reduce)
would never fire. Here W goes through the engine's own accumulation, and only public autograd API
(`torch.autograd.graph`) is used.

Weights are grouped by the meeting nodes they share (one engine call per group): a group's W
starts only at its own nodes, so it never walks the input path between two groups. Within a group
whose W passes from one of its meeting nodes to another, each node's incoming gradient is pinned
to the one B saw (a pre-hook), so nothing is counted twice.

Without an input that needs a gradient (the first stage) B has nothing to compute and W is the
whole backward, as torch's schedules do it. Under non-reentrant activation checkpointing each
engine call unpacks the layer's saved tensors anew (the checkpoint recomputes per graph task), so
W would recompute a checkpointed layer's forward once per weight group (measured on a 4-layer
qwen2.5-small stage: B + W 3.7x the whole backward); ``one_pass`` makes W one engine call, pinned at
every meeting node, which recomputes each layer once but re-walks the input path (1.67x; docs/training.md).
"""

from __future__ import annotations

from collections import defaultdict, deque

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _node(t: torch.Tensor) -> Node:
    """The autograd node a gradient for `t` enters: its grad_fn, or a leaf's accumulator."""
    return get_gradient_edge(t).node


class WeightGradient:
    """The deferred W of one microbatch on one stage: `run()` once."""

    def __init__(self, groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor],
                                          list[tuple[Node, tuple]]]],
                 whole: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None] | None = None):
        self._groups, self._whole = groups, whole

    def run(self) -> None:
        if self._whole is not None:
            outs, grads, leaves = self._whole
            torch.autograd.backward(outs, grads, inputs=leaves, retain_graph=leaves is not None)
        for edges, grads, leaves, pinned in self._groups:
            handles = [node.register_prehook(lambda _, g=grads_in: g) for node, grads_in in pinned]
            try:
                # retained: a group's walk between its meeting nodes may run nodes another group starts at
                torch.autograd.backward(edges, grads, inputs=leaves, retain_graph=True)
            finally:
                for h in handles:
                    h.remove()
        self._groups, self._whole = [], None


def backward_input(outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor | None],
                   inputs: list[torch.Tensor], *, one_pass: bool = False
                   ) -> tuple[list[torch.Tensor | None], WeightGradient]:
    """B of a stage: the gradients of `inputs` (None where one needs none) and the stage's W.

    outputs / grad_outputs: the stage's outputs and their gradients (None for a scalar loss).
    The weights are every other leaf the outputs' graph reaches (what ``backward()`` would fill).
    one_pass: W as one engine call over all weights, every meeting node pinned: it re-walks the
    input path between them, but a checkpointed layer then recomputes its forward once in W, not
    once per weight group (for stages under full recomputation: module docstring)."""
    kept = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad]
    outs = [o for o, _ in kept]
    grads = [torch.ones_like(o) if g is None else g for o, g in kept]
    wanted = [t for t in inputs if t.requires_grad]
    if not outs or not wanted:
        return [None] * len(inputs), WeightGradient([], (outs, grads, None) if outs else None)

    # parents[n]: the nodes whose backward feeds n (edges reversed), over the outputs' whole graph
    parents: dict[Node, list[Node]] = defaultdict(list)
    roots = list(dict.fromkeys(_node(o) for o in outs))
    seen, queue = set(roots), deque(roots)
    leaves: dict[Node, torch.Tensor] = {}
    while queue:
        node = queue.popleft()
        if hasattr(node, "variable"):
            leaves[node] = node.variable
        for child, _ in node.next_functions:
            if child is not None:
                parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
    input_nodes = {_node(t) for t in wanted}
    on_input_path = _closure(input_nodes & seen, parents, stop=set())
    # each weight's meeting nodes: where the walk up from its accumulator reaches the input's path
    meets: dict[Node, set[Node]] = {}
    for acc in leaves:
        if acc not in input_nodes:
            meets[acc] = _closure({acc}, parents, stop=on_input_path) & on_input_path
    groups = _union_groups({acc: nodes for acc, nodes in meets.items() if nodes})
    if one_pass and len(groups) > 1:
        groups = [([a for accs, _ in groups for a in accs], [n for _, nodes in groups for n in nodes])]
    # a weight whose branch never meets the input's path (an output independent of the inputs):
    # its W walks from the outputs (those nodes are on no other weight's way)
    apart = [leaves[acc] for acc, nodes in meets.items() if not nodes]

    captured: dict[Node, tuple] = {}
    hooks = [n.register_prehook(lambda g, n=n: captured.__setitem__(n, g))
             for n in {n for ms in meets.values() for n in ms}]
    try:
        dinputs = iter(torch.autograd.grad(outs, wanted, grads, retain_graph=True, allow_unused=True))
    finally:
        for h in hooks:
            h.remove()
    weight_groups = []
    for accs, nodes in groups:
        edges, values = [], []
        for n in nodes:
            for i, g in enumerate(captured.get(n, ())):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    values.append(g)
        if edges:
            pinned = [(n, captured[n]) for n in nodes if n in captured] if len(nodes) > 1 else []
            weight_groups.append((edges, values, [leaves[a] for a in accs], pinned))
    whole = (outs, grads, apart) if apart else None
    return [next(dinputs) if t.requires_grad else None for t in inputs], WeightGradient(weight_groups, whole)


def _closure(start: set[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> set[Node]:
    """`start` and every node reachable from it through `parents`, not walking past `stop` nodes."""
    out, queue = set(start), deque(start)
    while queue:
        for p in parents.get(queue.popleft(), ()):
            if p not in out:
                out.add(p)
                if p not in stop:
                    queue.append(p)
    return out


def _union_groups(meets: dict[Node, set[Node]]) -> list[tuple[list[Node], list[Node]]]:
    """Weights (accumulator nodes) grouped so that no two groups share a meeting node:
    [(accumulators, meeting nodes)]."""
    owner: dict[Node, int] = {}
    groups: list[tuple[list[Node], set[Node]] | None] = []
    for acc, nodes in meets.items():
        merged = {owner[n] for n in nodes if n in owner}
        accs, members = [acc], set(nodes)
        for g in merged:
            accs += groups[g][0]
            members |= groups[g][1]
            groups[g] = None
        groups.append((accs, members))
        for n in members:
            owner[n] = len(groups) - 1
    return [(accs, list(nodes)) for accs, nodes in (g for g in groups if g is not None)]
