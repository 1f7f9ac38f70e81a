"""Heavy steps on a Ray cluster: stage-1 Gram shards and benchmark items, on actors that load the frozen pair once.

One switch for all of it: `workers` > 1 or a Ray address (`--ray-address`, or the RAY_ADDRESS environment
variable) sends the work to Ray; without them everything runs in this process as before. Results equal the
one-process path (bit for bit for stage 1):

- Stage 1: the content-addressed 32-sample shards of tasks/fit.py (`shard_samples`) are the unit of work. Each
  actor returns its shard's fp64 sums; this process stores them under their content address (so a re-run, on Ray
  or not, reuses them) and merges all shards in shard order, exactly as `tasks.fit.sharded_stats` does. A shard's
  sums do not depend on which process computed it (same weights, checked through the model signatures; same
  kernels: on this CPU the captures and Gram products are bit-identical at 1 and 2 threads).
- Evaluation: tasks/evaluate.py splits the work into (benchmark, condition, item shard) units over the actors
  (`_score_on_ray`): each item-sharded benchmark's items go to `workers` shards by their index in the runner's
  deterministic item list (`BenchContext.owns`), and the shards' {item id: score} merge into the one-process
  mapping, so rows and paired CIs hold the same items and counts; their fp32 KL scores agree to rounding (an
  actor runs one thread, this process may run more, and fp32 matmul sums depend on the thread count on some
  CPUs).

Actors read models by name from their own KVLINGO_HOME (passed from this process, for clusters on one shared
filesystem; on other clusters set it on every node) and take one GPU each when the cluster has GPUs
(`use_gpu`), else one CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from translators.errors import ConfigError, KvlingoError

# Environment the actors inherit from this process (model store, offline switches).
_PASSED_ENV = ("KVLINGO_HOME", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
               "OMP_WAIT_POLICY")


class ClusterError(KvlingoError):
    """The Ray cluster could not be reached or an actor failed (the cause is named)."""


def ray_address(address: str | None = None) -> str | None:
    """The cluster to join: `address`, else RAY_ADDRESS, else None (a local Ray started by kvlingo)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def use_ray(workers: int, address: str | None = None) -> bool:
    """True when work goes to Ray: more than one worker, or a cluster address (argument or RAY_ADDRESS)."""
    return workers > 1 or ray_address(address) is not None


def connect(address: str | None = None) -> None:
    """Join the cluster at `address` (or RAY_ADDRESS), or start a quiet local Ray (tasks.distill.ray_init).

    Raises:
        ClusterError: the address cannot be reached.
    """
    from tasks.distill import ray_init

    try:
        ray_init(ray_address(address))
    except ConnectionError as err:
        raise ClusterError(f"cannot reach the Ray cluster at {ray_address(address)}: {err}. Start it with "
                           "`ray start --head`, or drop --ray-address / unset RAY_ADDRESS to run in one process") from None


def actor_env() -> dict[str, str]:
    from infra.settings import kvlingo_home

    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    env["KVLINGO_HOME"] = str(kvlingo_home())
    return env


class PairWorker:
    """A Ray actor holding the frozen pair (loaded once), for stage-1 shards and benchmark items.

    Raises (at construction): PairMismatchError when its models' signatures differ from the driver's (another
    build of a model on that node).
    """

    def __init__(self, source: str, target: str, signatures: dict | None, threads: int):
        import torch

        from infra.zoo import load_model, model_signature

        torch.set_num_threads(threads)
        self.source, self.target = load_model(source), load_model(target)
        if signatures is not None:
            mine = {"source": model_signature(self.source), "target": model_signature(self.target)}
            if mine != signatures:
                from translators.errors import PairMismatchError

                changed = [role for role in mine if mine[role] != signatures[role]]
                raise PairMismatchError(f"a Ray worker loaded other weights for the {' and '.join(changed)} than the "
                                        "driver: every node must hold the same model files (KVLINGO_HOME)")

    def ping(self) -> bool:
        return True

    def gram_shard(self, spec: dict[str, Any], samples: list) -> dict:
        """fp64 statistics {object name: GramStats} of one shard (`samples`: (prefix ids, continuation ids), or
        cross-tokenizer samples)."""
        from translators.cross import accumulate_samples
        from translators.stage1 import Side, empty_stats

        src, tgt = Side(self.source.model, self.source.layout), Side(self.target.model, self.target.layout)
        tokens = None
        if spec["token_identity"]:
            from translators.token_identity import make_token_identity

            tokens = make_token_identity(spec["token_identity"], self.source.model, self.source.layout,
                                         self.target.model, spec["point"])
        stats = empty_stats(self.source.layout, self.target.layout, spec["candidates"],
                            token_width=tokens.width if tokens else 0)
        accumulate_samples(stats, src, tgt, samples, spec["point"], weighting=spec["weighting"], token_identity=tokens)
        return stats

    def call(self, fn: Callable, *args) -> Any:
        """Run `fn(source, target, *args)` on the loaded pair (benchmark items, tasks/evaluate.py)."""
        return fn(self.source, self.target, *args)


