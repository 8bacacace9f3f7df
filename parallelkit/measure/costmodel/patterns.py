"""How each family of strategies communicates: :data:`PATTERNS`, :func:`register_pattern`."""

from __future__ import annotations

from .links import Cluster, Round, allreduce_seconds, alltoall_rounds, gradient_groups_seconds, groups, rings_seconds
from .sequence import SEQUENCE_PATTERNS, Planned, plan
from .workload import KINDS, Options, Pattern, Workload


def _tensor(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    k = options.model
    gradients = gradient_groups_seconds(cluster, workload.param_bytes, k)
    if k == 1:
        return gradients, 0.0
    if not workload.activation_allreduces:
        raise ValueError(
            "Tensor parallelism all-reduces activations: give Workload(activation_allreduces=...), "
            "bytes per sample of each (for the kit's MLP, megatron_mlp_allreduces(1, widths) x item size)."
        )
    along, _ = groups(cluster.devices, k)
    replica_batch = k * workload.batch_per_device
    activations = sum(rings_seconds(cluster, along, replica_batch * b) for b in workload.activation_allreduces)
    return gradients, activations


def expert_rounds(workload: Workload, cluster: Cluster, expert: int) -> list[Round]:
    """Every round of the all-to-alls of one expert-parallel step: each of ``workload.all_to_alls`` within
    every group of ``expert`` neighbouring devices at once, each device's batch its own tokens.

    >>> work = Workload(0, 1e-3, 2, all_to_alls=(100.0,) * 4)  # one MoE layer: 4 all-to-alls of 200 B a device
    >>> from parallelkit.measure.costmodel import Link
    >>> rounds = expert_rounds(work, Cluster(1, 4, Link("test", 1, 0, "by hand")), expert=2)
    >>> len(rounds), sum(b for r in rounds for source, _, b in r if source == 0)  # device 0 sends 4 x 100 B
    (4, 400.0)
    """
    along, _ = groups(cluster.devices, expert)
    return [r for each in workload.all_to_alls for r in alltoall_rounds(along, each * workload.batch_per_device)]


def _expert(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    k, n = options.model, cluster.devices
    dense = rings_seconds(cluster, [list(range(n))], workload.param_bytes - workload.expert_bytes)
    _, across = groups(n, k)
    gradients = dense + rings_seconds(cluster, across, workload.expert_bytes / k)
    if k == 1:
        return gradients, 0.0
    if not workload.all_to_alls:
        raise ValueError(
            "Expert parallelism sends tokens to their experts by all-to-all: give Workload(all_to_alls=...), bytes "
            "per sample of each (4 per MoE layer: pk.experts.dispatch_bytes over the samples of a group)."
        )
    return gradients, sum(cluster.round_seconds(r) for r in expert_rounds(workload, cluster, k))


def _pipeline(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    k = options.model
    gradients = gradient_groups_seconds(cluster, workload.param_bytes, k)
    if k == 1:
        return gradients, 0.0
    if not workload.boundary_bytes:
        raise ValueError("A pipeline sends activations between stages: give Workload(boundary_bytes=...) per sample.")
    along, _ = groups(cluster.devices, k)
    sent = workload.boundary_bytes * k * workload.batch_per_device / options.microbatches  # one device, one slot
    one_slot = max(cluster.round_seconds([(g[s], g[s + 1], sent) for g in along]) for s in range(k - 1))
    return gradients, 2 * (options.microbatches + k - 1) * one_slot


def _single(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    return 0.0, 0.0


def _mirrored(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    return allreduce_seconds(cluster, workload.param_bytes, options.allreduce), 0.0


def _fully_sharded(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    return 1.5 * allreduce_seconds(cluster, workload.param_bytes, "ring"), 0.0


def _central_storage(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    """A pull of ``P`` to every device, then a push of ``P`` from every device, all at once through the one host."""
    if cluster.machines > 1:
        raise ValueError("central_storage keeps the parameters in one machine's memory: use machines=1.")
    p = workload.param_bytes
    return 2 * cluster.host_seconds(p, cluster.devices * p), 0.0


def _parameter_server(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    """A pull and a push of ``P`` per worker, ``P/k`` from and to each of the ``k`` shards, machines of their own that
    serve at once. Over machines, the network: a worker machine's link carries its devices' ``P`` each, a server's its
    share for every device. In one machine, the host's links: each device's own carries its ``P``, each shard's host
    side its share for every device."""
    p, server = workload.param_bytes, cluster.devices * workload.param_bytes / options.shards
    if cluster.machines == 1:
        return 2 * cluster.host_seconds(p, server), 0.0
    return 2 * cluster.network.seconds(max(server, cluster.devices_per_machine * p)), 0.0


PATTERNS: dict[str, Pattern] = {  # by name; register_pattern adds more
    "single": Pattern(_single),
    "mirrored": Pattern(_mirrored),
    "fully_sharded": Pattern(_fully_sharded),
    "central_storage": Pattern(_central_storage),
    "parameter_server": Pattern(_parameter_server),
    "tensor": Pattern(_tensor, model="all"),
    "hybrid": Pattern(_tensor, model="given"),
    "pipeline": Pattern(_pipeline, model="stages"),
    "expert": Pattern(_expert, model="any"),
    **SEQUENCE_PATTERNS,
}


def register_pattern(name: str, pattern: Pattern) -> Pattern:
    """Let :func:`predict` take ``name``: a strategy family whose step communicates as ``pattern`` says.

    Raises:
      ValueError: a pattern of that name exists.
    """
    if name in PATTERNS:
        raise ValueError(f"The cost model already has a pattern {name!r}.")
    if pattern.model not in KINDS:
        raise ValueError(f"Pattern(model={pattern.model!r}): choose one of {KINDS}.")
    PATTERNS[name] = pattern
    return pattern


STRATEGY_PATTERNS: dict[str, str] = {}  # a strategy's name (the catalog's) -> the name of its pattern


def name_strategy(strategy: str, pattern: str | None) -> None:
    """Let :func:`predict` take ``strategy`` (a catalog name) for ``pattern``; None forgets the name.

    Raises:
      ValueError: ``pattern`` is not a registered pattern.
    """
    if pattern is None:
        STRATEGY_PATTERNS.pop(strategy, None)
        return
    if pattern not in PATTERNS:
        raise ValueError(f"{strategy!r} names the cost pattern {pattern!r}, which is not one of {list(PATTERNS)}.")
    STRATEGY_PATTERNS[strategy] = pattern


def pattern_of(strategy: str) -> Pattern:
    """The pattern ``strategy`` names: a pattern's own name, or a named strategy's (its catalog entry's ``pattern``)."""
    return PATTERNS[pattern_name(strategy)]


def pattern_name(strategy: str) -> str:
    """The name of the pattern ``strategy`` names: a pattern's own name, or a catalog name's ``pattern``.

    >>> pattern_name("Mirrored(jit)"), pattern_name("mirrored")
    ('mirrored', 'mirrored')

    Raises:
      ValueError: neither a pattern nor a named strategy.
    """
    if strategy in PATTERNS:
        return strategy
    if strategy in STRATEGY_PATTERNS:
        return STRATEGY_PATTERNS[strategy]
    raise ValueError(f"Unknown strategy {strategy!r}: choose one of {list(PATTERNS)} or {list(STRATEGY_PATTERNS)}.")


def model_size(cluster: Cluster, strategy: str, model: int | None) -> int:
    """Devices per model-parallel group (stages for a pipeline), checked; 1 for data-parallel strategies."""
    n, kind = cluster.devices, pattern_of(strategy).model
    if kind == "none":
        if model not in (None, 1):
            parallel = [name for name, p in PATTERNS.items() if p.model != "none"]
            raise ValueError(f"{strategy} does not split the model; model={model} is for {parallel}.")
        return 1
    k = n if model is None else model
    if kind == "given" and model is None:
        raise ValueError(
            f"{strategy} needs model=k: the devices per group that splits the model or the sequence "
            "(the model axis for tensor parallelism, seq for context parallelism)."
        )
    if kind == "all" and k != n:
        raise ValueError(f"{strategy} splits every weight over all {n} devices; use hybrid for model={k} groups.")
    if not (isinstance(k, int) and k >= 1 and n % k == 0):
        raise ValueError(f"model={k!r} must be a whole number >= 1 that divides the {n} devices.")
    return k


def sequence_collectives(workload: Workload, strategy: str, n: int) -> list[Planned]:
    """What one device's step sends to split the sequence over ``n`` devices by ``strategy``, a pattern
    that splits it or a catalog name for one (:func:`.sequence.plan`).

    Raises:
      ValueError: a strategy that does not split the sequence, or a workload without
        ``sequence_bytes`` and ``layers``.
    """
    return plan(workload, pattern_name(strategy), n)
