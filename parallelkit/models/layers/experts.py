"""Mixture of experts: a top-k softmax router, expert capacity (:func:`moe_layer`), and expert parallelism by
all-to-all (:func:`expert_parallel`).

>>> params = init_moe_params(jax.random.key(0), dim=4, hidden=8, experts=4)
>>> y, aux = moe_layer(jnp.ones((2, 3, 4)), params, top_k=2)
>>> y.shape, sorted(aux)
((2, 3, 4), ['dropped_fraction', 'kept_per_expert', 'load_balancing_loss', 'router_z_loss', 'tokens_per_expert'])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from fractions import Fraction

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ...core import axes
from ...core.types import EXPERT, MeshAxes, is_count, is_number

_Params = Mapping[str, jax.Array]
# name -> the logical names of its axes; every leaf but the router has the experts on its leading axis
_SHAPES = {
    "router": ("dim", "experts"),
    "w_in": ("experts", "dim", "hidden"),
    "w_out": ("experts", "hidden", "dim"),
    "b_in": ("experts", "hidden"),
    "b_out": ("experts", "dim"),
}
_REQUIRED = ("router", "w_in", "w_out")


def init_moe_params(
    key: jax.Array, dim: int, hidden: int, experts: int, *, bias: bool = True, dtype: jnp.dtype = jnp.float32
) -> dict[str, jax.Array]:
    """Parameters for :func:`moe_layer`: normal weights scaled by ``1/sqrt(fan_in)``, zero biases.

    >>> p = init_moe_params(jax.random.key(0), dim=4, hidden=8, experts=2)
    >>> {name: leaf.shape for name, leaf in p.items()}
    {'router': (4, 2), 'w_in': (2, 4, 8), 'w_out': (2, 8, 4), 'b_in': (2, 8), 'b_out': (2, 4)}

    Args:
      key: a PRNG key.
      dim: the model width (the tokens' last axis).
      hidden: each expert's hidden width.
      experts: how many experts.
      bias: also make ``b_in`` and ``b_out``.
      dtype: the parameters' dtype.
    """
    k_router, k_in, k_out = jax.random.split(key, 3)
    params = {
        "router": jax.random.normal(k_router, (dim, experts), dtype) / math.sqrt(dim),
        "w_in": jax.random.normal(k_in, (experts, dim, hidden), dtype) / math.sqrt(dim),
        "w_out": jax.random.normal(k_out, (experts, hidden, dim), dtype) / math.sqrt(hidden),
    }
    if bias:
        params["b_in"] = jnp.zeros((experts, hidden), dtype)
        params["b_out"] = jnp.zeros((experts, dim), dtype)
    return params


def capacity(tokens_per_group: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """How many token-choices each expert takes from one group: ``ceil(capacity_factor * top_k * tokens / experts)``.

    Computed exactly for the decimal ``capacity_factor`` as written (``1.2`` is 6/5, not
    the float just above it), so a product that is a whole number is not rounded up.

    >>> capacity(8, experts=4, top_k=2, capacity_factor=1.25)
    5
    >>> capacity(5, experts=3, top_k=1, capacity_factor=1.2)
    2
    """
    return math.ceil(Fraction(str(capacity_factor)) * top_k * tokens_per_group / experts)


def dispatch_bytes(
    tokens_per_group: int, dim: int, experts: int, top_k: int, capacity_factor: float, itemsize: int = 4
) -> int:
    """Bytes of one group's dispatched slots, ``(experts, capacity, dim)``: what one all-to-all carries per device.

    Under expert parallelism each device's group is dispatched into every expert's
    :func:`capacity` slots and the whole buffer enters ``jax.lax.all_to_all``; each device
    keeps ``1/n`` of it and sends the rest, ``(n-1)/n``, to the ``n - 1`` others. The
    results come back in a buffer of the same size, and the backward pass sends both again.

    >>> dispatch_bytes(16, dim=8, experts=4, top_k=2, capacity_factor=1.0)  # 4 experts x 8 slots x 8 x 4 B
    1024
    """
    return experts * capacity(tokens_per_group, experts, top_k, capacity_factor) * dim * itemsize


def moe_layer(
    x: jax.Array, params: _Params, *, top_k: int = 2, capacity_factor: float = 1.25, groups: int = 1
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A mixture-of-experts feed-forward layer: each token goes to its ``top_k`` experts, within their capacity.

    Conceptually, for each token ``t`` of shape ``(dim,)``::

        p = softmax(t @ router)                         # one probability per expert
        chosen = the top_k experts by p, highest first  # ties: the lower expert index
        gate[e] = p[e] / sum(p[chosen])                 # over the chosen k: sums to 1
        y = sum(gate[e] * expert_e(t) for e in chosen if t's choice of e is kept)
        expert_e(t) = gelu(t @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e]

    with ``jax.nn.gelu`` (its tanh approximation) and the biases where ``params`` has them.
    The tokens (``x`` flattened to ``(tokens, dim)``) are cut into ``groups`` equal
    consecutive groups. In each group every expert keeps at most
    :func:`capacity` ``(tokens_per_group, experts, top_k, capacity_factor)`` token-choices,
    taken in this order: all first choices in token order, then all second choices in
    token order, and so on (as GShard and Switch do). A choice that finds its expert full
    is dropped: it adds nothing to ``y`` (the caller's residual connection carries the
    token), and the gates of a token's kept choices are not renormalised.

    Traced under active axis rules (a strategy's step) that map the logical axis
    ``expert`` to mesh axes of more than one device, this is :func:`expert_parallel` on
    that mesh, which needs ``groups`` equal to the mesh's device count; the result is the
    same as here with the same ``groups``.

    Args:
      x: tokens, ``(tokens, dim)`` or ``(batch, length, dim)``.
      params: ``router (dim, E)``, ``w_in (E, dim, hidden)``, ``w_out (E, hidden, dim)``, and
        optionally ``b_in (E, hidden)``, ``b_out (E, dim)`` (:func:`init_moe_params`).
      top_k: experts per token, ``1 <= top_k <= E``.
      capacity_factor: > 0; at 1 each expert holds its even share of a group's choices (rounded up).
      groups: how many groups route separately (each its own capacity).

    Returns:
      ``(y, aux)``: ``y`` shaped like ``x``, and float32 ``aux`` (``T`` tokens in all groups):

      - ``load_balancing_loss``: Switch's ``E * sum_i f_i * P_i``, with ``f_i`` the fraction
        of tokens whose first choice is expert ``i`` (before capacity) and ``P_i`` the mean
        router probability of ``i``; 1 when both are uniform. Only ``P_i`` carries a gradient.
      - ``router_z_loss``: the mean over tokens of ``logsumexp(logits)**2`` (ST-MoE).
      - ``dropped_fraction``: dropped token-choices / ``(T * top_k)``, a token-choice being
        one token's assignment to one of its ``top_k`` experts.
      - ``tokens_per_expert``: ``(E,)`` token-choices routed to each expert, before capacity.
      - ``kept_per_expert``: ``(E,)`` of those each expert kept.

    Raises:
      ValueError: ``x`` or ``params`` of the wrong shapes, ``top_k`` outside ``1..E``,
        ``capacity_factor <= 0``, tokens that ``groups`` does not divide; under expert
        parallelism, the errors of :func:`expert_parallel`.
    """
    active = axes.active()
    if active is not None:  # traced under rules: expert parallel where they split ``expert`` over 2 or more devices
        mesh, rules = active
        axis = rules.mesh_axes(EXPERT)
        if axes.split_size(mesh, axis) > 1:
            hidden = rules.mesh_axes("mlp")  # each expert's hidden units, split as the dense MLP's are
            return expert_parallel(x, params, mesh=mesh, axis=axis, hidden_axis=hidden, top_k=top_k,
                                   capacity_factor=capacity_factor, groups=groups)  # fmt: skip
    tokens, dim, _, cap = _check(x, params, top_k, capacity_factor, groups)
    y, sums = _moe_groups(x.reshape(groups, -1, dim), params, top_k, cap, _experts)
    return y.reshape(x.shape), _aux(sums, tokens, top_k)


def expert_parallel(
    x: jax.Array,
    params: _Params,
    *,
    mesh: Mesh,
    axis: MeshAxes = EXPERT,
    hidden_axis: MeshAxes = None,
    top_k: int = 2,
    capacity_factor: float = 1.25,
    groups: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """:func:`moe_layer` with the experts split over ``axis`` of ``mesh`` and the tokens over all its devices.

    One group of tokens per device (group ``i`` on the ``i``-th device of the mesh in
    row-major order), routed there. Inside ``jax.shard_map``, on each device::

        dispatched = einsum(dispatch_mask, group)           # (E, 1, capacity, dim): every expert's slots
        mine = all_to_all(dispatched, axis, split 0, concat 1)  # (E/n, n, capacity, dim): my experts, n groups
        out = all_to_all(experts_i(mine), axis, split 1, concat 0)  # back to (E, 1, capacity, dim)
        y = einsum(combine_mask, out)

    where ``n`` is the size of ``axis``: each all-to-all sends ``(n-1)/n`` of the
    dispatched activations away. Every leaf but the router enters split along its
    leading (expert) axis over ``axis`` (``P(axis)``), the router replicated; the aux
    sums meet in a ``psum`` over the whole mesh. Usable under ``jax.jit`` or eagerly.

    With ``hidden_axis``, each expert's hidden units are split over it too, as a tensor-parallel
    MLP's are (Megatron's expert tensor parallelism): ``mine`` is all-gathered over ``hidden_axis``
    (every slice of an expert sees the tokens of all its ``hidden_axis`` peers), and the partial
    outputs are reduce-scattered back (``jax.lax.psum_scatter``) before ``b_out`` is added.

    Args:
      x, params, top_k, capacity_factor: as for :func:`moe_layer`.
      mesh: the devices; other axes than ``axis`` (``data``, say) split only the tokens.
      axis: the mesh axis (or axes) that splits the experts.
      hidden_axis: the mesh axis (or axes) that splits each expert's hidden units (``None``: whole).
      groups: must be the mesh's device count (``None``: that count).

    Returns:
      ``(y, aux)`` as :func:`moe_layer` gives with the same ``groups``.

    Raises:
      ValueError: the errors of :func:`moe_layer`; ``axis`` not on ``mesh``; experts that
        do not split evenly over ``axis``; ``groups`` other than the device count.
    """
    groups = mesh.size if groups is None else groups
    tokens, dim, experts, cap = _check(x, params, top_k, capacity_factor, groups)
    names = axes.axis_names(axis)
    if not names or any(name not in mesh.shape for name in names):
        raise ValueError(f"expert_parallel(axis={axis!r}): the mesh has axes {dict(mesh.shape)}; name one of them.")
    tensor = axes.axis_names(hidden_axis)
    if any(name not in mesh.shape or name in names for name in tensor):
        raise ValueError(
            f"expert_parallel(hidden_axis={hidden_axis!r}): name axes of the mesh {dict(mesh.shape)} other than "
            f"the experts' {axis!r}, or None."
        )
    hidden, t = params["w_in"].shape[-1], axes.split_size(mesh, hidden_axis)
    if hidden % t:
        raise ValueError(
            f"Each expert's {hidden} hidden units do not split over the {t} devices of hidden_axis "
            f"{hidden_axis!r}: use a hidden width that is a multiple of {t}."
        )
    n = axes.split_size(mesh, axis)
    if experts % n:
        raise ValueError(
            f"{experts} experts do not split over the {n} devices of mesh axis {axis!r}: "
            f"use a multiple of {n} experts, or an expert axis whose size divides {experts}."
        )
    if groups != mesh.size:
        raise ValueError(
            f"Expert parallelism routes each device's tokens as one group, so groups must equal the {mesh.size} "
            f"devices of mesh {dict(mesh.shape)} the tokens are split over, got groups={groups}: "
            f"pass groups={mesh.size} (and the same groups to the single-device run it should equal)."
        )

    def sliced_experts(mine: jax.Array, local: _Params) -> jax.Array:  # each device a slice of every expert
        gathered = jax.lax.all_gather(mine, tensor, axis=1, tiled=True)
        out = jax.lax.psum_scatter(_expert_sums(gathered, local), tensor, scatter_dimension=1, tiled=True)
        return out + local["b_out"][:, None, None, :] if "b_out" in local else out

    def exchange(dispatched: jax.Array, local: _Params) -> jax.Array:
        mine = jax.lax.all_to_all(dispatched, axis, 0, 1, tiled=True)  # each expert's slots to its device
        out = sliced_experts(mine, local) if tensor else _experts(mine, local)
        return jax.lax.all_to_all(out, axis, 1, 0, tiled=True)  # the results back

    def body(group: jax.Array, local: _Params) -> tuple[jax.Array, dict[str, jax.Array]]:
        y, sums = _moe_groups(group, local, top_k, cap, exchange)
        return y, jax.lax.psum(sums, tuple(mesh.axis_names))

    everywhere = P(tuple(mesh.axis_names))
    split = hidden_axis if tensor else None
    hidden_dim = {"w_in": (None, split), "w_out": (split,), "b_in": (split,), "b_out": ()}
    specs = {name: P() if name == "router" else P(axis, *hidden_dim[name]) for name in params}
    # On an Explicit mesh the regrouped tokens' place is said: each device's tokens are its one group.
    said = axes.explicit_active()
    grouped = jnp.reshape(x, (groups, -1, dim), out_sharding=everywhere if said else None)
    y, sums = jax.shard_map(body, mesh=mesh, in_specs=(everywhere, specs), out_specs=(everywhere, P()))(
        grouped, dict(params)
    )
    back = jnp.reshape(y, x.shape, out_sharding=jax.typeof(x).sharding.spec if said else None)
    return back, _aux(sums, tokens, top_k)


def check_routing(experts: int, top_k: int, capacity_factor: float) -> None:
    """Raise unless ``top_k`` is a whole number in ``1..experts`` and ``capacity_factor`` a finite number > 0.

    ``capacity_factor`` sets the size of every expert's buffer, a shape, so it is a Python (or
    NumPy) number, never an array traced by ``jax.jit``.

    >>> check_routing(8, top_k=2, capacity_factor=1.25)
    >>> check_routing(4, top_k=5, capacity_factor=1.25)
    Traceback (most recent call last):
    ValueError: top_k=5 but there are 4 experts: choose a whole number 1 <= top_k <= 4.

    Raises:
      TypeError: a ``capacity_factor`` that is not a number (a string, or a traced array).
      ValueError: ``top_k`` out of range, or a ``capacity_factor`` that is not finite and > 0.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(
            f"top_k={top_k!r} but there are {experts} experts: choose a whole number 1 <= top_k <= {experts}."
        )
    if isinstance(capacity_factor, jax.core.Tracer):
        raise TypeError(
            "capacity_factor is traced by jax.jit, but it sets the size of each expert's buffer, a shape fixed "
            "when the step compiles: pass it as a Python number (close over it, or mark it static with "
            "jax.jit(..., static_argnames='capacity_factor'))."
        )
    if not is_number(capacity_factor):
        raise TypeError(f"capacity_factor={capacity_factor!r} is not a number: pass one such as 1.25.")
    if not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(
            f"capacity_factor must be > 0 and finite, got {capacity_factor!r}: each expert keeps "
            "ceil(capacity_factor * top_k * tokens_per_group / experts) tokens of a group (1.25 is usual; "
            "experts / top_k keeps every token)."
        )


def _check(x: jax.Array, params: _Params, top_k: int, capacity_factor: float, groups: int) -> tuple[int, int, int, int]:
    """``(tokens, dim, experts, a group's capacity)``, or a ValueError saying what is wrong with the arguments."""
    missing = [name for name in _REQUIRED if name not in params]
    unknown = [name for name in params if name not in _SHAPES]
    if missing or unknown:
        raise ValueError(
            f"moe_layer params need {list(_REQUIRED)} and may add 'b_in', 'b_out'; missing {missing}, unknown "
            f"{unknown}. Build them with pk.experts.init_moe_params."
        )
    dim, experts = params["router"].shape
    hidden = params["w_in"].shape[-1]
    sizes = {"dim": dim, "experts": experts, "hidden": hidden}
    for name, leaf in params.items():
        expected = tuple(sizes[n] for n in _SHAPES[name])
        if tuple(leaf.shape) != expected:
            raise ValueError(
                f"params[{name!r}] has shape {tuple(leaf.shape)}, but the router {(dim, experts)} and w_in's hidden "
                f"width {hidden} make it {expected} ({', '.join(_SHAPES[name])})."
            )
    if x.ndim not in (2, 3) or x.shape[-1] != dim:
        raise ValueError(
            f"moe_layer takes x of shape (tokens, {dim}) or (batch, length, {dim}) for a router of {dim} inputs, "
            f"got {x.shape}."
        )
    check_routing(experts, top_k, capacity_factor)
    tokens = math.prod(x.shape[:-1])
    if not is_count(groups) or tokens % groups:
        raise ValueError(
            f"{tokens} tokens do not cut into groups={groups!r} equal groups: use a whole number of groups that "
            f"divides {tokens}."
        )
    return tokens, dim, experts, capacity(tokens // groups, experts, top_k, capacity_factor)


def _route(group: jax.Array, router: jax.Array, top_k: int, cap: int):
    """Dispatch and combine masks ``(g, s, E, cap)`` for groups ``(g, s, dim)``, and the aux sums over them."""
    logits = jnp.einsum("gsd,de->gse", group, router).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)  # (g, s, k), highest first; ties: the lower index
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    g, s, experts = probs.shape
    chosen = jax.nn.one_hot(top_i, experts, dtype=jnp.int32)  # (g, s, k, E)
    # A choice's slot in its expert's buffer: its expert's choices before it, all first choices (token order) first
    in_order = jnp.swapaxes(chosen, 1, 2).reshape(g, top_k * s, experts)
    before = jnp.swapaxes((jnp.cumsum(in_order, axis=1) - in_order).reshape(g, top_k, s, experts), 1, 2)
    slot = jnp.sum(before * chosen, axis=-1)  # (g, s, k)
    kept = chosen * (slot < cap)[..., None]  # (g, s, k, E)
    slots = jax.nn.one_hot(slot, cap, dtype=jnp.float32)  # a slot >= cap (dropped) is all zeros
    dispatch = jnp.einsum("gske,gskc->gsec", kept.astype(jnp.float32), slots)
    combine = jnp.einsum("gske,gsk,gskc->gsec", kept.astype(jnp.float32), gates, slots)
    sums = {
        "first": jnp.sum(chosen[:, :, 0], axis=(0, 1)).astype(jnp.float32),
        "probs": jnp.sum(probs, axis=(0, 1)),
        "z": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
        "routed": jnp.sum(chosen, axis=(0, 1, 2)).astype(jnp.float32),
        "kept": jnp.sum(kept, axis=(0, 1, 2)).astype(jnp.float32),
    }
    return dispatch.astype(group.dtype), combine, sums


def _moe_groups(
    group: jax.Array, params: _Params, top_k: int, cap: int, apply: Callable[[jax.Array, _Params], jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Route groups ``(g, s, dim)``, run ``apply`` on the dispatched ``(E, g, cap, dim)``, combine."""
    dispatch, combine, sums = _route(group, params["router"], top_k, cap)
    dispatched = jnp.einsum("gsec,gsd->egcd", dispatch, group)
    out = apply(dispatched, params)
    return jnp.einsum("gsec,egcd->gsd", combine, out).astype(group.dtype), sums


def _experts(tokens: jax.Array, params: _Params) -> jax.Array:
    """Each expert's feed-forward network on its slots: ``(e, g, cap, dim)`` with ``e`` the experts of ``params``."""
    out = _expert_sums(tokens, params)
    if "b_out" in params:
        out = out + params["b_out"][:, None, None, :]
    return out


def _expert_sums(tokens: jax.Array, params: _Params) -> jax.Array:
    """:func:`_experts` before ``b_out``: the sums over ``params``' hidden units (a slice of them, or all)."""
    h = jnp.einsum("egcd,edh->egch", tokens, params["w_in"])
    if "b_in" in params:
        h = h + params["b_in"][:, None, None, :]
    return jnp.einsum("egch,ehd->egcd", jax.nn.gelu(h), params["w_out"])


def _aux(sums: dict[str, jax.Array], tokens: int, top_k: int) -> dict[str, jax.Array]:
    """The aux quantities of :func:`moe_layer` from the sums over all groups."""
    experts = sums["first"].shape[0]
    f = jax.lax.stop_gradient(sums["first"]) / tokens
    return {
        "load_balancing_loss": experts * jnp.sum(f * sums["probs"] / tokens),
        "router_z_loss": sums["z"] / tokens,
        "dropped_fraction": 1.0 - jnp.sum(sums["kept"]) / (tokens * top_k),
        "tokens_per_expert": sums["routed"],
        "kept_per_expert": sums["kept"],
    }