_POOLS: dict[tuple, list] = {}


def workers_for(source: str, target: str, *, workers: int, address: str | None = None, signatures: dict | None = None,
                use_gpu: bool = False) -> list:
    """`workers` PairWorker actors for the pair, created once per process and reused (stage-1 train and held-out
    shards, then the benchmarks).

    Raises:
        ClusterError: the cluster cannot be reached, or the actors cannot start (the cause is named).
    """
    import ray

    if workers < 1:
        raise ConfigError(f"workers must be ≥ 1, got {workers}")
    connect(address)
    key = (source, target, workers, ray_address(address), use_gpu)
    if key in _POOLS:
        return _POOLS[key]
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // workers)
    actor = ray.remote(PairWorker).options(
        num_cpus=0 if use_gpu else 1, num_gpus=1 if use_gpu else 0, runtime_env={"env_vars": actor_env()})
    actors = [actor.remote(source, target, signatures, cpus) for _ in range(workers)]
    try:
        ray.get([a.ping.remote() for a in actors])
    except Exception as err:  # an actor failed to start: report why
        for a in actors:
            ray.kill(a)
        raise ClusterError(f"Ray workers for {source} → {target} failed to start: {_cause(err)}") from None
    _POOLS[key] = actors
    return actors


_FREE: dict[int, Any] = {}  # id(actor list) → queue.Queue of idle actors, for callers on several threads


def on_free_actor(actors: list, method: str, *args) -> Any:
    """Call `actor.<method>(*args)` on an idle actor of `actors`, waiting for one; safe from several threads at
    once (sweep cells), each call holding its actor until it returns.

    Raises:
        the call's KvlingoError as it is; ClusterError for any other failure.
    """
    import queue

    import ray

    free = _FREE.get(id(actors))
    if free is None:
        free = _FREE.setdefault(id(actors), queue.Queue())
        for a in actors:
            free.put(a)
    actor = free.get()
    try:
        return ray.get(getattr(actor, method).remote(*args))
    except Exception as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, KvlingoError):
            raise cause from None
        raise ClusterError(f"a Ray worker failed in {method}: {_cause(err)}") from None
    finally:
        free.put(actor)


def release_workers() -> None:
    """Kill the cached actors (their CPUs, GPUs and models' memory go back to the cluster: stage 2's Ray Train
    workers need them). A no-op when none exist."""
    if not _POOLS:
        return
    import ray

    for actors in _POOLS.values():
        _FREE.pop(id(actors), None)
        for a in actors:
            ray.kill(a)
    _POOLS.clear()


def _cause(err: Exception) -> str:
    cause = getattr(err, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else f"{type(err).__name__}: {err}"


def ordered_map(actors: list, method: str, items: Sequence, *args, on_result: Callable[[int, Any], None] | None = None) -> list:
    """Call `actor.<method>(*args, item)` for every item, at most one call in flight per actor; results in item
    order (as `ray.util.ActorPool.map`). With `on_result`, each result goes to it as it arrives and the list
    returned is empty: a caller that stores results (e.g. statistics shards, each as large as their sum) does not
    hold them all at once.

    Raises:
        ClusterError: a call failed (the first failure's cause; KvlingoErrors re-raised as they are).
    """
    from ray.util import ActorPool

    pool = ActorPool(actors)
    out = []
    try:
        for i, result in enumerate(pool.map(lambda a, item: getattr(a, method).remote(*args, item), list(items))):
            if on_result:
                on_result(i, result)
            else:
                out.append(result)
    except Exception as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, KvlingoError):
            raise cause from None
        raise ClusterError(f"a Ray worker failed in {method}: {_cause(err)}") from None
    return out
